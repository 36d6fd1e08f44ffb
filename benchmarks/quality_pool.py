"""Pool fresh draws of the quality benchmark: one figure per cohort family, with an interval.

    python benchmarks/quality_pool.py benchmarks/results/quality/*.json [--markdown TABLE.md]

One draw's "% of the gap closed" has a wide interval (a clinical draw's is often 40 points wide): its
macro AP averages a few hundred positives per rare code. Whether a family meets a bar is a question about
the mean over draws, so this reads the JSON that ``benchmarks/quality.py`` printed for several draws (each
a cohort drawn afresh with ``--seed-offset``) and reports, per family and predictor, the mean of the draws'
points and two 95% intervals for it:

* ``ci``, for the mean of *these* draws: draws are independent (their own seeds), so the mean's standard
  error is ``sqrt(sum se_i^2) / n``, each draw's ``se_i`` read off its bootstrap interval (width / 3.92);
* ``across_cohorts_ci``, for the family's mean over cohorts *not yet drawn* (what a claim about unseen
  cohorts needs): a Student-t interval from the spread of the points between draws (``between_draws_sd``),
  which holds both each draw's own noise and how far cohorts of one family really differ. It is wider, and
  with two or three draws much wider (t = 12.7 and 4.3).

The same for the model's lead over gradient boosting, with how many draws it leads on and on how many clearly
(interval above 0).

Prints ONE JSON object. Only draws at the same settings should be pooled: the script refuses draws of one
family with different ``overrides`` or split.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from scipy.stats import t as student_t

from behrt_rope.evaluation.ceiling import format_share

Z95 = 1.959964
DEEP, LEARNED = "model_deep_part", "model_learned_parts"
POOLED = ("model", DEEP, LEARNED, "gradient_boosting", "sparse_time_regression")
"""Predictors whose gap closed is pooled (each over the draws that have it)."""
SHARES = ("gap_closed", "gap_closed_one_cut", "gap_closed_record")
"""Each predictor's shares: of the gap from the every-visit and from the one-cut regression to the state
oracle, and from the every-visit regression to the record oracle (clinical draws measured against it)."""


def standard_error(entry: dict[str, Any] | None) -> float | None:
    """The standard error a ``{"point", "ci": [low, high]}`` entry's 95% interval implies; None without one.

    >>> round(standard_error({"point": 0.5, "ci": [0.304, 0.696]}), 3)
    0.1
    """
    ci = (entry or {}).get("ci")
    if not ci or ci[0] is None or ci[1] is None or not all(map(math.isfinite, ci)):
        return None
    return (ci[1] - ci[0]) / (2 * Z95)


def pool(entries: Sequence[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The mean of the entries' points, its 95% interval from their standard errors (independent draws) and,
    with two draws or more, its Student-t interval over cohorts (the module docstring); None when no entry has
    a point. Entries without an interval count in the mean, and the first interval is then left out.

    >>> pooled = pool([{"point": 0.6, "ci": [0.5, 0.7]}, {"point": 0.8, "ci": [0.7, 0.9]}])
    >>> pooled["ci"], pooled["across_cohorts_ci"]
    ([0.6293, 0.7707], [-0.5706, 1.9706])
    """
    measured = [e for e in entries if e and e.get("point") is not None]
    if not measured:
        return None
    points, errors = [e["point"] for e in measured], [standard_error(e) for e in measured]
    n = len(points)
    mean = sum(points) / n
    sd = math.sqrt(sum((p - mean) ** 2 for p in points) / (n - 1)) if n > 1 else None
    pooled: dict[str, Any] = {"point": round(mean, 4), "draws": n, "between_draws_sd": sd and round(sd, 4)}
    if sd is not None:
        half = float(student_t.ppf(0.975, n - 1)) * sd / math.sqrt(n)
        pooled["across_cohorts_ci"] = [round(mean - half, 4), round(mean + half, 4)]
    if all(e is not None for e in errors):
        se = math.sqrt(sum(e * e for e in errors if e is not None)) / n
        pooled["ci"] = [round(mean - Z95 * se, 4), round(mean + Z95 * se, 4)]
    return pooled


def draws_by_family(files: Sequence[Path]) -> dict[str, list[dict[str, Any]]]:
    """Every ``(family, draw)`` of the files: ``{family: [{"file", "seed_offset", "settings", "cohort"}]}``,
    each family's draws in seed order; raises when one family's draws were run at different settings."""
    families: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for file in files:
        run = json.loads(file.read_text())
        if run.get("benchmark") != "quality":
            raise SystemExit(f"{file}: not an output of benchmarks/quality.py")
        settings = {k: run.get(k) for k in ("overrides", "split", "patients", "task")}
        for family, cohort in run["cohorts"].items():
            if "at_oracle_cuts" in cohort:
                families[family].append(
                    {"file": file.name, "seed_offset": run["seed_offset"], "settings": settings, "cohort": cohort}
                )
    for family, draws in families.items():
        if any(d["settings"] != draws[0]["settings"] for d in draws):
            raise SystemExit(f"{family}: draws at different settings cannot be pooled: {[d['file'] for d in draws]}")
        draws.sort(key=lambda d: d["seed_offset"])
    return dict(families)


def record_share(cohort: dict[str, Any]) -> float | None:
    """The share of the state oracle's gap (from the every-visit regression) that the record oracle closes,
    the most any model of the recorded history can close; None where the draw has no record oracle.

    >>> cuts = {"logistic_regression": {"macro_ap": {"point": 0.2}}, "oracle": {"macro_ap": {"point": 0.3}}}
    >>> round(record_share({"at_oracle_cuts": cuts, "record_oracle_macro_ap": {"point": 0.28}}), 2)
    0.8
    """
    record = (cohort.get("record_oracle_macro_ap") or {}).get("point")
    if record is None:
        return None
    cuts = cohort["at_oracle_cuts"]
    low, high = cuts["logistic_regression"]["macro_ap"]["point"], cuts["oracle"]["macro_ap"]["point"]
    return (record - low) / (high - low)


def oracle_cuts(cohort: dict[str, Any]) -> dict[str, Any]:
    """A draw's figures at the oracle's cuts. Where its chains had no share, its learned parts (the model
    without the sparse time path) are its deep part, a row the evaluation leaves out as a duplicate: it is
    filled in here so that every such draw counts. Draws from before the learned parts were scored, with
    chains that had a share, have none.

    >>> cohort = {"at_oracle_cuts": {DEEP: {"gap_closed": 0.6}}, "finetune_choices": {"state_path_share": 0.0}}
    >>> oracle_cuts(cohort)[LEARNED]
    {'gap_closed': 0.6}
    >>> LEARNED in oracle_cuts({**cohort, "finetune_choices": {"state_path_share": 0.5}})
    False
    """
    cuts = dict(cohort["at_oracle_cuts"])
    chains_share = (cohort.get("finetune_choices") or {}).get("state_path_share")
    if LEARNED not in cuts and DEEP in cuts and chains_share == 0:
        cuts[LEARNED] = cuts[DEEP]
    return cuts


def family_summary(draws: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per-draw figures and their pooled means for one family (see the module docstring)."""
    cuts = [oracle_cuts(d["cohort"]) for d in draws]
    leads = [c["gradient_boosting"].get("model_minus_this") for c in cuts]
    ceilings = [record_share(d["cohort"]) for d in draws]
    return {
        "draws": [
            {
                "seed_offset": d["seed_offset"],
                "cuts": c["n_samples"],
                "train_wall_s": d["cohort"]["train_wall_s"],
                **{p: {s: (c[p].get(s) or {}).get("point") for s in SHARES} for p in POOLED if p in c},
                "model_minus_gradient_boosting": lead,
                "record_oracle_share_of_gap": ceiling,
            }
            for d, c, lead, ceiling in zip(draws, cuts, leads, ceilings, strict=True)
        ],
        "pooled": {
            p: {s: pool([c[p].get(s) for c in cuts if p in c]) for s in SHARES}
            for p in POOLED
            if any(p in c for c in cuts)
        },
        "model_minus_gradient_boosting": {
            **(pool(leads) or {}),
            "draws_ahead": sum(1 for lead in leads if lead and lead["point"] > 0),
            "draws_clearly_ahead": sum(1 for lead in leads if lead and lead.get("ci") and lead["ci"][0] > 0),
        },
        "record_oracle_share_of_gap": pool([{"point": c} for c in ceilings if c is not None]),
        "max_train_wall_s": max(d["cohort"]["train_wall_s"] for d in draws),
    }


def markdown(summary: dict[str, Any]) -> str:
    """The docs table: per family, the pooled gap closed of the model (every-visit / one-cut regression, the
    interval of each over cohorts, and against the record oracle where measured, with the share of the gap
    the record oracle itself closes), of its deep part and its learned parts (with the number of draws that
    have them), gradient boosting's, and the lead."""

    share = format_share

    def learned(pooled: dict[str, Any]) -> str:
        entry = (pooled.get(LEARNED) or {}).get("gap_closed")
        return f"{share(entry)} [{entry['draws']}]" if entry else "–"

    def across(entry: dict[str, Any] | None) -> str:
        low, high = (entry or {}).get("across_cohorts_ci") or [None, None]
        return "–" if low is None else f"{100 * low:.0f}% to {100 * high:.0f}%"

    lines = [
        "| family (draws) | model | model, one cut | model over cohorts (t 95%): every visit / one cut "
        "| model vs record (record oracle's share) | deep part | learned parts [draws] | gradient boosting "
        "| model - GB (95%), draws ahead / clearly |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for family, fam in summary["families"].items():
        pooled, lead = fam["pooled"], fam["model_minus_gradient_boosting"]
        ci = lead.get("ci") or [math.nan, math.nan]
        ceiling = fam["record_oracle_share_of_gap"]
        record = share(pooled["model"]["gap_closed_record"]) + (f" ({share(ceiling)})" if ceiling else "")
        lines.append(
            f"| `{family}` ({len(fam['draws'])}) | {share(pooled['model']['gap_closed'])} "
            f"| {share(pooled['model']['gap_closed_one_cut'])} "
            f"| {across(pooled['model']['gap_closed'])} / {across(pooled['model']['gap_closed_one_cut'])} | {record} "
            f"| {share(pooled[DEEP]['gap_closed'])} | {learned(pooled)} "
            f"| {share(pooled['gradient_boosting']['gap_closed'])} "
            f"| {lead['point']:+.4f} ({ci[0]:+.4f}, {ci[1]:+.4f}), {lead['draws_ahead']} / "
            f"{lead['draws_clearly_ahead']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="JSON outputs of benchmarks/quality.py")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the docs table here")
    args = parser.parse_args(argv)
    families = draws_by_family(args.runs)
    summary = {
        "benchmark": "quality_pool",
        "runs": sorted(p.name for p in args.runs),
        "families": {f: family_summary(d) for f, d in sorted(families.items())},
    }
    print(json.dumps(summary, indent=2))
    if args.markdown:
        args.markdown.write_text(markdown(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
