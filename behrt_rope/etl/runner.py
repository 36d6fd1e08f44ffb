"""The ETL as a whole: read shard by shard, clean, structure, fit the vocabulary, write tokens and manifest.

Memory holds one patient shard at a time (``shards`` setting): the input's schemas are checked once (the
reader's plan), then each pass reads the input in streaming batches and keeps only the rows of its shard's
patients (a hash of the patient id picks the shard), turns them into canonical tables, writes
that shard's structured visits to a temporary folder, and counts its train codes. The vocabulary is fitted
on the summed counts; a last pass turns each shard into ``tokens/part-NNNNN.parquet``.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm.auto import tqdm

from behrt_rope import atomic
from behrt_rope import config as config_lib
from behrt_rope import schema as S
from behrt_rope.etl import descriptions
from behrt_rope.etl.clean import Cleaned, EventCodes, clean, quarantine_rows
from behrt_rope.etl.codes import fit_vocabulary, token_codes
from behrt_rope.etl.config import EtlConfig
from behrt_rope.etl.raw import RawTables
from behrt_rope.etl.readers import ShardSource
from behrt_rope.etl.sex import unrecognised_values
from behrt_rope.etl.split import assign_splits
from behrt_rope.etl.tokenize import Structured, structure, to_token_table

log = logging.getLogger(__name__)
TMP_DIR = ".shards"
SEX_EXAMPLES = 10  # the most frequent raw sex values read as 'other' that the manifest lists


@dataclass
class ShardResult:
    """What one shard contributes: structured visits, splits, quarantine and counts."""

    structured: Structured
    splits: np.ndarray  # per structured patient
    quarantine: pd.DataFrame
    counts: dict[str, Counter[str]]  # per source table: rows, used, quarantined, duplicates_dropped, filtered
    reasons: Counter[str]
    used_events: int
    notes: dict[str, Any] = field(default_factory=dict)
    patient_id_type: str = "string"
    filtered_prefixes: Counter[str] = field(default_factory=Counter)
    descriptions: pd.DataFrame | None = None  # raw CODE, CODE_SYSTEM, DESCRIPTION rows from the reader
    train_counts: Counter[str] = field(default_factory=Counter)  # per token, train-split visits holding it
    sex_unrecognised: Counter[str] = field(default_factory=Counter)  # raw sex values read as 'other'


def process_shard(raw: RawTables, config: EtlConfig) -> ShardResult:
    """Clean, structure and split one shard of canonical tables."""
    cleaned = clean(raw.patients, raw.events)
    codes = cleaned.codes if cleaned.codes is not None else EventCodes.of(cleaned.events)
    tokens = token_codes(codes.code, codes.code_uniques, codes.system, codes.system_uniques, config)
    structured = structure(
        cleaned.events,
        tokens,
        cleaned.patients,
        config.max_seq_len,
        codes=codes,
        keep_first_records=config.keep_first_records,
    )
    quarantine = cleaned.quarantine
    if structured.too_long.any():
        too_long = np.where(structured.too_long, S.Reason.VISIT_TOO_LONG, "").astype(object)
        quarantine = pd.concat(
            [quarantine, quarantine_rows(cleaned.events, too_long, S.TIME_RAW, S.CODE)], ignore_index=True
        )
    ids = structured.patients[S.PATIENT_ID].to_numpy(dtype=object)
    splits = assign_splits(ids, config.split)
    if raw.source_splits is not None and len(raw.source_splits):
        given = raw.source_splits.set_index(S.PATIENT_ID)[S.SPLIT]
        from_source = given.reindex(ids).to_numpy(dtype=object)
        splits = np.where(pd.isna(from_source), splits, from_source)
    counts = _counts(raw, cleaned, structured.too_long, quarantine)
    return ShardResult(
        structured,
        splits,
        quarantine,
        counts,
        Counter(quarantine[S.REASON].tolist()),
        int((~structured.too_long).sum()),
        raw.notes,
        raw.patient_id_type,
        raw.filtered_prefixes,
        raw.descriptions,
        sex_unrecognised=Counter(unrecognised_values(raw.patients.get(S.SEX_RAW, pd.Series(dtype=object)))),
    )


def _counts(
    raw: RawTables, cleaned: Cleaned, too_long: np.ndarray, quarantine: pd.DataFrame
) -> dict[str, Counter[str]]:
    """Per source table: rows read and where each went (used, quarantined, duplicates_dropped, filtered)."""
    counts: dict[str, Counter[str]] = {}
    for table, n in raw.rows_read.items():
        counts[table] = Counter(rows=n, filtered=raw.filtered.get(table, 0))
    events = cleaned.events[S.SOURCE_TABLE]
    for used in (cleaned.patients[S.SOURCE_TABLE], events[~too_long] if too_long.any() else events):
        for name, n in used.value_counts().items():
            counts.setdefault(str(name), Counter())["used"] += int(n)
    is_dup = quarantine[S.REASON] == S.Reason.DUPLICATE
    for key, rows in (("duplicates_dropped", quarantine[is_dup]), ("quarantined", quarantine[~is_dup])):
        for name, n in rows[S.SOURCE_TABLE].value_counts().items():
            counts.setdefault(str(name), Counter())[key] += int(n)
    return counts


def run_etl(input_dir: Path, out_dir: Path, config: EtlConfig, progress: bool = True) -> dict[str, Any]:
    """Run the whole ETL from ``input_dir`` into ``out_dir``; return the manifest (also written)."""
    started = time.perf_counter()
    clear_outputs(out_dir)
    tmp = out_dir / TMP_DIR if config.shards > 1 else None
    src = ShardSource.open(input_dir, config)  # schemas checked before any row is read
    results = []
    for shard in tqdm(range(config.shards), desc="etl: reading shards", disable=not progress or config.shards == 1):
        results.append(first_pass(src.read(shard, config.shards), config, shard, tmp))  # raw batches freed by now
    vocabulary = fit_vocabulary(sum_train_counts(results), config.min_code_count)
    token_stats = [write_shard_tokens(result, vocabulary, shard, out_dir, tmp) for shard, result in enumerate(results)]
    manifest = finish_etl(results, vocabulary, token_stats, config, input_dir, out_dir)
    manifest["seconds"] = round(time.perf_counter() - started, 3)
    return manifest


def first_pass(raw: RawTables, config: EtlConfig, shard: int, tmp: Path | None) -> ShardResult:
    """First pass over one patient shard's canonical tables: clean, structure, count train codes; with
    ``tmp``, move its tables to ``tmp/NNNNN`` so that only counts stay in memory. Both engines call it."""
    result = process_shard(raw, config)
    result.train_counts = _train_token_counts(result)
    if tmp is not None:
        _spill(result, tmp / f"{shard:05d}")
    return result


def sum_train_counts(results: list[ShardResult]) -> pd.Series:
    """Per token, train-split visits holding it, over all shards (the input of ``fit_vocabulary``)."""
    total: Counter[str] = Counter()
    for result in results:
        total.update(result.train_counts)
    return pd.Series(total, dtype="int64")


def write_shard_tokens(
    result: ShardResult, vocabulary: pd.DataFrame, shard: int, out_dir: Path, tmp: Path | None
) -> dict[str, Any]:
    """Second pass: one shard's token table, written as ``tokens/part-NNNNN.parquet``; returns its stats."""
    structured = _unspill(tmp / f"{shard:05d}") if tmp is not None else result.structured
    table = to_token_table(structured, vocabulary, result.splits)
    tokens_dir = out_dir / S.TOKENS_DIR
    tokens_dir.mkdir(parents=True, exist_ok=True)
    with atomic.atomic_path(tokens_dir / f"part-{shard:05d}.parquet") as part:  # crash-safe: whole or absent
        pq.write_table(table, part)
    return _token_stats(table)


def finish_etl(
    results: list[ShardResult],
    vocabulary: pd.DataFrame,
    token_stats: list[dict[str, Any]],
    config: EtlConfig,
    input_dir: Path,
    out_dir: Path,
) -> dict[str, Any]:
    """Quarantine, vocabulary file and manifest, once every shard's tokens are written."""
    tmp = out_dir / TMP_DIR
    spilled = [pd.read_parquet(q) for q in sorted(tmp.glob(f"*/{S.QUARANTINE_FILE}"))] if tmp.is_dir() else []
    quarantine = pd.concat([r.quarantine for r in results] + spilled, ignore_index=True)
    quarantine = quarantine.sort_values([S.SOURCE_TABLE, S.SOURCE_ROW], kind="stable")
    _write_quarantine(quarantine, out_dir / S.QUARANTINE_FILE)
    shutil.rmtree(tmp, ignore_errors=True)
    with atomic.atomic_path(out_dir / S.VOCAB_FILE) as path:
        pq.write_table(pa.Table.from_pandas(vocabulary, schema=S.VOCAB, preserve_index=False), path)
    named = descriptions.token_descriptions([r.descriptions for r in results], config, vocabulary)
    descriptions.write(named, out_dir / S.CODE_DESCRIPTIONS_FILE)
    manifest = build_manifest(results, vocabulary, token_stats, config, input_dir)
    manifest["shards"] = len(results)
    return manifest


def clear_outputs(out_dir: Path) -> None:
    """Remove token parts and spilled shards of an earlier run, so that none is taken for this run's."""
    shutil.rmtree(out_dir / S.TOKENS_DIR, ignore_errors=True)
    shutil.rmtree(out_dir / TMP_DIR, ignore_errors=True)


def _train_token_counts(result: ShardResult) -> Counter[str]:
    """Per token, the number of train-split visits holding it (after merging and truncation)."""
    s = result.structured
    train_visit = (result.splits == S.TRAIN)[s.visits["patient"].to_numpy()]
    tokens = pd.Categorical(s.codes["token"])
    in_train = train_visit[s.codes["visit"].to_numpy()]
    counts = np.bincount(tokens.codes[in_train], minlength=len(tokens.categories))
    return Counter({str(t): int(n) for t, n in zip(tokens.categories, counts) if n})


def _spill(result: ShardResult, folder: Path) -> None:
    """Move a shard's structured tables and quarantine to disk so only one shard is in memory at a time."""
    folder.mkdir(parents=True, exist_ok=True)
    s = result.structured
    for name in ("patients", "visits", "codes"):
        getattr(s, name).to_parquet(folder / f"{name}.parquet")
    result.structured = Structured(
        s.patients.iloc[:0],
        s.visits.iloc[:0],
        s.codes.iloc[:0],
        s.merged_in_visit,
        s.truncated_events,
        s.truncated_visits,
        s.truncated_patients,
        np.zeros(0, dtype=bool),
        s.thinned_visits,
    )
    _write_quarantine(result.quarantine, folder / S.QUARANTINE_FILE)
    result.quarantine = result.quarantine.iloc[:0]


def _unspill(folder: Path) -> Structured:
    frames = {name: pd.read_parquet(folder / f"{name}.parquet") for name in ("patients", "visits", "codes")}
    frames["codes"]["token"] = pd.Categorical(frames["codes"]["token"])
    frames["patients"][S.PATIENT_ID] = frames["patients"][S.PATIENT_ID].astype(object)
    return Structured(frames["patients"], frames["visits"], frames["codes"], 0, 0, 0, 0, np.zeros(0, dtype=bool))


def _write_quarantine(quarantine: pd.DataFrame, path: Path) -> None:
    with atomic.atomic_path(path) as tmp:
        pq.write_table(pa.Table.from_pandas(quarantine, schema=S.QUARANTINE, preserve_index=False), tmp)


def _token_stats(table: pa.Table) -> dict[str, Any]:
    """Sequence lengths and splits per patient; code and [UNK] tokens per split."""
    lengths = table.column(S.N_TOKENS).to_numpy()
    splits = np.asarray(table.column(S.SPLIT).to_numpy(zero_copy_only=False), dtype=object)
    ids = (
        table.column(S.TOKEN_IDS).combine_chunks().flatten().to_numpy()
        if table.num_rows
        else np.zeros(0, dtype=np.int32)
    )
    split_code, split_names = pd.factorize(splits)
    token_split = np.repeat(split_code, lengths)
    unk = np.bincount(token_split[ids == S.UNK_ID], minlength=len(split_names))
    codes = np.bincount(token_split[ids >= S.N_SPECIAL], minlength=len(split_names)) + unk
    sex = table.column(S.SEX).to_numpy(zero_copy_only=False) if table.num_rows else np.zeros(0, dtype=object)
    return {
        "lengths": lengths,
        "splits": splits,
        "sex": Counter(pd.Series(sex, dtype=object).value_counts().to_dict()),
        "unk_by_split": Counter({str(s): int(n) for s, n in zip(split_names, unk) if n}),
        "codes_by_split": Counter({str(s): int(n) for s, n in zip(split_names, codes) if n}),
    }


def build_manifest(
    results: list[ShardResult],
    vocabulary: pd.DataFrame,
    token_stats: list[dict[str, Any]],
    config: EtlConfig,
    input_dir: Path,
) -> dict[str, Any]:
    """Counts that reconcile with the input, per source table, plus tokens, splits and vocabulary."""
    tables: dict[str, Counter[str]] = {}
    for r in results:
        for table, c in r.counts.items():
            tables.setdefault(table, Counter()).update(c)
    table_report = {}
    for table, c in sorted(tables.items()):
        parts = {k: int(c.get(k, 0)) for k in ("used", "quarantined", "duplicates_dropped", "filtered")}
        table_report[table] = {"rows": int(c.get("rows", 0)), **parts, "reconciles": sum(parts.values()) == c["rows"]}
    lengths = np.concatenate([t["lengths"] for t in token_stats]) if token_stats else np.zeros(0)
    splits = np.concatenate([t["splits"] for t in token_stats]) if token_stats else np.zeros(0, dtype=object)
    unk: Counter[str] = sum((t["unk_by_split"] for t in token_stats), Counter())
    codes: Counter[str] = sum((t["codes_by_split"] for t in token_stats), Counter())
    notes: dict[str, Any] = {}
    for r in results:
        for key, value in r.notes.items():
            notes[key] = notes.get(key, 0) + value if isinstance(value, (int, float)) and key in notes else value
    id_types = {r.patient_id_type for r in results}
    return {
        "format": config.format,
        "input": str(input_dir),
        "tables": table_report,
        "reconciles": all(t["reconciles"] for t in table_report.values()),
        "quarantine_reasons": dict(sorted(sum((r.reasons for r in results), Counter()).items())),
        "events_used": _events_used(results, int(sum(codes.values()))),
        "truncation": {
            "max_seq_len": config.max_seq_len,
            "patients_truncated": sum(r.structured.truncated_patients for r in results),
            "visits_dropped": sum(r.structured.truncated_visits for r in results),
            "events_dropped": sum(r.structured.truncated_events for r in results),
            "visits_thinned_to_first_records": sum(r.structured.thinned_visits for r in results),
        },
        "patients": {
            "with_tokens": len(lengths),
            "by_split": {s: int((splits == s).sum()) for s in S.SPLITS},
            "by_sex": {s: int(n) for s, n in sorted(sum((t["sex"] for t in token_stats), Counter()).items())},
            "sex_values_read_as_other": dict(
                sum((r.sex_unrecognised for r in results), Counter()).most_common(SEX_EXAMPLES)
            ),
        },
        "sequence_length": _describe(lengths),
        "vocabulary": {
            "size": len(vocabulary),
            "codes": len(vocabulary) - S.N_SPECIAL,
            "min_code_count": config.min_code_count,
            "train_codes_mapped_to_unk": int(vocabulary["train_count"].iloc[S.UNK_ID]),
            "unk_share_by_split": {s: round(unk.get(s, 0) / codes[s], 6) if codes.get(s) else 0.0 for s in S.SPLITS},
        },
        "reader": notes,
        "filtered_code_prefixes": dict(sum((r.filtered_prefixes for r in results), Counter()).most_common(10)),
        "patient_id_type": "int64" if id_types == {"int64"} else "string",
        "shards": config.shards,
        "settings": config_lib.to_dict(config),
    }


def _events_used(results: list[ShardResult], code_tokens: int) -> dict[str, Any]:
    """Where the usable events went: a code token, merged into the same code of its visit, or truncated."""
    merged = sum(r.structured.merged_in_visit for r in results)
    dropped = sum(r.structured.truncated_events for r in results)
    used = sum(r.used_events for r in results)
    return {
        "events": used,
        "code_tokens": code_tokens,
        "merged_within_visit": merged,
        "dropped_by_max_seq_len": dropped,
        "reconciles": used == code_tokens + merged + dropped,
    }


def _describe(lengths: np.ndarray) -> dict[str, float]:
    if len(lengths) == 0:
        return {"mean": 0.0, "median": 0.0, "p95": 0.0, "max": 0.0, "tokens": 0}
    return {
        "mean": round(float(lengths.mean()), 2),
        "median": float(np.median(lengths)),
        "p95": float(np.percentile(lengths, 95)),
        "max": int(lengths.max()),
        "tokens": int(lengths.sum()),
    }
