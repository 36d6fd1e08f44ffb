"""``behrt-rope predict``: raw histories in any supported format -> per-patient risk of every label code.

The input is scored patient shard by patient shard (a hash of the patient id picks the shard), so memory
holds one shard, not the population; predictions are appended to the Parquet file as row groups. With
``engine=ray`` the shards are scored by a pool of Ray actors and ``OUT`` is a directory of Parquet parts.

Next to ``OUT`` it writes ``OUT.summary.json`` (patients scored and not scored, unknown codes, rejected
rows), ``OUT.unscored.parquet`` (each patient without a usable history and why), ``OUT.quarantine.parquet``
and ``OUT.config.yaml``.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm.auto import tqdm

from behrt_rope import config as config_lib
from behrt_rope import schema as S
from behrt_rope.engine.config import RayConfig
from behrt_rope.errors import UserError
from behrt_rope.etl.config import EtlConfig
from behrt_rope.scoring.precision import Precision
from behrt_rope.scoring.shard import Prepared, n_shards, predictions_table, prepare_shard
from behrt_rope.stage import write_json
from behrt_rope.training.bundle import load_bundle

log = logging.getLogger("behrt_rope.predict")
ROW_GROUP_ROWS = 1 << 20  # rows per Parquet row group of the predictions file


@dataclass
class Config:
    model: str = ""
    """A `behrt-rope finetune` output directory."""
    input: str = ""
    """Directory with the raw tables to score."""
    out: str = ""
    """Predictions Parquet file (with engine=ray: a directory of Parquet parts)."""
    format: Literal["", "visits", "meds", "omop"] = ""
    """Input layout; empty: the layout the model was trained from."""
    layout: Literal["long", "meds"] = "long"
    """long: one row per patient and code (SPEC); meds: MEDS predictions, one probability column per code."""
    batch_size: int = 1024
    """Most patients per forward pass."""
    batch_tokens: int = 4096
    """Most padded tokens per forward pass; patients of similar length are batched together. Small batches keep
    the activations in the CPU's caches (4096 scored 1.6x faster per core than 32768, docs/benchmarks.md)."""
    precision: Precision = "auto"
    """auto: bf16 where the CPU or GPU computes it natively, else fp32."""
    shards: int = 0
    """Patient shards scored one after another (memory holds one); 0: one per shard_rows input rows."""
    shard_rows: int = 1_000_000
    """Input rows (all tables) per shard when shards=0; CSV rows are estimated from the file size."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to run the model; auto picks a GPU when there is one."""
    progress: bool = True
    """Show a progress bar."""
    engine: Literal["local", "ray"] = "local"
    """local: this process; ray: a pool of Ray actors (needs `pip install behrt-rope[ray]`)."""
    ray: RayConfig = field(default_factory=RayConfig)

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.batch_tokens < 1 or self.shard_rows < 1 or self.shards < 0:
            raise ValueError("batch_size, batch_tokens and shard_rows must be >= 1, shards >= 0")


@dataclass
class Tally:
    """What the shards add up to, for the summary and the sidecar files."""

    patients_scored: int = 0
    unscored: list[pd.DataFrame] = field(default_factory=list)
    quarantine: list[pd.DataFrame] = field(default_factory=list)
    unknown_codes: Counter[str] = field(default_factory=Counter)

    def add(self, scored: int, unscored: pd.DataFrame, quarantine: pd.DataFrame, unknown: Counter[str]) -> None:
        self.patients_scored += scored
        self.unscored.append(unscored)
        self.quarantine.append(quarantine)
        self.unknown_codes.update(unknown)


@dataclass
class Job:
    """Everything a shard needs besides its number; plain values, so that Ray can ship it to its actors."""

    model_dir: str
    input_dir: str
    etl: EtlConfig
    vocab: pd.DataFrame  # token_id, token
    labels: list[str]
    layout: str
    patient_id_type: str  # int64 or string as the input has it; '' until the first shard is read
    shards: int
    out_dir: str = ""  # engine=ray: the folder the actors write their parts into


def run(config: Config) -> Path:
    """Score every patient of ``config.input``; returns the predictions file (or directory)."""
    if not (config.model and config.input and config.out):
        raise UserError("predict needs --model FINETUNE_DIR, --input DIR and --out FILE.parquet")
    input_dir, out = Path(config.input), Path(config.out)
    if not input_dir.is_dir():
        raise UserError(f"input directory not found: {input_dir}")
    started = time.perf_counter()
    bundle = load_bundle(config.model, "multilabel")
    etl = _etl_config(bundle, config.format)
    job = Job(
        model_dir=config.model,
        input_dir=str(input_dir),
        etl=etl,
        vocab=pd.DataFrame({"token_id": np.arange(len(bundle["vocab"]), dtype=np.int32), "token": bundle["vocab"]}),
        labels=list(bundle["labels"]),
        layout=config.layout,
        patient_id_type="",
        shards=n_shards(input_dir, config.shards, config.shard_rows),
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    log.info("predict: %s engine, %d shard(s)", config.engine, job.shards)
    if config.engine == "ray":
        from behrt_rope.engine.ray_predict import predict_on_ray

        tally = predict_on_ray(job, config, out)
    else:
        tally = _predict_local(job, config, bundle, out)
    _write_sidecars(out, config, tally, etl, len(job.labels), job.shards, time.perf_counter() - started)
    return out


def _etl_config(bundle: dict[str, Any], fmt: str) -> EtlConfig:
    """The model's own ETL settings (code mapping, truncation, max length), with the input format."""
    saved = dict(bundle.get("etl_settings", {}).get("etl", {}))
    saved.pop("shards", None)  # predict picks its own
    if fmt:
        saved["format"] = fmt
    return config_lib.build(EtlConfig, saved)


def score_prepared(job: Job, prepared: Prepared, scorer: Any) -> pa.Table:
    """One prepared shard scored and laid out as predictions."""
    probs = scorer.score(prepared.seqs)  # (N, L)
    job.patient_id_type = job.patient_id_type or prepared.patient_id_type  # one schema for every shard
    return predictions_table(prepared.seqs.patients, job.labels, probs, job.layout, job.patient_id_type)


def _predict_local(job: Job, config: Config, bundle: dict[str, Any], out: Path) -> Tally:
    """Shards in order; the next shard is read and tokenised in a thread while this one is scored."""
    from behrt_rope.scoring.scorer import Scorer
    from behrt_rope.training.inference import multilabel_model, resolve_device

    device = resolve_device(config.device)
    scorer = Scorer(multilabel_model(bundle), device, config.precision, config.batch_tokens, config.batch_size)
    log.info("predict: scoring on %s in %s", device, str(scorer.dtype).removeprefix("torch."))
    tally = Tally()
    partial = out.with_name(out.name + ".partial")
    writer: pq.ParquetWriter | None = None
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            pending: Future[Prepared] = pool.submit(_prepare, job, 0)
            for shard in tqdm(
                range(job.shards), desc="predict: shards", disable=not config.progress or job.shards == 1
            ):
                prepared = pending.result()
                if shard + 1 < job.shards:
                    pending = pool.submit(_prepare, job, shard + 1)
                table = score_prepared(job, prepared, scorer)
                if writer is None:
                    writer = pq.ParquetWriter(partial, table.schema)
                writer.write_table(table, row_group_size=ROW_GROUP_ROWS)
                tally.add(len(prepared.seqs), prepared.unscored, prepared.quarantine, prepared.unknown_codes)
                del prepared, table
    finally:
        if writer is not None:
            writer.close()
    if out.is_dir():
        shutil.rmtree(out)
    partial.replace(out)
    return tally


def _prepare(job: Job, shard: int) -> Prepared:
    return prepare_shard(Path(job.input_dir), job.etl, job.vocab, shard, job.shards)


def _write_sidecars(
    out: Path, config: Config, tally: Tally, etl: EtlConfig, n_labels: int, shards: int, seconds: float
) -> None:
    stem = out.with_suffix("")
    unscored = pd.concat(tally.unscored, ignore_index=True) if tally.unscored else pd.DataFrame()
    if unscored.empty:
        unscored = pd.DataFrame({S.PATIENT_ID: pd.Series(dtype=object), S.REASON: pd.Series(dtype=object)})
    unscored = unscored.sort_values(S.PATIENT_ID, kind="stable", ignore_index=True)
    quarantine = pd.concat(tally.quarantine, ignore_index=True) if tally.quarantine else pd.DataFrame()
    quarantine = (
        quarantine.sort_values([S.SOURCE_TABLE, S.SOURCE_ROW], kind="stable") if len(quarantine) else quarantine
    )
    pq.write_table(pa.Table.from_pandas(unscored, preserve_index=False), f"{stem}.unscored.parquet")
    pq.write_table(
        pa.Table.from_pandas(quarantine, schema=S.QUARANTINE, preserve_index=False)
        if len(quarantine)
        else S.QUARANTINE.empty_table(),
        f"{stem}.quarantine.parquet",
    )
    config_lib.save(config, f"{stem}.config.yaml")
    unknown_events = sum(tally.unknown_codes.values())
    summary = {
        "predictions": str(out),
        "patients_scored": tally.patients_scored,
        "patients_not_scored": len(unscored),
        "not_scored_reasons": dict(Counter(unscored[S.REASON])),
        "label_codes": n_labels,
        "unknown_code_events": unknown_events,
        "unknown_distinct_codes": len(tally.unknown_codes),
        "unknown_codes_top": dict(tally.unknown_codes.most_common(20)),
        "rows_quarantined": dict(Counter(quarantine[S.REASON])) if len(quarantine) else {},
        "input_format": etl.format,
        "engine": config.engine,
        "shards": shards,
        "seconds": round(seconds, 3),
    }
    write_json(Path(f"{stem}.summary.json"), summary)
    log.info(
        "predict: %d patients scored, %d not scored (%s), %d events with codes unseen in training (%d codes)",
        summary["patients_scored"],
        summary["patients_not_scored"],
        summary["not_scored_reasons"] or "none",
        unknown_events,
        len(tally.unknown_codes),
    )
