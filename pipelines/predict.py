"""``behrt-rope predict``: raw histories in any supported format -> per-patient risk of every label code.

Next to ``OUT.parquet`` it writes ``OUT.summary.json`` (patients scored and not scored, unknown codes,
rejected rows), ``OUT.unscored.parquet`` (each patient without a usable history and why),
``OUT.quarantine.parquet`` and ``OUT.config.yaml``. ``OUT.parquet`` is written last, through a temporary
name, so it exists only once every file beside it is complete; a second run writing the same ``OUT``
stops at once (lock file ``.OUT.parquet.lock``).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from behrt_rope import config as config_lib
from behrt_rope import schema as S
from behrt_rope import atomic
from behrt_rope.data.sequences import Sequences, from_table
from behrt_rope.errors import UserError
from behrt_rope.etl.config import EtlConfig
from behrt_rope.etl.readers import reader_for
from behrt_rope.etl.runner import process_shard
from behrt_rope.etl.tokenize import to_token_table
from behrt_rope.evaluation import meds_predictions
from behrt_rope.stage import file_output, write_json
from behrt_rope.training.bundle import load_bundle
from behrt_rope.training.inference import multilabel_model, resolve_device, score

log = logging.getLogger("behrt_rope.predict")
UNKNOWN_WARNING_SHARE = 0.5  # above this share of code events unseen in training, predict warns


@dataclass
class Config:
    model: str = ""
    """A `behrt-rope finetune` output directory."""
    input: str = ""
    """Directory with the raw tables to score."""
    out: str = ""
    """Predictions Parquet file."""
    format: Literal["", "visits", "meds", "omop"] = ""
    """Input layout; empty: the layout the model was trained from."""
    layout: Literal["long", "meds"] = "long"
    """long: one row per patient and code (SPEC); meds: OUT is a folder of MEDS prediction files, one per
    label code (meds-evaluation's PredictionSchema), with index.json mapping codes to files."""
    etl: Any = None
    """Reader settings, the same keys as `behrt-rope etl` (etl.meds.*, etl.omop.*, ...), applied over the
    model's saved ETL settings: e.g. etl.omop.vocabulary=SNOMED to score OMOP without a concept table."""
    batch_size: int = 256
    """Patients per forward pass."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to run the model; auto picks a GPU when there is one."""
    progress: bool = True
    """Show a progress bar."""


@dataclass
class Prepared:
    """Token streams of the scorable patients and an account of everything else."""

    seqs: Sequences
    unscored: pd.DataFrame  # PATIENT_ID, REASON
    unknown_codes: Counter[str]
    code_events: int  # code tokens of the scored histories, known or not
    quarantine: pd.DataFrame
    patient_id_type: str


def run(config: Config) -> Path:
    """Score every patient of ``config.input``; returns the predictions file."""
    if not (config.model and config.input and config.out):
        raise UserError("predict needs --model FINETUNE_DIR, --input DIR and --out FILE.parquet")
    input_dir, out = Path(config.input), Path(config.out)
    if not input_dir.is_dir():
        raise UserError(f"input directory not found: {input_dir}")
    with file_output(out, sidecars(out)):  # first: a second run writing the same OUT stops at once
        return _predict(config, input_dir, out)


def _predict(config: Config, input_dir: Path, out: Path) -> Path:
    """Load the model, prepare and score the input, write the sidecars and then ``out`` (last)."""
    bundle = load_bundle(config.model, "multilabel")
    etl = _etl_config(bundle, config.format, config.etl)
    vocab = pd.DataFrame({"token_id": np.arange(len(bundle["vocab"]), dtype=np.int32), "token": bundle["vocab"]})
    prepared = prepare(input_dir, etl, vocab)
    model = multilabel_model(bundle)
    device = resolve_device(config.device)
    log.info("predict: scoring %d patients on %s", len(prepared.seqs), device)
    probs = score(model, prepared.seqs, batch_size=config.batch_size, device=device, progress=config.progress)
    table = _predictions(prepared, bundle["labels"], probs)
    _write_sidecars(out, config, prepared, etl, bundle["labels"])
    # last: the predictions exist only when everything else is written
    if config.layout == "meds":  # a folder: one meds-evaluation file per label code, and an index
        with atomic.atomic_dir(out) as tmp:
            meds_predictions.write(table, tmp)
    else:
        with atomic.atomic_path(out) as tmp:
            pq.write_table(table, tmp)
    return out


def sidecars(out: Path) -> list[Path]:
    """The files written beside the predictions ``out``."""
    stem = out.with_suffix("")
    return [
        Path(f"{stem}.{name}") for name in ("unscored.parquet", "quarantine.parquet", "config.yaml", "summary.json")
    ]


def _etl_config(bundle: dict[str, Any], fmt: str, overrides: Any) -> EtlConfig:
    """The model's own ETL settings (code mapping, truncation, max length), with the reader settings given
    to predict (``etl.*``, and the input format) merged over them; unknown keys stop with a suggestion."""
    saved = dict(bundle.get("etl_settings", {}).get("etl", {}))
    given = overrides if overrides is not None else {}
    if not isinstance(given, dict):
        raise UserError(f"predict: etl must be a mapping of reader settings (etl.meds.visit_rule=...), got {given!r}")
    if fmt:
        given = {**given, "format": fmt}
    return config_lib.build(EtlConfig, config_lib.merge(saved, given), prefix="etl.")


def prepare(input_dir: Path, etl: EtlConfig, vocab: pd.DataFrame) -> Prepared:
    """Read, clean and tokenise the input with the model's settings and vocabulary."""
    read = reader_for(etl.format)
    tables, unscored, quarantines = [], [], []
    unknown: Counter[str] = Counter()
    code_events = 0
    id_types = set()
    known = set(vocab["token"])
    for shard in range(etl.shards):
        raw = read(input_dir, etl, shard, etl.shards)
        id_types.add(raw.patient_id_type)
        result = process_shard(raw, etl)
        structured = result.structured
        tokens = structured.codes["token"].to_numpy(dtype=object)
        unknown.update(t for t in tokens[~np.isin(tokens, list(known))])
        code_events += len(tokens)
        tables.append(to_token_table(structured, vocab, np.full(len(structured.patients), "", dtype=object)))
        quarantines.append(result.quarantine)
        unscored.append(_unscored(raw.patients, raw.events, structured.patients, result.quarantine))
    table = pa.concat_tables(tables)
    return Prepared(
        seqs=from_table(table),
        unscored=pd.concat(unscored, ignore_index=True),
        unknown_codes=unknown,
        code_events=code_events,
        quarantine=pd.concat(quarantines, ignore_index=True),
        patient_id_type="int64" if id_types == {"int64"} else "string",
    )


def _unscored(
    patients: pd.DataFrame, events: pd.DataFrame, scored: pd.DataFrame, quarantine: pd.DataFrame
) -> pd.DataFrame:
    """Every patient id seen in the input but not scored, with the reason."""
    seen = pd.unique(np.concatenate([patients[S.PATIENT_ID].to_numpy(object), events[S.PATIENT_ID].to_numpy(object)]))
    missing = np.setdiff1d(np.asarray([s for s in seen if s != ""], dtype=str), scored[S.PATIENT_ID].to_numpy(str))
    reasons = (
        quarantine[quarantine[S.PATIENT_ID].isin(missing)]
        .groupby(S.PATIENT_ID)[S.REASON]
        .agg(lambda r: ",".join(sorted(set(r))))
    )
    frame = pd.DataFrame({S.PATIENT_ID: missing})
    frame[S.REASON] = reasons.reindex(missing).fillna("no_events").to_numpy()
    return frame


def _predictions(prepared: Prepared, labels: list[str], probs: np.ndarray) -> pa.Table:
    """The predictions table in the long layout (SPEC)."""
    patients = prepared.seqs.patients
    ids = patients[S.PATIENT_ID].to_numpy(dtype=object)
    id_array = pa.array(ids.astype(np.int64) if prepared.patient_id_type == "int64" else ids.astype(str))
    times = pa.array(patients[S.LAST_EVENT_TIME].to_numpy("datetime64[us]"), pa.timestamp("us"))
    n, n_labels = probs.shape
    repeat = np.repeat(np.arange(n), n_labels)
    return pa.table(
        {
            S.PATIENT_ID: id_array.take(pa.array(repeat)),
            S.PREDICTION_TIME: times.take(pa.array(repeat)),
            S.CODE: pa.array(np.tile(np.asarray(labels, dtype=object), n), pa.string()),
            S.PROBABILITY: pa.array(probs.reshape(-1).astype(np.float64)),
        }
    )


def _write_sidecars(out: Path, config: Config, prepared: Prepared, etl: EtlConfig, labels: list[str]) -> None:
    n_labels = len(labels)
    stem = out.with_suffix("")
    with atomic.atomic_path(f"{stem}.unscored.parquet") as tmp:
        pq.write_table(pa.Table.from_pandas(prepared.unscored, preserve_index=False), tmp)
    with atomic.atomic_path(f"{stem}.quarantine.parquet") as tmp:
        pq.write_table(pa.Table.from_pandas(prepared.quarantine, schema=S.QUARANTINE, preserve_index=False), tmp)
    config_lib.save(config, f"{stem}.config.yaml")
    unknown_events = sum(prepared.unknown_codes.values())
    summary = {
        "predictions": str(out),
        "patients_scored": len(prepared.seqs),
        "patients_not_scored": len(prepared.unscored),
        "not_scored_reasons": dict(Counter(prepared.unscored[S.REASON])),
        "label_codes": n_labels,
        "unknown_code_events": unknown_events,
        "unknown_distinct_codes": len(prepared.unknown_codes),
        "unknown_codes_top": dict(prepared.unknown_codes.most_common(20)),
        "code_events": prepared.code_events,
        "rows_quarantined": dict(Counter(prepared.quarantine[S.REASON])),
        "input_format": etl.format,
    }
    write_json(Path(f"{stem}.summary.json"), summary)
    if prepared.code_events and unknown_events > UNKNOWN_WARNING_SHARE * prepared.code_events:
        log.warning(
            "predict: %.0f%% of code events have codes the model never saw (most frequent: %s; the model's "
            "codes look like %s); are the reader settings (etl.*) naming codes the way training did?",
            100 * unknown_events / prepared.code_events,
            ", ".join(t for t, _ in prepared.unknown_codes.most_common(3)),
            ", ".join(labels[:3]),
        )
    log.info(
        "predict: %d patients scored, %d not scored (%s), %d events with codes unseen in training (%d codes)",
        summary["patients_scored"],
        summary["patients_not_scored"],
        summary["not_scored_reasons"] or "none",
        unknown_events,
        len(prepared.unknown_codes),
    )
