"""Reader of the MEDS format: ``data/**/*.parquet`` event shards and ``metadata/subject_splits.parquet``.

Only a few kinds of MEDS rows matter for BEHRT: the birth and death events (one canonical patient row per
birth event, death merged into it), diagnoses (``etl.meds.code_pattern``) and, for ``visit_rule=admission``,
hospital admissions and discharges. Each file is streamed in batches of three columns and those rows are
picked with Arrow compute (no pandas frame of all events is ever built); every other row of the patient
shard is counted in ``filtered``, so that per file ``rows_read = canonical rows + filtered``.

Rules (docs/formats.md):

- a subject's birth is its ``MEDS_BIRTH`` event; two birth events with different times give two patient rows,
  which the cleaning step quarantines as conflicting; diagnoses of a subject without any birth event are
  quarantined as ``missing_birth``;
- death is the subject's earliest ``MEDS_DEATH`` event; death, admission and discharge rows are lookups and
  count as ``filtered``;
- a diagnosis code is the ``code`` group of ``code_pattern``; its system is ``system_template`` with the
  ``system`` group filled in (``DIAGNOSIS//ICD//10//I10`` -> ``I10``, ``ICD10``);
- visits: ``same_time`` (one visit per timestamp), ``same_day`` (the cleaning step groups by calendar day) or
  ``admission`` (diagnoses from an admission up to its discharge, both inclusive, form one visit; others fall
  back to their calendar day).
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from behrt_rope import schema as S
from behrt_rope.errors import InputSchemaError, UserError
from behrt_rope.etl import io
from behrt_rope.etl.config import EtlConfig, MedsConfig
from behrt_rope.etl.raw import EVENT_COLUMNS, PATIENT_COLUMNS, RawTables, concat, events_frame, patients_frame
from behrt_rope.etl.split import shard_of

COLUMNS = (S.MEDS_SUBJECT_ID, S.MEDS_TIME, S.MEDS_CODE)
_ROW = "__row"  # the row's 0-based number in its file
_CODE_GROUP, _SYSTEM_GROUP = "code", "system"  # named groups of etl.meds.code_pattern
_KINDS = {S.MEDS_SUBJECT_ID: "id", S.MEDS_TIME: "time", S.MEDS_CODE: "code"}


def read(input_dir: Path, config: EtlConfig, shard: int = 0, n_shards: int = 1) -> RawTables:
    """Read the rows of patient shard ``shard`` (of ``n_shards``) from a MEDS dataset directory."""
    meds = config.meds
    pattern = _check_pattern(meds.code_pattern)
    rows_read: Counter[str] = Counter()
    filtered: Counter[str] = Counter()
    picked: dict[str, list[pa.Table]] = {k: [] for k in ("birth", "death", "diagnosis", "admission", "discharge")}
    subjects: list[np.ndarray] = []
    integer_ids = True
    for path in data_files(input_dir):
        name = str(path.relative_to(input_dir))
        io.require_columns(path, COLUMNS, io.column_names(path))
        first_row = 0
        for batch in io.iter_batches(path, COLUMNS):
            for column in COLUMNS:
                io.check_arrow_type(path, column, batch[column], _KINDS[column])
            integer_ids &= pa.types.is_integer(batch[S.MEDS_SUBJECT_ID].type)
            batch = batch.append_column(_ROW, pa.array(np.arange(first_row, first_row + batch.num_rows)))
            first_row += batch.num_rows
            if n_shards > 1:
                batch = batch.filter(_in_shard(batch[S.MEDS_SUBJECT_ID], shard, n_shards))
            rows_read[name] += batch.num_rows
            subjects.append(io.to_text(pc.unique(batch[S.MEDS_SUBJECT_ID])))
            used = _pick(batch, meds, pattern, name, picked)
            filtered[name] += batch.num_rows - used

    notes: dict[str, Any] = {}
    patients, birth_ids = _patients(picked, notes)
    events = _diagnoses(picked, meds, birth_ids, notes, config.max_invalid_fraction, input_dir)
    all_subjects = np.unique(np.concatenate(subjects)) if subjects else np.zeros(0, dtype=object)
    notes["meds.subjects"] = len(all_subjects)
    notes["meds.subjects_without_birth"] = int((~np.isin(all_subjects, birth_ids)).sum())
    splits = read_splits(input_dir, shard, n_shards)
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
        patient_id_type="int64" if integer_ids and rows_read else "string",
    )


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


def read_splits(input_dir: Path, shard: int, n_shards: int) -> pd.DataFrame | None:
    """The shard's subjects in ``metadata/subject_splits.parquet`` (PATIENT_ID, SPLIT), or None without it.

    A subject listed twice keeps its first split; a split name other than train/tuning/held_out stops.
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
    frame = frame[(frame[S.PATIENT_ID] != "") & (shard_of(ids, n_shards) == shard)]
    return frame.drop_duplicates(S.PATIENT_ID, keep="first").reset_index(drop=True)


# ---------------------------------------------------------------------------------------------------------
def _check_pattern(pattern: str) -> str:
    """Stop early, naming the setting, when ``code_pattern`` is not usable."""
    try:
        groups = re.compile(pattern).groupindex
    except re.error as err:
        raise UserError(f"etl.meds.code_pattern {pattern!r} is not a regular expression: {err}") from err
    if _CODE_GROUP not in groups:
        raise UserError(f"etl.meds.code_pattern {pattern!r} needs a named group (?P<code>...)")
    try:
        pc.extract_regex(pa.array([""]), pattern)
    except pa.ArrowInvalid as err:
        raise UserError(
            f"etl.meds.code_pattern {pattern!r}: {err} (RE2 syntax; name every group or use (?:...))"
        ) from err
    return pattern


def _in_shard(ids: pa.ChunkedArray, shard: int, n_shards: int) -> pa.ChunkedArray:
    """True for rows whose subject falls in ``shard``; the hash runs once per distinct subject."""
    distinct = pc.unique(ids)
    mine = distinct.filter(pa.array(shard_of(io.to_text(distinct), n_shards) == shard))
    return pc.is_in(ids, value_set=mine)


def _pick(batch: pa.Table, meds: MedsConfig, pattern: str, name: str, picked: dict[str, list[pa.Table]]) -> int:
    """Set aside the rows the reader uses; return how many become canonical rows (births and diagnoses)."""
    code = batch[S.MEDS_CODE]
    if not (pa.types.is_string(code.type) or pa.types.is_large_string(code.type)):
        code = pc.cast(code, pa.string())
    keys = batch.select([S.MEDS_SUBJECT_ID, S.MEDS_TIME, _ROW])
    birth = pc.fill_null(pc.equal(code, meds.birth_code), False)
    death = pc.fill_null(pc.equal(code, meds.death_code), False)
    parts = pc.extract_regex(code, pattern)
    diagnosis = pc.and_(pc.is_valid(parts), pc.invert(pc.or_(birth, death)))
    picked["birth"].append(keys.filter(birth).append_column("file", _const(name, birth)))
    picked["death"].append(keys.filter(death))
    found = keys.filter(diagnosis).append_column("file", _const(name, diagnosis))
    matched = parts.filter(diagnosis)
    fields = [field.name for field in matched.type]
    for group in (_CODE_GROUP, _SYSTEM_GROUP):
        if group in fields:
            found = found.append_column(group, pc.struct_field(matched, group))
    picked["diagnosis"].append(found)
    if meds.visit_rule == "admission":
        for kind, prefix in (("admission", meds.admission_prefix), ("discharge", meds.discharge_prefix)):
            picked[kind].append(keys.filter(pc.fill_null(pc.starts_with(code, prefix), False)))
    return int(pc.sum(birth).as_py() or 0) + int(pc.sum(diagnosis).as_py() or 0)


def _const(value: str, mask: pa.ChunkedArray) -> pa.Array:
    return pa.array(np.full(int(pc.sum(mask).as_py() or 0), value, dtype=object), pa.string())


def _combine(tables: list[pa.Table]) -> pa.Table | None:
    tables = [t for t in tables if t.num_rows]
    return pa.concat_tables(tables, promote_options="permissive") if tables else None


def _patients(picked: dict[str, list[pa.Table]], notes: dict[str, Any]) -> tuple[pd.DataFrame, np.ndarray]:
    """One canonical patient row per birth event, with the subject's earliest death; and the ids with births."""
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
    frames = []
    files = births["file"].to_numpy(zero_copy_only=False)
    for name in pd.unique(files):
        mine = files == name
        frames.append(
            patients_frame(
                ids[mine],
                io.parse_times(births[S.MEDS_TIME])[mine],
                io.to_text(births[S.MEDS_TIME])[mine],
                death[mine],
                death_raw[mine],
                str(name),
                births[_ROW].to_numpy()[mine],
            )
        )
    notes["meds.birth_events"] = births.num_rows
    notes["meds.subjects_with_death"] = int(np.isin(np.unique(ids), death_by_id.index.to_numpy()).sum())
    return concat(frames, PATIENT_COLUMNS), np.unique(ids)


def _diagnoses(
    picked: dict[str, list[pa.Table]],
    meds: MedsConfig,
    birth_ids: np.ndarray,
    notes: dict[str, Any],
    max_invalid: float,
    input_dir: Path,
) -> pd.DataFrame:
    """Canonical event rows of the diagnoses, with code system, visit id and the missing_birth finding."""
    found = _combine(picked["diagnosis"])
    notes["meds.diagnosis_rows"] = 0 if found is None else found.num_rows
    if found is None:
        return _with_reason(concat([], EVENT_COLUMNS), np.zeros(0, dtype=object))
    ids = io.to_text(found[S.MEDS_SUBJECT_ID])
    time = io.parse_times(found[S.MEDS_TIME])
    code = io.to_text(found[_CODE_GROUP])
    system = _systems(found, meds.system_template)
    for name, n in zip(*np.unique(system, return_counts=True)):
        notes[f"meds.diagnosis_rows.{name or 'no_system'}"] = int(n)
    if meds.visit_rule == "same_time":
        visit = np.where(np.isnat(time), "", np.datetime_as_string(time, unit="us")).astype(object)
    elif meds.visit_rule == "admission":
        visit = _admission_visits(ids, time, picked, notes)
    else:
        visit = None
    missing_birth = (ids != "") & ~np.isin(ids, birth_ids)
    notes["meds.diagnoses_without_birth"] = int(missing_birth.sum())
    notes["meds.subjects_with_diagnoses_without_birth"] = len(np.unique(ids[missing_birth]))
    reason = np.where(missing_birth, S.Reason.MISSING_BIRTH, "").astype(object)
    files = found["file"].to_numpy(zero_copy_only=False)
    time_raw = io.to_text(found[S.MEDS_TIME])
    rows = found[_ROW].to_numpy()
    frames = []
    for name in pd.unique(files):
        mine = files == name
        if not pa.types.is_temporal(found[S.MEDS_TIME].type):
            io.check_parse_rate(
                input_dir / str(name), S.MEDS_TIME, found[S.MEDS_TIME].filter(pa.array(mine)), time[mine], max_invalid
            )
        frame = events_frame(
            ids[mine],
            time[mine],
            time_raw[mine],
            code[mine],
            system[mine],
            None if visit is None else visit[mine],
            str(name),
            rows[mine],
        )
        frames.append(_with_reason(frame, reason[mine]))
    return pd.concat(frames, ignore_index=True)


def _with_reason(frame: pd.DataFrame, reason: np.ndarray) -> pd.DataFrame:
    frame[S.REASON] = np.asarray(reason, dtype=object)
    return frame


def _systems(found: pa.Table, template: str) -> np.ndarray:
    """The code system of each diagnosis: ``template`` with ``{system}`` filled, once per distinct value.

    Without a ``system`` group, a template without ``{system}`` is written as is, and one with it gives ''.
    """
    if _SYSTEM_GROUP not in found.column_names:
        value = "" if "{system}" in template else template
        return np.full(found.num_rows, value, dtype=object)
    raw = io.to_text(found[_SYSTEM_GROUP])
    uniques, index = np.unique(raw, return_inverse=True)
    try:
        written = np.array([template.format(system=u) for u in uniques], dtype=object)
    except (KeyError, IndexError, ValueError) as err:
        raise UserError(f"etl.meds.system_template {template!r} is not usable: only {{system}} may appear") from err
    return written[index]


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
