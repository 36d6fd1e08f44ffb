"""Loud ETL results: an empty token dataset stops the run, a suspicious one warns, both saying why.

The usual cause is an input whose diagnosis codes the reader does not recognise (a MEDS export in a code
style outside ``etl.meds.code_patterns``): every row is filtered. The message then lists the most frequent
code prefixes of the filtered rows and names the setting to change.
"""

from __future__ import annotations

from typing import Any

from behrt_rope.errors import UserError

SUSPICIOUS_SHARE = 0.95  # more than this share of input rows filtered or quarantined gives a warning
TOP_PREFIXES = 8

_ADVICE = {
    "meds": "set etl.meds.code_patterns to a TEMPLATE=REGEX style that selects your diagnosis codes, "
    "e.g. 'SNOMED=^SNOMED//(?P<code>[^/]+)$' (docs/formats.md lists the recognised styles)",
    "omop": "check condition_occurrence and etl.omop.code_source / etl.omop.vocabulary (docs/formats.md)",
    "visits": "check the events table's patient_id, date and code columns (docs/formats.md)",
}


class EmptyResultError(UserError):
    """The ETL produced no patient or no code token."""


def check(manifest: dict[str, Any]) -> list[str]:
    """Raise :class:`EmptyResultError` for an empty result; return warnings for a suspicious one.

    >>> m = {"format": "meds", "input": "in", "tables": {"data/0.parquet": {"rows": 10, "used": 0,
    ...      "quarantined": 0, "duplicates_dropped": 0, "filtered": 10}}, "quarantine_reasons": {},
    ...      "patients": {"with_tokens": 0}, "events_used": {"code_tokens": 0},
    ...      "filtered_code_prefixes": {"SNOMED//": 6, "LOINC//": 4}}
    >>> check(m)
    Traceback (most recent call last):
    ...
    behrt_rope.etl.diagnostics.EmptyResultError: etl: in gave no patient with a code token (10 input rows: \
0 used, 10 filtered, 0 quarantined; most frequent code prefixes of the filtered rows: SNOMED// 6, LOINC// 4); \
set etl.meds.code_patterns to a TEMPLATE=REGEX style that selects your diagnosis codes, \
e.g. 'SNOMED=^SNOMED//(?P<code>[^/]+)$' (docs/formats.md lists the recognised styles)
    >>> m["patients"]["with_tokens"], m["events_used"]["code_tokens"] = 1, 3
    >>> check(m)[0].startswith("etl: 100.0% of the 10 input rows were filtered or quarantined")
    True
    """
    detail = _detail(manifest)
    advice = _ADVICE.get(str(manifest.get("format")), "")
    if manifest["patients"]["with_tokens"] == 0 or manifest["events_used"]["code_tokens"] == 0:
        what = "patient with a code token" if manifest["patients"]["with_tokens"] == 0 else "code token"
        raise EmptyResultError(f"etl: {manifest['input']} gave no {what} ({detail}); {advice}")
    rows = sum(t["rows"] for t in manifest["tables"].values())
    lost = sum(t["filtered"] + t["quarantined"] for t in manifest["tables"].values())
    if rows and lost / rows > SUSPICIOUS_SHARE:
        return [
            f"etl: {100 * lost / rows:.1f}% of the {rows:,} input rows were filtered or quarantined ({detail}); "
            f"if your diagnoses are among them, {advice}"
        ]
    return []


def _detail(manifest: dict[str, Any]) -> str:
    """Row counts, the top filtered code prefixes and the quarantine reasons, in one clause."""
    tables = manifest["tables"].values()
    total = {k: sum(t[k] for t in tables) for k in ("rows", "used", "filtered", "quarantined")}
    text = (
        f"{total['rows']:,} input rows: {total['used']:,} used, {total['filtered']:,} filtered, "
        f"{total['quarantined']:,} quarantined"
    )
    prefixes = manifest.get("filtered_code_prefixes") or {}
    if prefixes:
        top = list(prefixes.items())[:TOP_PREFIXES]
        text += "; most frequent code prefixes of the filtered rows: " + ", ".join(f"{p} {n:,}" for p, n in top)
    reasons = manifest.get("quarantine_reasons") or {}
    if reasons:
        text += "; quarantine reasons: " + ", ".join(f"{r} {n:,}" for r, n in sorted(reasons.items()))
    return text
