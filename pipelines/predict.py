"""``behrt-rope predict``: raw histories in any supported format -> per-patient risk of every label code.

The input is scored patient shard by patient shard (a hash of the patient id picks the shard), so memory
holds one shard, not the population; predictions are appended to the Parquet file as row groups. With
``engine=ray`` the shards are scored by a pool of Ray actors and ``OUT`` is a directory of Parquet parts.
``layout=meds`` writes a folder of meds-evaluation files, one per label code; it collects every shard's
predictions first (about 30 bytes per patient and label code), so only the long layout is memory-bounded.

Next to ``OUT`` it writes ``OUT.summary.json`` (patients scored and not scored, unknown codes, rejected
rows), ``OUT.unscored.parquet`` (each patient without a usable history and why), ``OUT.quarantine.parquet``
and ``OUT.config.yaml``. ``OUT`` is written under a temporary name and renamed into place last, so it exists
only once every file beside it is complete; a second run writing the same ``OUT`` stops at once (lock file
``.OUT.lock``).
"""

from __future__ import annotations

import datetime
import logging
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm.auto import tqdm

from behrt_rope import atomic
from behrt_rope import config as config_lib
from behrt_rope import schema as S
from behrt_rope.engine.config import RayConfig
from behrt_rope.errors import UserError
from behrt_rope.etl.config import EtlConfig
from behrt_rope.etl.readers import ShardSource
from behrt_rope.evaluation import meds_predictions
from behrt_rope.scoring.code_match import SETTING as MATCH_SETTING
from behrt_rope.scoring.code_match import Matcher, Remedy, would_match
from behrt_rope.scoring.precision import Precision
from behrt_rope.scoring.shard import (
    Prepared,
    n_shards,
    predictions_schema,
    predictions_table,
    prepare_shard,
)
from behrt_rope.stage import file_output, write_json
from behrt_rope.training.bundle import load_bundle

if TYPE_CHECKING:
    from behrt_rope.model.heads import BehrtForMultiLabel

log = logging.getLogger("behrt_rope.predict")
ROW_GROUP_ROWS = 1 << 20  # rows per Parquet row group of the predictions file
UNKNOWN_WARNING_SHARE = 0.5  # above this share of code events unseen in training, predict warns
OTHER_FORMATS = (".csv", ".tsv", ".txt", ".json", ".jsonl", ".xlsx", ".xls", ".feather", ".arrow", ".gz", ".zip")
"""Suffixes of ``--out`` that promise another format than the Parquet predict writes."""


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
    """long: one row per patient and code (SPEC), streamed; meds: OUT is a folder of MEDS prediction files, one
    per label code (meds-evaluation's PredictionSchema), with index.json mapping codes to files (held in memory
    whole before writing)."""
    match_codes: list[Remedy] = field(default_factory=list)
    """Respell codes the model never saw onto its vocabulary: vocabulary_prefix strips or adds a VOCABULARY/ prefix
    (ICD10CM/E119 <-> E119), case matches regardless of case (e119 -> E119); a spelling that two of the model's
    codes share matches neither. Empty: codes are read as given, and the summary counts what each would match."""
    as_of: str = ""
    """Last calendar day of history used (ISO date, e.g. 2024-06-30): events dated after it are set aside (reason
    event_after_as_of), so each patient is scored as of their last event up to it. Empty: the day predict runs,
    so that a wrongly future-dated event never becomes the prediction time; a patient whose events all lie after
    that day (a record date-shifted into the future, as MIMIC's are) keeps them."""
    etl: Any = None
    """Reader settings, the same keys as `behrt-rope etl` (etl.meds.*, etl.omop.*, ...), applied over the
    model's saved ETL settings: e.g. etl.omop.vocabulary=SNOMED to score OMOP without a concept table."""
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
        if self.as_of:
            as_of_day(self.as_of)


def as_of_day(text: str) -> str:
    """``text`` as an ISO calendar day; anything else stops with an example.

    >>> as_of_day(" 2024-06-30 ")
    '2024-06-30'
    """
    try:
        return datetime.date.fromisoformat(text.strip()).isoformat()
    except ValueError:
        raise ValueError(f"as_of must be an ISO date such as 2024-06-30, got {text!r}") from None


@dataclass
class Tally:
    """What the shards add up to, for the summary and the sidecar files."""

    patients_scored: int = 0
    unscored: list[pd.DataFrame] = field(default_factory=list)
    quarantine: list[pd.DataFrame] = field(default_factory=list)
    unknown_codes: Counter[str] = field(default_factory=Counter)  # after match_codes
    code_events: int = 0  # code tokens of the scored histories, known or not
    matched_codes: Counter[str] = field(default_factory=Counter)  # respelled by match_codes, by input token
    rows: dict[str, Counter[str]] = field(default_factory=dict)  # per input file, as the ETL manifest counts
    truncation: Counter[str] = field(default_factory=Counter)  # patients_truncated, events_dropped

    def add(
        self,
        scored: int,
        unscored: pd.DataFrame,
        quarantine: pd.DataFrame,
        unknown: Counter[str],
        code_events: int,
        rows: dict[str, Counter[str]],
        truncation: Counter[str],
        matched: Counter[str],
    ) -> None:
        self.patients_scored += scored
        self.unscored.append(unscored)
        self.quarantine.append(quarantine)
        self.unknown_codes.update(unknown)
        self.code_events += code_events
        self.matched_codes.update(matched)
        for table, counts in rows.items():
            self.rows.setdefault(table, Counter()).update(counts)
        self.truncation.update(truncation)

    def input_rows(self) -> dict[str, dict[str, Any]]:
        """Per input file: rows read = used + quarantined + duplicates dropped + filtered (the ETL's count)."""
        report = {}
        for table, c in sorted(self.rows.items()):
            parts = {k: int(c.get(k, 0)) for k in ("used", "quarantined", "duplicates_dropped", "filtered")}
            report[table] = {"rows": int(c["rows"]), **parts, "reconciles": sum(parts.values()) == c["rows"]}
        return report


@dataclass
class Job:
    """Everything a shard needs besides its number; plain values, so that Ray can ship it to its actors."""

    model_dir: str
    input_dir: str
    etl: EtlConfig
    vocab: pd.DataFrame  # token_id, token
    labels: list[str]
    patient_id_type: str  # int64 or string as the input has it; '' until the first shard is read
    shards: int
    trained_format: str = ""  # the input format of the model's own ETL; '' when its bundle does not say
    match_codes: tuple[Remedy, ...] = ()
    as_of: str = ""  # ISO day: events dated after it are set aside; '' for none
    as_of_given: bool = False  # False: as_of is the run date, and records wholly after it are kept
    out_dir: str = ""  # engine=ray: the folder the actors write their parts into

    def reading(self) -> tuple[tuple[Remedy, ...], str, bool]:
        """The arguments of :func:`prepare_shard` after the shard: match_codes, as_of, keep_future_records."""
        return self.match_codes, self.as_of, not self.as_of_given


def run(config: Config) -> Path:
    """Score every patient of ``config.input``; returns the predictions file (or directory)."""
    if not (config.model and config.input and config.out):
        raise UserError("predict needs --model FINETUNE_DIR, --input DIR and --out FILE.parquet")
    input_dir, out = Path(config.input), Path(config.out)
    if not input_dir.is_dir():
        raise UserError(f"input directory not found: {input_dir}")
    loaded: list[tuple[dict[str, Any], BehrtForMultiLabel]] = []

    def check() -> None:  # under OUT's lock, so a second run stops at once; before OUT is removed
        check_out(out, config)
        loaded.append(_load_model(config.model))  # a model that cannot score costs no earlier output

    with file_output(out, sidecars(out), check):
        return _predict(config, input_dir, out, *loaded[0])


def _load_model(model_dir: str) -> tuple[dict[str, Any], BehrtForMultiLabel]:
    """The fine-tuned model's bundle and the model built from it (weights that do not fit stop here, before
    ``predict`` replaces its earlier output, which a run that cannot score must not cost)."""
    from behrt_rope.training.inference import multilabel_model

    bundle = load_bundle(model_dir, "multilabel")
    return bundle, multilabel_model(bundle, model_dir)


def check_out(out: Path, config: Config) -> None:
    """Refuse an ``out`` that predict would wrongly remove or misname (it removes ``out`` whole first).

    An existing ``out`` is replaced when it is a previous predictions output (:func:`_is_previous`) or a
    plain file outside ``--input`` and ``--model``; never ``--input``, ``--model`` or a folder holding them.
    A name with another format's suffix (``.csv``) is refused for the long layout.
    """
    if config.layout == "long" and out.suffix.lower() in OTHER_FORMATS:
        raise UserError(f"--out {out}: predictions are written as Parquet; name the file *.parquet, not {out.suffix}")
    target = out.resolve()
    for flag, folder in (("--input", Path(config.input).resolve()), ("--model", Path(config.model).resolve())):
        holds = target == folder or target in folder.parents
        if holds or (folder in target.parents and out.exists() and not _is_previous(out)):
            raise UserError(f"--out {out}: predict would replace {flag} {folder} or part of it; write elsewhere")
    if out.is_dir() and not _is_previous(out):
        raise UserError(
            f"--out {out}: an existing directory that is not a previous predictions output, which predict would "
            f"replace whole; name a new file, such as {out / 'predictions.parquet'}"
        )


def _is_previous(out: Path) -> bool:
    """Whether ``out`` is what an earlier run wrote: ``OUT.summary.json`` beside it and, for a folder
    (``engine=ray``, ``layout=meds``), nothing in it but Parquet files and the MEDS layout's index."""
    if not sidecars(out)[-1].exists():
        return False
    return not out.is_dir() or all(
        f.is_file() and (f.suffix == ".parquet" or f.name == S.MEDS_PREDICTIONS_INDEX) for f in out.iterdir()
    )


def _predict(config: Config, input_dir: Path, out: Path, bundle: dict[str, Any], model: BehrtForMultiLabel) -> Path:
    """Score every shard with ``model`` (built from ``bundle``; the Ray engine's actors build their own), write
    the sidecars and then ``out`` (renamed into place last)."""
    started = time.perf_counter()
    etl = _etl_config(bundle, config.format, config.etl)
    job = Job(
        model_dir=config.model,
        input_dir=str(input_dir),
        etl=etl,
        vocab=pd.DataFrame({"token_id": np.arange(len(bundle["vocab"]), dtype=np.int32), "token": bundle["vocab"]}),
        labels=list(bundle["labels"]),
        patient_id_type="",
        shards=n_shards(input_dir, config.shards, config.shard_rows),
        trained_format=str(bundle.get("etl_settings", {}).get("etl", {}).get("format", "")),
        match_codes=tuple(dict.fromkeys(config.match_codes)),
        as_of=as_of_day(config.as_of) if config.as_of else datetime.date.today().isoformat(),
        as_of_given=bool(config.as_of),
    )
    log.info("predict: %s engine, %d shard(s), layout %s", config.engine, job.shards, config.layout)
    note = format_note(job)
    if note:
        log.warning("predict: %s; another format may name codes differently (see the summary)", note)
    try:
        return _score_all(config, job, out, model, started)
    except UserError as err:
        if not note:
            raise
        raise UserError(f"{err} [{note}]") from err


def format_note(job: Job) -> str:
    """Both formats, when the input is read in another format than the one the model's ETL read ('' when
    they agree or the model does not say).

    >>> format_note(Job("m", "i", EtlConfig(format="meds"), pd.DataFrame(), [], "", 1, trained_format="visits"))
    'the input was read as --format meds, the model was trained on --format visits input'
    """
    if not job.trained_format or job.trained_format == job.etl.format:
        return ""
    given, trained = job.etl.format, job.trained_format
    return f"the input was read as --format {given}, the model was trained on --format {trained} input"


def _score_all(config: Config, job: Job, out: Path, model: BehrtForMultiLabel, started: float) -> Path:
    """Score every shard on the configured engine into the configured layout, then write the sidecars and
    ``out`` (renamed into place last)."""

    def finish(tally: Tally) -> None:
        _write_sidecars(out, config, tally, job, time.perf_counter() - started)
        _require_scored(tally, out)

    if config.layout == "meds":  # a folder: one meds-evaluation file per label code, and an index
        with atomic.atomic_dir(out) as tmp:
            table, tally = _collect(job, config, model, out)
            meds_predictions.write(table, tmp)
            finish(tally)
    elif config.engine == "ray":  # a folder of parts, one per shard
        from behrt_rope.engine.ray_predict import predict_on_ray

        with atomic.atomic_dir(out) as tmp:
            finish(predict_on_ray(job, config, tmp))
    else:  # one Parquet file, a row group per shard
        with atomic.atomic_path(out) as tmp:
            writer = _ParquetSink(tmp)
            try:
                tally = _predict_local(job, config, model, writer.write)
            finally:
                writer.close()
            finish(tally)
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
    saved.pop("shards", None)  # predict picks its own
    given = overrides if overrides is not None else {}
    if not isinstance(given, dict):
        raise UserError(f"predict: etl must be a mapping of reader settings (etl.meds.visit_rule=...), got {given!r}")
    if fmt:
        given = {**given, "format": fmt}
    return config_lib.build(EtlConfig, config_lib.merge(saved, given), prefix="etl.")


def score_prepared(job: Job, prepared: Prepared, scorer: Any) -> pa.Table:
    """One prepared shard scored and laid out as predictions (long layout)."""
    probs = scorer.score(prepared.seqs)  # (N, L)
    job.patient_id_type = job.patient_id_type or prepared.patient_id_type  # one schema for every shard
    return predictions_table(prepared.seqs.patients, job.labels, probs, job.patient_id_type)


def _lay_out_and_sink(
    sink: Callable[[pa.Table], None], patients: pd.DataFrame, labels: list[str], probs: np.ndarray, id_type: str
) -> None:
    """One shard's probabilities ``(N, L)`` laid out as predictions (:func:`predictions_table`) and sunk."""
    sink(predictions_table(patients, labels, probs, id_type))


class _ParquetSink:
    """Appends tables to one Parquet file as row groups; the file is opened with the first table's schema."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.writer: pq.ParquetWriter | None = None

    def write(self, table: pa.Table) -> None:
        if self.writer is None:
            self.writer = pq.ParquetWriter(self.path, table.schema)
        self.writer.write_table(table, row_group_size=ROW_GROUP_ROWS)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _predict_local(job: Job, config: Config, model: BehrtForMultiLabel, sink: Callable[[pa.Table], None]) -> Tally:
    """Shards in order, each shard's predictions handed to ``sink``, from one thread and in shard order.

    While a shard is scored, the next one is read and tokenised in one thread, and the previous one's
    predictions are laid out and handed to ``sink`` in another, so scoring waits for neither. At most one
    shard's predictions wait to be written: memory holds about two shards' predictions, not the input's.
    """
    from behrt_rope.scoring.scorer import Scorer
    from behrt_rope.training.inference import resolve_device

    device = resolve_device(config.device)
    scorer = Scorer(model, device, config.precision, config.batch_tokens, config.batch_size)
    log.info("predict: scoring on %s in %s", device, str(scorer.dtype).removeprefix("torch."))
    tally = Tally()
    src = ShardSource.open(Path(job.input_dir), job.etl)
    with ThreadPoolExecutor(max_workers=1) as pool, ThreadPoolExecutor(max_workers=1) as writer:
        pending: Future[Prepared] = pool.submit(prepare_shard, src, job.vocab, 0, job.shards, *job.reading())
        written: Future[None] | None = None
        for shard in tqdm(range(job.shards), desc="predict: shards", disable=not config.progress or job.shards == 1):
            prepared = pending.result()
            if shard + 1 < job.shards:
                pending = pool.submit(prepare_shard, src, job.vocab, shard + 1, job.shards, *job.reading())
            probs = scorer.score(prepared.seqs)  # (N, L)
            job.patient_id_type = job.patient_id_type or prepared.patient_id_type  # one schema for every shard
            if written is not None:
                written.result()  # the previous shard is written (or its error raised) before this one queues
            patients = prepared.seqs.patients
            written = writer.submit(_lay_out_and_sink, sink, patients, job.labels, probs, job.patient_id_type)
            tally.add(
                len(prepared.seqs),
                prepared.unscored,
                prepared.quarantine,
                prepared.unknown_codes,
                prepared.code_events,
                prepared.rows,
                prepared.truncation,
                prepared.matched_codes,
            )
            del prepared, probs, patients
        if written is not None:
            written.result()
    return tally


def _collect(job: Job, config: Config, model: BehrtForMultiLabel, out: Path) -> tuple[pa.Table, Tally]:
    """Every shard's predictions in one long table (for layout=meds), on either engine."""
    if config.engine == "ray":
        from behrt_rope.engine.ray_predict import predict_on_ray

        # parts in a temporary folder beside OUT, named so that a rerun clears what a killed run left
        with tempfile.TemporaryDirectory(prefix=f".{out.name}{atomic.PARTIAL_MARK}parts-", dir=out.parent) as parts:
            tally = predict_on_ray(job, config, Path(parts))
            files = sorted(Path(parts).glob("part-*.parquet"))
            table = pa.concat_tables([pq.read_table(f) for f in files]) if files else None
    else:
        tables: list[pa.Table] = []
        tally = _predict_local(job, config, model, tables.append)
        table = pa.concat_tables(tables) if tables else None
    if table is None:
        table = predictions_schema(job.patient_id_type or "string").empty_table()
    return table, tally


def _code_matching(tally: Tally, job: Job) -> dict[str, Any]:
    """The summary's account of ``match_codes``: what it respelled, and the unknown code events that more
    remedies would match (:func:`~behrt_rope.scoring.code_match.would_match`)."""
    matcher = Matcher(job.vocab["token"], job.match_codes)
    return {
        MATCH_SETTING: list(job.match_codes),
        "matched_code_events": sum(tally.matched_codes.values()),
        "matched_codes_top": {f"{t} -> {matcher(t)}": n for t, n in tally.matched_codes.most_common(20)},
        "unknown_would_match": would_match(tally.unknown_codes, job.vocab["token"], job.match_codes),
    }


def _warn_unknown(tally: Tally, job: Job, matchable: dict[str, int]) -> None:
    """Warn when most code events have codes the model never saw, or when a ``match_codes`` setting would
    match some of them; each warning names the setting and, when they differ, both formats."""
    unknown = sum(tally.unknown_codes.values())
    hint = _match_hint(tally, job, matchable)
    if tally.code_events and unknown > UNKNOWN_WARNING_SHARE * tally.code_events:
        log.warning(
            "predict: %.0f%% of code events have codes the model never saw (most frequent: %s; the model's "
            "codes look like %s); %s%s",
            100 * unknown / tally.code_events,
            ", ".join(t for t, _ in tally.unknown_codes.most_common(3)),
            ", ".join(job.labels[:3]),
            hint or "are the reader settings (etl.*) naming codes the way training did?",
            f" ({format_note(job)})" if format_note(job) else "",
        )
    elif hint:
        log.warning("predict: %s", hint)


def _match_hint(tally: Tally, job: Job, matchable: dict[str, int]) -> str:
    """How many unknown code events the best ``match_codes`` setting would match, with an example ('' for none)."""
    if not matchable:
        return ""
    setting, events = max(matchable.items(), key=lambda item: item[1])
    matcher = Matcher(job.vocab["token"], setting.split(","))
    example = next(t for t, _ in tally.unknown_codes.most_common() if matcher(t) is not None)
    return (
        f"{events} of the {sum(tally.unknown_codes.values())} unknown code events would match the model's codes "
        f"with {MATCH_SETTING}={setting} ({example} -> {matcher(example)}); rerun with it to use them"
    )


def _require_scored(tally: Tally, out: Path) -> None:
    """Stop, before ``out`` is renamed into place, when no patient could be scored: the sidecars written
    beside it say why (an empty predictions file would pass for a run that scored everyone)."""
    if tally.patients_scored:
        return
    unscored = pd.concat(tally.unscored, ignore_index=True) if tally.unscored else pd.DataFrame({S.REASON: []})
    reasons = ", ".join(f"{reason} ({n})" for reason, n in Counter(unscored[S.REASON]).most_common(3))
    stem = out.with_suffix("")
    raise UserError(
        f"no patient could be scored: {len(unscored)} patient(s) in the input"
        + (f", none with a usable history (most frequent reasons: {reasons})" if reasons else "")
        + f"; see {stem}.unscored.parquet and {stem}.quarantine.parquet"
    )


def _write_sidecars(out: Path, config: Config, tally: Tally, job: Job, seconds: float) -> None:
    """The unscored patients, the quarantine, the resolved config and the summary, each written atomically."""
    stem = out.with_suffix("")
    unscored = pd.concat(tally.unscored, ignore_index=True) if tally.unscored else pd.DataFrame()
    if unscored.empty:
        unscored = pd.DataFrame({S.PATIENT_ID: pd.Series(dtype=object), S.REASON: pd.Series(dtype=object)})
    unscored = unscored.sort_values(S.PATIENT_ID, kind="stable", ignore_index=True)
    quarantine = pd.concat(tally.quarantine, ignore_index=True) if tally.quarantine else pd.DataFrame()
    quarantine = (
        quarantine.sort_values([S.SOURCE_TABLE, S.SOURCE_ROW], kind="stable") if len(quarantine) else quarantine
    )
    with atomic.atomic_path(f"{stem}.unscored.parquet") as tmp:
        pq.write_table(pa.Table.from_pandas(unscored, preserve_index=False), tmp)
    with atomic.atomic_path(f"{stem}.quarantine.parquet") as tmp:
        pq.write_table(
            pa.Table.from_pandas(quarantine, schema=S.QUARANTINE, preserve_index=False)
            if len(quarantine)
            else S.QUARANTINE.empty_table(),
            tmp,
        )
    config_lib.save(config, f"{stem}.config.yaml")
    etl, labels = job.etl, job.labels
    unknown_events = sum(tally.unknown_codes.values())
    reasons = dict(Counter(quarantine[S.REASON])) if len(quarantine) else {}
    summary = {
        "predictions": str(out),
        "patients_scored": tally.patients_scored,
        "patients_not_scored": len(unscored),
        "not_scored_reasons": dict(Counter(unscored[S.REASON])),
        "label_codes": len(labels),
        "unknown_code_events": unknown_events,
        "unknown_distinct_codes": len(tally.unknown_codes),
        "unknown_codes_top": dict(tally.unknown_codes.most_common(20)),
        "code_events": tally.code_events,
        **_code_matching(tally, job),
        "rows_quarantined": reasons,
        "as_of": job.as_of,
        "as_of_source": "given" if job.as_of_given else "run date",
        "events_after_as_of": reasons.get(S.Reason.AFTER_AS_OF, 0),
        "input_rows": tally.input_rows(),
        "truncation": {"max_seq_len": etl.max_seq_len, **{k: int(v) for k, v in sorted(tally.truncation.items())}},
        "input_format": etl.format,
        "training_format": job.trained_format or None,
        "format_differs": bool(format_note(job)),
        "engine": config.engine,
        "shards": job.shards,
        "seconds": round(seconds, 3),
    }
    write_json(Path(f"{stem}.summary.json"), summary)
    _warn_unknown(tally, job, summary["unknown_would_match"])
    if summary["events_after_as_of"]:
        log.warning(
            "predict: %d event(s) dated after %s (as_of) set aside, reason %s in %s.quarantine.parquet",
            summary["events_after_as_of"],
            job.as_of,
            S.Reason.AFTER_AS_OF,
            stem.name,
        )
    log.info(
        "predict: %d patients scored, %d not scored (%s), %d events with codes unseen in training (%d codes)",
        summary["patients_scored"],
        summary["patients_not_scored"],
        summary["not_scored_reasons"] or "none",
        unknown_events,
        len(tally.unknown_codes),
    )
