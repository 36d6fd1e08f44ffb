"""Reader of the MEDS format: ``data/**/*.parquet`` event shards and ``metadata/subject_splits.parquet``.

Only a few kinds of MEDS rows matter for BEHRT: the birth and death events (one canonical patient row per
birth event, death merged into it), diagnoses (the styles of ``etl.meds.code_patterns``, see
:mod:`behrt_rope.etl.code_styles`) and the events that mark visits (hospital admissions and discharges,
encounters). Each file is streamed in batches of three columns and those rows are picked with Arrow compute
(no pandas frame of all events is ever built); every other row of the patient shard is counted in
``filtered``, so that per file ``rows_read = canonical rows + filtered``, and the prefixes of the filtered
codes are counted so that an ETL that finds nothing can say what it saw.

Rules (docs/formats.md):

- a subject's birth is its ``MEDS_BIRTH`` event; two birth events with different times give two patient rows,
  which the cleaning step quarantines as conflicting; diagnoses of a subject without any birth event are
  quarantined as ``missing_birth``;
- death is the subject's earliest ``MEDS_DEATH`` event, sex its ``GENDER//F``-style event
  (``etl.meds.sex_prefixes``); death, sex, admission, discharge and encounter rows are lookups and count as
  ``filtered``;
- a diagnosis is a code matched by a style; its token is ``VOCABULARY/code`` (``DIAGNOSIS//ICD//10//I10``
  -> ``ICD10CM/I10``, ``SNOMED//44054006`` -> ``SNOMED/44054006``);
- visits: ``admission`` (diagnoses from an admission up to its discharge, both inclusive, form one visit),
  ``encounter`` (a diagnosis joins the subject's latest encounter event at or before it on the same day),
  ``same_time`` (one visit per timestamp) or ``same_day`` (the cleaning step groups by calendar day); a
  diagnosis outside every admission or encounter falls back to its calendar day. ``auto`` picks admission
  when the dataset has admission and discharge events, else encounter when it has encounter events, else
  same_day; the choice is made on the whole dataset (from every row, before a shard's
  rows are picked), so shards agree.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from behrt_rope import schema as S
from behrt_rope.errors import InputSchemaError
from behrt_rope.etl import code_styles, io
from behrt_rope.etl.code_styles import Style
from behrt_rope.etl.config import EtlConfig, MedsConfig
from behrt_rope.etl.raw import (
    CODE_RAW,
    EVENT_COLUMNS,
    PATIENT_COLUMNS,
    RawTables,
    concat,
    events_frame,
    patients_frame,
)
from behrt_rope.etl.readers import source
from behrt_rope.etl.readers.source import Plan, ShardInput
from behrt_rope.etl.split import shard_of

COLUMNS = (S.MEDS_SUBJECT_ID, S.MEDS_TIME, S.MEDS_CODE)
_ROW = source.ROW  # the row's 0-based number in its file
_DATA = "data"
_KINDS = {S.MEDS_SUBJECT_ID: "id", S.MEDS_TIME: "time", S.MEDS_CODE: "code"}
_LOOKUPS = ("admission", "discharge", "encounter")
_VOCABULARY, _STYLE = "vocabulary", "style"
_SEX_VALUE = "sex_value"
_TIME_RAW = "time_raw"  # the time as read (text), beside the parsed time of a picked row
id_text = io.to_text


def read(input_dir: Path, config: EtlConfig, shard: int = 0, n_shards: int = 1) -> RawTables:
    """Read the rows of patient shard ``shard`` (of ``n_shards``) from a MEDS dataset directory."""
    plan_ = plan(input_dir, config)
    data = source.gather(plan_, id_text, facts(plan_, config), shard, n_shards, lookups(plan_, config, shard == 0))
    return build(data, config)


def plan(input_dir: Path, config: EtlConfig) -> Plan:
    """The event files and their three columns, checked (names and types) on their schemas."""
    data = source.plan_table(input_dir, _DATA, data_files(input_dir), COLUMNS, COLUMNS, S.MEDS_SUBJECT_ID)
    source.check_types(data, _KINDS)
    return Plan(input_dir, {_DATA: data}, {"all:integer_ids": source.integer_ids(data)})


@dataclass
class Lookups:
    """The metadata tables: subject splits (all subjects) and code descriptions; None where absent."""

    splits: pd.DataFrame | None
    descriptions: pd.DataFrame | None


def lookups(plan: Plan, config: EtlConfig, descriptions: bool = True) -> Lookups:
    """Read ``metadata/subject_splits.parquet`` and (with ``descriptions``) ``metadata/codes.parquet``."""
    styles = code_styles.parse_styles(config.meds.code_patterns)
    aliases = code_styles.parse_aliases(config.meds.vocabulary_aliases)
    named = read_descriptions(plan.input_dir, styles, aliases) if descriptions else None
    return Lookups(read_splits(plan.input_dir), named)


def facts(plan: Plan, config: EtlConfig) -> source.BatchFacts:
    """Per batch (before any shard is picked): which visit-marking lookup kinds it holds (``seen.KIND``)."""

    def seen(table: source.TablePlan, name: str, batch: pa.Table) -> dict[str, bool]:
        lookups = _lookup_masks(_string(batch[S.MEDS_CODE]), config.meds)
        return {f"seen.{kind}": bool(pc.any(mask).as_py()) for kind, mask in lookups.items()}

    return seen


def build(data: ShardInput, config: EtlConfig) -> RawTables:
    """Canonical patients and diagnoses of one shard's rows (module docstring for the rules)."""
    meds = config.meds
    styles = code_styles.parse_styles(meds.code_patterns)
    aliases = code_styles.parse_aliases(meds.vocabulary_aliases)
    rows_read: Counter[str] = Counter({name: 0 for name in data.names(_DATA)})
    filtered: Counter[str] = Counter({name: 0 for name in data.names(_DATA)})
    prefixes: Counter[str] = Counter()
    picked: dict[str, list[pa.Table]] = {k: [] for k in ("birth", "death", "sex", "diagnosis", *_LOOKUPS)}
    subjects: list[np.ndarray] = []
    for chunk in data.of(_DATA):
        batch = chunk.table
        batch = batch.set_column(batch.schema.get_field_index(S.MEDS_CODE), S.MEDS_CODE, _string(batch[S.MEDS_CODE]))
        rows_read[chunk.name] += batch.num_rows
        subjects.append(io.to_text(pc.unique(batch[S.MEDS_SUBJECT_ID])))
        lookups = _lookup_masks(batch[S.MEDS_CODE], meds)
        used = _pick(batch, meds, styles, aliases, chunk.name, picked, lookups, prefixes)
        filtered[chunk.name] += batch.num_rows - used

    notes: dict[str, Any] = {}
    seen = Counter({key[len("seen.") :]: 1 for key, value in data.facts.items() if key.startswith("seen.") and value})
    rule = resolve_visit_rule(meds, seen)
    notes["meds.visit_rule"] = rule if meds.visit_rule != "auto" else f"{rule} (auto)"
    patients, birth_ids = _patients(picked, meds.sex_prefixes, notes)
    events = _diagnoses(picked, styles, rule, birth_ids, notes, config.max_invalid_fraction, data.plan.input_dir)
    all_subjects = np.unique(np.concatenate(subjects)) if subjects else np.zeros(0, dtype=object)
    notes["meds.subjects"] = len(all_subjects)
    notes["meds.subjects_without_birth"] = int((~np.isin(all_subjects, birth_ids)).sum())
    meta: Lookups = data.lookups
    splits = None if meta.splits is None else shard_splits(meta.splits, data.shard, data.n_shards)
    notes["meds.split_source"] = S.MEDS_SPLITS_FILE if splits is not None else "none: hash split of subject ids"
    if splits is not None:
        notes["meds.subjects_with_source_split"] = int(np.isin(all_subjects, splits[S.PATIENT_ID]).sum())
    return RawTables(
        patients=patients,
        events=events,
        rows_read=dict(rows_read),
        filtered=dict(filtered),
        source_splits=splits,
        notes=notes,
        patient_id_type="int64" if data.facts.get("all:integer_ids") else "string",
        filtered_prefixes=prefixes,
        descriptions=meta.descriptions if data.shard == 0 else None,
    )


def resolve_visit_rule(meds: MedsConfig, seen: Counter[str]) -> str:
    """The visit rule to apply: the configured one, or for ``auto`` what the dataset's events support.

    >>> resolve_visit_rule(MedsConfig(), Counter(admission=1, discharge=1, encounter=1))
    'admission'
    >>> resolve_visit_rule(MedsConfig(), Counter(admission=1, encounter=1))
    'encounter'
    >>> resolve_visit_rule(MedsConfig(), Counter())
    'same_day'
    """
    if meds.visit_rule != "auto":
        return meds.visit_rule
    if seen["admission"] and seen["discharge"]:
        return "admission"
    return "encounter" if seen["encounter"] else "same_day"


def data_files(input_dir: Path) -> list[Path]:
    """The dataset's event files, ``data/**/*.parquet`` in path order."""
    folder = input_dir / S.MEDS_DATA_DIR
    files = sorted(p for p in folder.rglob("*.parquet") if p.is_file()) if folder.is_dir() else []
    if not files:
        raise InputSchemaError(
            f"{input_dir}: no MEDS event files (looked for {S.MEDS_DATA_DIR}/**/*.parquet); "
            f"is this a MEDS dataset? (--format visits|meds|omop)"
        )
    return files


def read_splits(input_dir: Path) -> pd.DataFrame | None:
    """``metadata/subject_splits.parquet`` as (PATIENT_ID, SPLIT) rows with an id, or None without it.

    A split name other than train/tuning/held_out stops.
    """
    path = input_dir / S.MEDS_SPLITS_FILE
    if not path.is_file():
        return None
    columns = (S.MEDS_SUBJECT_ID, S.MEDS_SPLIT)
    io.require_columns(path, columns, io.column_names(path))
    table = pq.read_table(path, columns=list(columns))
    io.check_arrow_type(path, S.MEDS_SUBJECT_ID, table[S.MEDS_SUBJECT_ID], "id")
    io.check_arrow_type(path, S.MEDS_SPLIT, table[S.MEDS_SPLIT], "code")
    ids, split = io.to_text(table[S.MEDS_SUBJECT_ID]), io.to_text(table[S.MEDS_SPLIT])
    unknown = ~np.isin(split, S.SPLITS)
    if unknown.any():
        row = int(np.flatnonzero(unknown)[0])
        raise InputSchemaError(
            f"{path}: column '{S.MEDS_SPLIT}' must hold {', '.join(S.SPLITS)}; "
            f"{int(unknown.sum()):,} rows do not (example row {row}: {io.shown(split[row])})"
        )
    frame = pd.DataFrame({S.PATIENT_ID: ids, S.SPLIT: split})
    return frame[frame[S.PATIENT_ID] != ""].reset_index(drop=True)


def shard_splits(splits: pd.DataFrame, shard: int, n_shards: int) -> pd.DataFrame:
    """The subjects of ``shard`` in ``splits``; a subject listed twice keeps its first split."""
    ids = splits[S.PATIENT_ID].to_numpy(dtype=object)
    frame = splits[shard_of(ids, n_shards) == shard]
    return frame.drop_duplicates(S.PATIENT_ID, keep="first").reset_index(drop=True)


# ---------------------------------------------------------------------------------------------------------
def read_descriptions(input_dir: Path, styles: list[Style], aliases: dict[str, str]) -> pd.DataFrame | None:
    """Diagnosis descriptions from ``metadata/codes.parquet`` (CODE, CODE_SYSTEM, DESCRIPTION), or None.

    Only codes the styles take as diagnoses are kept, named the way their events are.
    """
    path = input_dir / S.MEDS_CODES_FILE
    if not path.is_file() or S.DESCRIPTION not in io.column_names(path):
        return None
    table = pq.read_table(path, columns=[S.MEDS_CODE, S.DESCRIPTION])
    code = _string(table[S.MEDS_CODE])
    matches = code_styles.match(code, styles, aliases)
    described = io.to_text(table[S.DESCRIPTION])
    keep = (matches.style >= 0) & (described != "")
    return pd.DataFrame(
        {S.CODE: matches.code[keep], S.CODE_SYSTEM: matches.vocabulary[keep], S.DESCRIPTION: described[keep]}
    )


def _string(code: pa.ChunkedArray) -> pa.ChunkedArray:
    """The code column as Arrow strings (large strings and dictionaries are cast), surrounding blanks stripped."""
    return pc.utf8_trim_whitespace(code if pa.types.is_string(code.type) else pc.cast(code, pa.string()))


def _lookup_masks(code: pa.ChunkedArray, meds: MedsConfig) -> dict[str, pa.ChunkedArray]:
    """Per lookup kind the visit rule may need, a null-free mask of the rows holding such events."""
    wanted = {
        "admission": (meds.admission_prefix,),
        "discharge": (meds.discharge_prefix,),
        "encounter": tuple(meds.encounter_prefixes),
    }
    if meds.visit_rule != "auto":
        wanted = {k: v for k, v in wanted.items() if k in _rule_lookups(meds.visit_rule)}
    return {kind: _prefix_mask(code, prefixes) for kind, prefixes in wanted.items()}


def _rule_lookups(rule: str) -> tuple[str, ...]:
    return {"admission": ("admission", "discharge"), "encounter": ("encounter",)}.get(rule, ())


def _pick(
    batch: pa.Table,
    meds: MedsConfig,
    styles: list[Style],
    aliases: dict[str, str],
    name: str,
    picked: dict[str, list[pa.Table]],
    lookups: dict[str, pa.ChunkedArray],
    prefixes: Counter[str],
) -> int:
    """Set aside the rows the reader uses; count the prefixes of the rest; return how many become canonical
    rows (births, diagnoses, and the rows without a code, which the cleaning step quarantines as
    ``empty_code``; their style is -1)."""
    code = batch[S.MEDS_CODE]
    keys = batch.select([S.MEDS_SUBJECT_ID, S.MEDS_TIME, _ROW])
    birth = pc.fill_null(pc.equal(code, meds.birth_code), False)
    death = pc.fill_null(pc.equal(code, meds.death_code), False)
    empty = pc.fill_null(pc.equal(code, ""), True).to_numpy()  # null or blank (codes arrive trimmed)
    matches = code_styles.match(code, styles, aliases)
    diagnosis = pa.array(((matches.style >= 0) | empty) & ~pc.or_(birth, death).to_numpy())
    picked["birth"].append(keys.filter(birth).append_column("file", _const(name, birth)))
    picked["death"].append(keys.filter(death))
    sex = _prefix_mask(code, meds.sex_prefixes)
    picked["sex"].append(keys.filter(sex).append_column(_SEX_VALUE, code.filter(sex)))
    found = keys.filter(diagnosis).append_column("file", _const(name, diagnosis))
    rows = np.asarray(diagnosis, dtype=bool)
    found = found.append_column(code_styles.CODE_GROUP, pa.array(matches.code[rows], pa.string()))
    found = found.append_column(_VOCABULARY, pa.array(matches.vocabulary[rows], pa.string()))
    found = found.append_column(_STYLE, pa.array(matches.style[rows]))
    found = found.append_column(CODE_RAW, code.filter(diagnosis))
    picked["diagnosis"].append(found)
    for kind, mask in lookups.items():
        picked[kind].append(keys.filter(mask))
    used = pc.or_(birth, diagnosis)
    prefixes.update(code_styles.prefix_counts(code.filter(pc.invert(used))))
    return int(pc.sum(birth).as_py() or 0) + int(rows.sum())


def _prefix_mask(code: pa.ChunkedArray, prefixes: Sequence[str]) -> pa.ChunkedArray:
    """Null-free mask of the rows whose code starts with one of ``prefixes`` (none: all False)."""
    mask = pc.starts_with(code, prefixes[0]) if prefixes else pc.equal(code, "\x00")
    for prefix in prefixes[1:]:
        mask = pc.or_(mask, pc.starts_with(code, prefix))
    return pc.fill_null(mask, False)


def _sex_by_subject(sexes: pa.Table | None, prefixes: list[str], notes: dict[str, Any]) -> pd.Series:
    """Per subject id (index), the raw sex: the code without its prefix (``GENDER//F`` -> ``F``). A subject
    with several different values keeps the earliest-timed one (null time, i.e. static, first); counted in
    ``notes``."""
    if sexes is None:
        notes["meds.subjects_with_sex"] = 0
        return pd.Series(dtype=object)
    value = sexes[_SEX_VALUE]
    for prefix in sorted(prefixes, key=len, reverse=True):
        value = pc.if_else(pc.starts_with(value, prefix), pc.utf8_slice_codeunits(value, len(prefix)), value)
    frame = pd.DataFrame(
        {
            "id": io.to_text(sexes[S.MEDS_SUBJECT_ID]),
            "t": io.parse_times(sexes[S.MEDS_TIME]),
            "v": io.to_text(value),
        }
    ).sort_values(["id", "t"], na_position="first", kind="stable")
    notes["meds.subjects_with_sex"] = int(frame["id"].nunique())
    notes["meds.subjects_with_several_sexes"] = int((frame.groupby("id")["v"].nunique() > 1).sum())
    return frame.drop_duplicates("id", keep="first").set_index("id")["v"]


def _const(value: str, mask: pa.ChunkedArray) -> pa.Array:
    return pa.array(np.full(int(pc.sum(mask).as_py() or 0), value, dtype=object), pa.string())


def _combine(tables: list[pa.Table]) -> pa.Table | None:
    """The picked tables of every batch joined, each first brought to one layout (:func:`_uniform`), since
    files may type their columns differently; None when no table has a row."""
    tables = [_uniform(t) for t in tables if t.num_rows]
    return pa.concat_tables(tables) if tables else None


def _uniform(table: pa.Table) -> pa.Table:
    """A picked table with its subject ids as text, its times parsed (``timestamp[us]``, as
    :func:`io.parse_times` reads them) and the time as read, as text, in ``_TIME_RAW``.

    One file may hold integer ids and timestamps, the next text ids and ISO texts, a third zoned times:
    each alone is read, so their rows must join too.

    >>> a = pa.table({S.MEDS_SUBJECT_ID: [7], S.MEDS_TIME: pa.array([0], pa.timestamp("s", "UTC"))})
    >>> b = pa.table({S.MEDS_SUBJECT_ID: ["x"], S.MEDS_TIME: ["1970-01-01T02:00:00+02:00"]})
    >>> _combine([a, b]).to_pydict()
    {'subject_id': ['7', 'x'], 'time': [datetime.datetime(1970, 1, 1, 0, 0), datetime.datetime(1970, 1, 1, 2, 0)], \
'time_raw': ['1970-01-01 00:00:00Z', '1970-01-01T02:00:00+02:00']}
    """
    time = table[S.MEDS_TIME]
    table = table.set_column(
        table.schema.get_field_index(S.MEDS_TIME), S.MEDS_TIME, pa.array(io.parse_times(time), pa.timestamp("us"))
    )
    table = table.set_column(
        table.schema.get_field_index(S.MEDS_SUBJECT_ID),
        S.MEDS_SUBJECT_ID,
        pa.array(io.text_array(table[S.MEDS_SUBJECT_ID]), pa.large_string()),
    )
    return table.append_column(_TIME_RAW, pa.array(io.text_array(time), pa.large_string()))


def _patients(
    picked: dict[str, list[pa.Table]], sex_prefixes: list[str], notes: dict[str, Any]
) -> tuple[pd.DataFrame, np.ndarray]:
    """One canonical patient row per birth event, with the subject's earliest death and its sex; and the ids
    with births."""
    sex_by_id = _sex_by_subject(_combine(picked["sex"]), sex_prefixes, notes)
    births = _combine(picked["birth"])
    deaths = _combine(picked["death"])
    death_by_id = pd.Series(dtype="datetime64[us]")
    if deaths is not None:
        death_time = io.parse_times(deaths[S.MEDS_TIME])
        frame = pd.DataFrame({"id": io.to_text(deaths[S.MEDS_SUBJECT_ID]), "t": death_time}).dropna()
        death_by_id = frame.groupby("id")["t"].min()
        notes["meds.subjects_with_several_death_times"] = int((frame.groupby("id")["t"].nunique() > 1).sum())
    notes["meds.death_events"] = 0 if deaths is None else deaths.num_rows
    if births is None:
        notes["meds.birth_events"] = 0
        return concat([], PATIENT_COLUMNS), np.zeros(0, dtype=object)
    ids = io.to_text(births[S.MEDS_SUBJECT_ID])
    death = death_by_id.reindex(ids).to_numpy(dtype="datetime64[us]")
    death_raw = np.where(np.isnat(death), "", np.datetime_as_string(death, unit="s")).astype(object)
    sex = sex_by_id.reindex(ids).fillna("").to_numpy(dtype=object)
    frames = []
    files = births["file"].to_numpy(zero_copy_only=False)
    for name in pd.unique(files):
        mine = files == name
        frames.append(
            patients_frame(
                ids[mine],
                io.parse_times(births[S.MEDS_TIME])[mine],
                io.to_text(births[_TIME_RAW])[mine],
                death[mine],
                death_raw[mine],
                str(name),
                births[_ROW].to_numpy()[mine],
                sex_raw=sex[mine],
            )
        )
    notes["meds.birth_events"] = births.num_rows
    notes["meds.subjects_with_death"] = int(np.isin(np.unique(ids), death_by_id.index.to_numpy()).sum())
    return concat(frames, PATIENT_COLUMNS), np.unique(ids)


def _diagnoses(
    picked: dict[str, list[pa.Table]],
    styles: list[Style],
    rule: str,
    birth_ids: np.ndarray,
    notes: dict[str, Any],
    max_invalid: float,
    input_dir: Path,
) -> pd.DataFrame:
    """Canonical event rows of the diagnoses (and of the rows without a code), with vocabulary, visit id and
    the missing_birth finding."""
    found = _combine(picked["diagnosis"])
    matched = np.zeros(0, dtype=np.int64) if found is None else found[_STYLE].to_numpy()  # -1: no code
    notes["meds.diagnosis_rows"] = int((matched >= 0).sum())
    style_counts = np.bincount(matched[matched >= 0], minlength=len(styles)) if found is not None else None
    for i, style in enumerate(styles):
        notes[f"meds.code_pattern_rows.{style.entry}"] = 0 if style_counts is None else int(style_counts[i])
    if found is None:
        return _with_reason(concat([], EVENT_COLUMNS), np.zeros(0, dtype=object))
    ids = io.to_text(found[S.MEDS_SUBJECT_ID])
    time = io.parse_times(found[S.MEDS_TIME])
    code = io.to_text(found[code_styles.CODE_GROUP])
    vocabulary = io.to_text(found[_VOCABULARY])
    for name, n in zip(*np.unique(vocabulary[matched >= 0], return_counts=True)):
        notes[f"meds.diagnosis_rows.{name or 'no_vocabulary'}"] = int(n)
    if rule == "same_time":
        visit = np.where(np.isnat(time), "", np.datetime_as_string(time, unit="us")).astype(object)
    elif rule == "admission":
        visit = _admission_visits(ids, time, picked, notes)
    elif rule == "encounter":
        visit = _encounter_visits(ids, time, picked, notes)
    else:
        visit = None
    missing_birth = (ids != "") & ~np.isin(ids, birth_ids)
    notes["meds.diagnoses_without_birth"] = int(missing_birth.sum())
    notes["meds.subjects_with_diagnoses_without_birth"] = len(np.unique(ids[missing_birth]))
    reason = np.where(missing_birth, S.Reason.MISSING_BIRTH, "").astype(object)
    files = found["file"].to_numpy(zero_copy_only=False)
    time_raw = io.to_text(found[_TIME_RAW])
    rows = found[_ROW].to_numpy()
    code_raw = io.to_text(found[CODE_RAW])
    frames = []
    for name in pd.unique(files):
        mine = files == name
        raw = found[_TIME_RAW].filter(pa.array(mine))
        io.check_parse_rate(input_dir / str(name), S.MEDS_TIME, raw, time[mine], max_invalid, rows[mine])
        frame = events_frame(
            ids[mine],
            time[mine],
            time_raw[mine],
            code[mine],
            vocabulary[mine],
            None if visit is None else visit[mine],
            str(name),
            rows[mine],
        )
        frame[CODE_RAW] = code_raw[mine]
        frames.append(_with_reason(frame, reason[mine]))
    return pd.concat(frames, ignore_index=True)


def _with_reason(frame: pd.DataFrame, reason: np.ndarray) -> pd.DataFrame:
    frame[S.REASON] = np.asarray(reason, dtype=object)
    return frame


def _encounter_visits(
    ids: np.ndarray, time: np.ndarray, picked: dict[str, list[pa.Table]], notes: dict[str, Any]
) -> np.ndarray:
    """Visit id per diagnosis: ``encounter:<encounter time>`` of the subject's latest encounter event at or
    before the diagnosis on the same calendar day, else of its first encounter later that day (a diagnosis
    stamped with its date only, at midnight); else '' (the calendar day then groups it).

    MEDS encounter events carry their start only; the same-day bound keeps a diagnosis weeks after a visit
    from joining it.
    """
    visit = np.full(len(ids), "", dtype=object)
    encounters = _times(_combine(picked["encounter"])).sort_values("t")
    encounters = encounters.assign(start=encounters["t"])
    notes["meds.encounters"] = len(encounters)
    start = np.full(len(ids), np.datetime64("NaT"), dtype="datetime64[us]")
    events = pd.DataFrame({"t": time, "id": ids, "row": np.arange(len(ids))})
    events = events[~np.isnat(time)].sort_values("t")
    directions: tuple[Literal["backward", "forward"], ...] = ("backward", "forward")
    for direction in directions:
        todo = events[np.isnat(start[events["row"].to_numpy()])]
        if not len(todo) or not len(encounters):
            break
        matched = pd.merge_asof(todo, encounters, on="t", by="id", direction=direction)
        found = matched["start"].to_numpy(dtype="datetime64[us]")
        day = matched["t"].to_numpy(dtype="datetime64[us]").astype("datetime64[D]")
        same_day = ~np.isnat(found) & (found.astype("datetime64[D]") == day)
        start[matched["row"].to_numpy()[same_day]] = found[same_day]
    inside = ~np.isnat(start)
    visit[inside] = np.char.add("encounter:", np.datetime_as_string(start[inside], unit="s"))
    notes["meds.diagnoses_outside_encounter"] = int(((visit == "") & ~np.isnat(time)).sum())
    return visit


def _admission_visits(
    ids: np.ndarray, time: np.ndarray, picked: dict[str, list[pa.Table]], notes: dict[str, Any]
) -> np.ndarray:
    """Visit id per diagnosis: ``admission:<admission time>`` when it falls within a stay, else ''.

    Stays: a subject's admission and discharge events in time order (a discharge before an admission at the
    same instant: a transfer closes one stay and opens the next); each admission ends at the next discharge.
    A diagnosis belongs to the stay with ``start <= time <= end`` that ends first (MIMIC diagnoses carry the
    discharge time, which may also be the next stay's start), else to the latest stay started before it
    and still open. An admission without a later discharge covers nothing.
    """
    visit = np.full(len(ids), "", dtype=object)
    stays = _stays(_times(_combine(picked["admission"])), _times(_combine(picked["discharge"])), notes)
    events = pd.DataFrame({"t": time, "id": ids, "row": np.arange(len(ids))})
    events = events[~np.isnat(time)].sort_values("t")
    if len(events) and len(stays):
        start = np.full(len(ids), np.datetime64("NaT"), dtype="datetime64[us]")
        directions: tuple[tuple[Literal["forward", "backward"], str], ...] = (("forward", "end"), ("backward", "start"))
        for direction, key in directions:
            todo = events[np.isnat(start[events["row"].to_numpy()])]
            if not len(todo):
                break
            matched = pd.merge_asof(
                todo, stays.sort_values(key), left_on="t", right_on=key, by="id", direction=direction
            )
            inside = (matched["start"] <= matched["t"]) & (matched["t"] <= matched["end"])
            rows = matched["row"].to_numpy()[inside.to_numpy()]
            start[rows] = matched["start"].to_numpy(dtype="datetime64[us]")[inside.to_numpy()]
        found = ~np.isnat(start)
        visit[found] = np.char.add("admission:", np.datetime_as_string(start[found], unit="s"))
    notes["meds.diagnoses_outside_admission"] = int(((visit == "") & ~np.isnat(time)).sum())
    return visit


def _stays(admissions: pd.DataFrame, discharges: pd.DataFrame, notes: dict[str, Any]) -> pd.DataFrame:
    """(id, start, end) per admission closed by a later discharge of the same subject."""
    marks = pd.concat([admissions.assign(kind=1), discharges.assign(kind=0)], ignore_index=True)
    marks = marks.sort_values(["id", "t", "kind"], kind="stable").reset_index(drop=True)
    is_discharge = marks["kind"].to_numpy() == 0
    position = np.where(is_discharge, np.arange(len(marks)), len(marks))
    following = np.minimum.accumulate(position[::-1])[::-1]  # the first discharge at or after each row
    ids = marks["id"].to_numpy(dtype=object)
    times = marks["t"].to_numpy(dtype="datetime64[us]")
    admission = np.flatnonzero(~is_discharge)
    closing = following[admission]
    closed = closing < len(marks)
    closed[closed] = ids[closing[closed]] == ids[admission[closed]]
    notes["meds.admissions"] = len(admission)
    notes["meds.admissions_without_discharge"] = int((~closed).sum())
    return pd.DataFrame(
        {"id": ids[admission[closed]], "start": times[admission[closed]], "end": times[closing[closed]]}
    )


def _times(table: pa.Table | None) -> pd.DataFrame:
    """(t, id) of lookup events with a usable time."""
    if table is None:
        return pd.DataFrame({"t": pd.Series(dtype="datetime64[us]"), "id": pd.Series(dtype=object)})
    frame = pd.DataFrame({"t": io.parse_times(table[S.MEDS_TIME]), "id": io.to_text(table[S.MEDS_SUBJECT_ID])})
    return frame.dropna(subset=["t"]).drop_duplicates()
