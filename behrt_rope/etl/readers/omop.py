"""Reader of OMOP CDM tables: ``person``, ``condition_occurrence``, optional ``visit_occurrence`` and ``death``.

Tables are CSV or Parquet files (or folders of parts) found by name, case-insensitively, and so are their
columns. Canonical rows: one patient row per ``person`` row and one event row per ``condition_occurrence``
row; ``visit_occurrence`` and ``death`` are lookups, read for the patient shard and counted as ``filtered``
in full, so every table reconciles (``rows_read = canonical rows + filtered``).

Rules (docs/formats.md):

- birth: ``birth_datetime`` when it parses, else ``year_of_birth`` with ``month_of_birth`` / ``day_of_birth``,
  a missing month or day taken as the first (January, the 1st: never after the true birth, so no real event
  is quarantined as before birth; ages are overstated by up to a year); no year or an impossible date gives an
  unparseable birth and the person is quarantined;
- death: the person's earliest ``death`` row (``death_datetime`` when it parses, else ``death_date``), else
  the person's own ``death_datetime`` column where a CDM version has one;
- code naming: with a ``concept`` table, a condition concept is named ``vocabulary_id/concept_code``
  (``SNOMED/44054006``, as MEDS names codes), and a source value takes the vocabulary of its
  ``condition_source_concept_id``; otherwise codes take ``etl.omop.vocabulary`` (``code_source=auto``
  reads concept ids with a concept table and source values without one);
- codes: ``condition_concept_id`` or ``condition_source_value`` (``etl.omop.code_source``) as text; concept
  ids are integers, so ``372328.0`` (a float column, or float-printed text) is ``372328``; source values are
  float-printed only when every non-empty value of the file is (``65363002.0``): then ``.0`` is dropped,
  otherwise text is kept as is (the ICD-9 code ``250.0`` is not ``250``); a float-typed source value column
  prints integral values as integers and keeps other decimals (``250.01``);
- concept id 0 (no matching standard concept) is quarantined as ``no_matching_concept`` when
  ``etl.omop.skip_zero_concept`` and ``code_source=concept_id``;
- time: ``condition_start_datetime`` when it parses, else ``condition_start_date``;
- visits: conditions sharing a ``visit_occurrence_id`` form one visit; conditions without one group by date.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from behrt_rope import schema as S
from behrt_rope.etl import io
from behrt_rope.etl.config import EtlConfig
from behrt_rope.etl.raw import EVENT_COLUMNS, PATIENT_COLUMNS, RawTables, concat, events_frame, patients_frame
from behrt_rope.etl.split import shard_of

FLOAT_PRINTED = r"^([+-]?\d+)\.0+$"  # an integer printed as a float: 65363002.0
NO_CONCEPT = "0"
_CONCEPT = "__concept_id"  # the concept id that names a condition's code through the concept table


def read(input_dir: Path, config: EtlConfig, shard: int = 0, n_shards: int = 1) -> RawTables:
    """Read the rows of patient shard ``shard`` (of ``n_shards``) from a directory of OMOP CDM tables."""
    counts = _Counts()
    notes: dict[str, Any] = {}
    deaths = _deaths(input_dir, config, shard, n_shards, counts, notes)
    patients, integer_ids = _persons(input_dir, config, shard, n_shards, deaths, counts, notes)
    visits = _visits(input_dir, config, shard, n_shards, counts, notes)
    source = code_source(input_dir, config.omop.code_source)
    events = _conditions(input_dir, config, source, shard, n_shards, counts, notes)
    events, named = _name_codes(events, input_dir, config, source, notes)
    _visit_notes(events, visits, notes)
    person_ids = patients[S.PATIENT_ID].to_numpy(dtype=object)
    notes["omop.death_rows_without_person"] = int((~deaths.index.isin(person_ids)).sum())
    notes["omop.persons_with_death"] = int(deaths.index.isin(person_ids).sum())
    return RawTables(
        patients=patients,
        events=events,
        rows_read=dict(counts.rows),
        filtered=dict(counts.filtered),
        notes=notes,
        patient_id_type="int64" if integer_ids else "string",
        descriptions=named,
    )


def code_source(input_dir: Path, setting: str) -> str:
    """``concept_id`` or ``source_value``: the setting, or for ``auto`` concept_id when there is a concept table."""
    if setting != "auto":
        return setting
    return "concept_id" if find_table(input_dir, S.OMOP_CONCEPT, required=False) else "source_value"


def find_table(input_dir: Path, name: str, required: bool = True) -> list[Path]:
    """:func:`io.find_table`, also matching the table name in another case (``PERSON.csv``)."""
    found = io.find_table(input_dir, name, required=False)
    if found or not input_dir.is_dir():
        return found or (io.find_table(input_dir, name) if required else [])
    for entry in sorted(input_dir.iterdir()):
        lower = entry.name.lower()
        if lower == name or any(lower == name + suffix for suffix in io.TABLE_SUFFIXES):
            found = io.find_table(input_dir, entry.name[: len(name)], required=False)
            if found:
                return found
    return io.find_table(input_dir, name) if required else []


# ---------------------------------------------------------------------------------------------------------
class _Counts:
    """rows_read and filtered per source table name."""

    def __init__(self) -> None:
        self.rows: Counter[str] = Counter()
        self.filtered: Counter[str] = Counter()


def _batches(
    input_dir: Path, table: str, wanted: tuple[str, ...], required: tuple[str, ...], must_exist: bool = True
) -> Iterator[tuple[Path, str, pa.Table, int]]:
    """(file, its name for the manifest, batch with lower-case column names, index of the batch's first row).

    ``required`` may hold alternatives as ``a|b``: one of them must be present.
    """
    for path in find_table(input_dir, table, required=must_exist):
        present = io.column_names(path)
        by_lower: dict[str, str] = {}
        for column in present:
            by_lower.setdefault(column.lower(), column)
        for need in required:
            options = need.split("|")
            if not any(o in by_lower for o in options):
                io.require_columns(path, [options[0]], list(by_lower))
        columns = [by_lower[c] for c in wanted if c in by_lower]
        first_row = 0
        for batch in io.iter_batches(path, columns):
            batch = batch.rename_columns([c.lower() for c in batch.column_names])
            yield path, str(path.relative_to(input_dir)), batch, first_row
            first_row += batch.num_rows


def _check(path: Path, column: str, array: pa.ChunkedArray, kind: str) -> None:
    """Ids, concept ids and codes: text, integers or floats (float-printed integers are repaired); times."""
    if kind == "time":
        io.check_arrow_type(path, column, array, "time")
    elif not (pa.types.is_floating(array.type) or pa.types.is_decimal(array.type)):
        io.check_arrow_type(path, column, array, "id")


def integer_text(array: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """An integer-valued column (ids, concept ids) as text; ``34.0`` and ``34`` are both ``34``; nulls ''.

    >>> integer_text(pa.array([34.0, None, 1121000119107.0])).tolist(), integer_text(pa.array(["7.0", "x"])).tolist()
    (['34', '', '1121000119107'], ['7', 'x'])
    """
    t = array.type
    if pa.types.is_floating(t) or pa.types.is_decimal(t):
        return _float_text(array)
    text = io.to_text(array)
    if pa.types.is_integer(t) or not len(text):
        return text
    return io.to_text(pc.replace_substring_regex(pa.array(text, pa.string()), pattern=FLOAT_PRINTED, replacement=r"\1"))


def _float_text(array: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """Numbers as text: integral ones as integers (never ``1.1e+12``), others as Arrow prints them.

    Decimals go through their exact text (``34.00`` -> ``34``), so 18-digit ids keep every digit.
    """
    if pa.types.is_decimal(array.type):
        text = pc.cast(array, pa.string())
        return io.to_text(pc.replace_substring_regex(text, pattern=FLOAT_PRINTED, replacement=r"\1"))
    values = pc.cast(array, pa.float64())
    integral = pc.fill_null(pc.and_(pc.equal(pc.floor(values), values), pc.less(pc.abs(values), 9.0e18)), False)
    as_int = pc.cast(pc.if_else(integral, values, 0.0), pa.int64())
    text = pc.if_else(integral, pc.cast(as_int, pa.string()), pc.cast(values, pa.string()))
    return io.to_text(text)


def _numbers(array: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """Whole numbers as float64 (NaN for missing, non-numeric or non-integral values), and the raw text."""
    raw = io.to_text(array)
    if pa.types.is_integer(array.type) or pa.types.is_floating(array.type) or pa.types.is_decimal(array.type):
        values = np.asarray(pc.cast(array, pa.float64()).to_numpy(zero_copy_only=False), dtype=np.float64)
    else:
        values = pd.to_numeric(pd.Series(raw, dtype=object), errors="coerce").to_numpy(dtype=np.float64)
    values = np.where(np.floor(values) == values, values, np.nan)
    return values, raw


def _in_shard(ids: np.ndarray, shard: int, n_shards: int) -> np.ndarray:
    return shard_of(ids, n_shards) == shard


def _times(batch: pa.Table, path: Path, columns: tuple[str, ...], limit: float) -> tuple[np.ndarray, np.ndarray]:
    """Parsed time and raw text from the first of ``columns`` (datetime) that parses, else the second (date)."""
    time = np.full(batch.num_rows, np.datetime64("NaT"), dtype="datetime64[us]")
    raw = np.full(batch.num_rows, "", dtype=object)
    for column in columns:
        if column not in batch.column_names:
            continue
        _check(path, column, batch[column], "time")
        parsed = io.parse_times(batch[column])
        io.check_parse_rate(path, column, batch[column], parsed, limit)
        text = io.to_text(batch[column])
        fill = np.isnat(time) & ((text != "") | (raw == ""))
        time[fill], raw[fill] = parsed[fill], text[fill]
    return time, raw


# ---------------------------------------------------------------------------------------------------------
def _deaths(
    input_dir: Path, config: EtlConfig, shard: int, n_shards: int, counts: _Counts, notes: dict[str, Any]
) -> pd.DataFrame:
    """Per person id (index): the earliest death (``time``) and its raw text (``raw``) from the death table."""
    frames = []
    wanted = (S.OMOP_PERSON_ID, S.OMOP_DEATH_DATETIME, S.OMOP_DEATH_DATE)
    required = (S.OMOP_PERSON_ID, f"{S.OMOP_DEATH_DATE}|{S.OMOP_DEATH_DATETIME}")
    for path, name, batch, _ in _batches(input_dir, S.OMOP_DEATH, wanted, required, must_exist=False):
        _check(path, S.OMOP_PERSON_ID, batch[S.OMOP_PERSON_ID], "id")
        ids = integer_text(batch[S.OMOP_PERSON_ID])
        keep = _in_shard(ids, shard, n_shards)
        time, raw = _times(batch, path, (S.OMOP_DEATH_DATETIME, S.OMOP_DEATH_DATE), config.max_invalid_fraction)
        counts.rows[name] += int(keep.sum())
        counts.filtered[name] += int(keep.sum())  # a lookup: its facts land in the person rows
        frames.append(pd.DataFrame({"id": ids[keep], "time": time[keep], "raw": raw[keep]}))
    frame = (
        pd.concat(frames, ignore_index=True)
        if frames
        else pd.DataFrame(
            {"id": pd.Series(dtype=object), "time": pd.Series(dtype="datetime64[us]"), "raw": pd.Series(dtype=object)}
        )
    )
    notes["omop.death_rows"] = len(frame)
    frame = frame[frame["id"] != ""].sort_values(["id", "time"], na_position="last", kind="stable")
    notes["omop.persons_with_several_death_dates"] = int(
        (frame.assign(day=frame["time"].dt.floor("D")).groupby("id")["day"].nunique() > 1).sum()
    )
    return frame.drop_duplicates("id", keep="first").set_index("id")


def _persons(
    input_dir: Path,
    config: EtlConfig,
    shard: int,
    n_shards: int,
    deaths: pd.DataFrame,
    counts: _Counts,
    notes: dict[str, Any],
) -> tuple[pd.DataFrame, bool]:
    """One canonical patient row per person row; and whether person ids are integers."""
    wanted = (
        S.OMOP_PERSON_ID,
        S.OMOP_BIRTH_DATETIME,
        S.OMOP_YEAR_OF_BIRTH,
        S.OMOP_MONTH_OF_BIRTH,
        S.OMOP_DAY_OF_BIRTH,
        S.OMOP_DEATH_DATETIME,
    )
    required = (S.OMOP_PERSON_ID, f"{S.OMOP_YEAR_OF_BIRTH}|{S.OMOP_BIRTH_DATETIME}")
    frames, integer_ids = [], True
    from_parts = 0
    for path, name, batch, first_row in _batches(input_dir, S.OMOP_PERSON, wanted, required):
        _check(path, S.OMOP_PERSON_ID, batch[S.OMOP_PERSON_ID], "id")
        integer_ids &= pa.types.is_integer(batch[S.OMOP_PERSON_ID].type)
        ids = integer_text(batch[S.OMOP_PERSON_ID])
        keep = _in_shard(ids, shard, n_shards)
        birth, birth_raw = _times(batch, path, (S.OMOP_BIRTH_DATETIME,), config.max_invalid_fraction)
        use_parts = np.isnat(birth)
        if S.OMOP_YEAR_OF_BIRTH in batch.column_names and use_parts.any():
            parts_birth, parts_raw = _birth_from_parts(batch, path)
            birth[use_parts], birth_raw[use_parts] = parts_birth[use_parts], parts_raw[use_parts]
            from_parts += int((use_parts & keep & ~np.isnat(parts_birth)).sum())
        death = deaths["time"].reindex(ids).to_numpy(dtype="datetime64[us]")
        death_raw = deaths["raw"].reindex(ids).fillna("").to_numpy(dtype=object)
        if S.OMOP_DEATH_DATETIME in batch.column_names:  # CDM versions with death on the person row
            own, own_raw = _times(batch, path, (S.OMOP_DEATH_DATETIME,), config.max_invalid_fraction)
            fill = death_raw == ""
            death[fill], death_raw[fill] = own[fill], own_raw[fill]
        counts.rows[name] += int(keep.sum())
        rows = first_row + np.arange(batch.num_rows)
        frames.append(
            patients_frame(ids[keep], birth[keep], birth_raw[keep], death[keep], death_raw[keep], name, rows[keep])
        )
    patients = concat(frames, PATIENT_COLUMNS)
    notes["omop.person_rows"] = len(patients)
    notes["omop.births_from_year_month_day"] = from_parts
    notes["omop.births_unparseable"] = int(patients[S.BIRTH_DATE].isna().sum())
    return patients, integer_ids


def _birth_from_parts(batch: pa.Table, path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Birth from year/month/day of birth (missing month or day: the 1st); the raw parts as text."""
    parts, raws = {}, {}
    for column in (S.OMOP_YEAR_OF_BIRTH, S.OMOP_MONTH_OF_BIRTH, S.OMOP_DAY_OF_BIRTH):
        if column in batch.column_names:
            _check(path, column, batch[column], "id")
            parts[column], raws[column] = _numbers(batch[column])
        else:
            parts[column] = np.full(batch.num_rows, np.nan)
            raws[column] = np.full(batch.num_rows, "", dtype=object)
    year = parts[S.OMOP_YEAR_OF_BIRTH]
    year = np.where((year >= 1) & (year <= 9999), year, np.nan)
    dates = pd.to_datetime(
        pd.DataFrame(
            {
                "year": year,
                "month": np.nan_to_num(parts[S.OMOP_MONTH_OF_BIRTH], nan=1.0),
                "day": np.nan_to_num(parts[S.OMOP_DAY_OF_BIRTH], nan=1.0),
            }
        ),
        errors="coerce",
    ).to_numpy(dtype="datetime64[us]")
    raw = pd.Series(raws[S.OMOP_YEAR_OF_BIRTH], dtype=object).radd(f"{S.OMOP_YEAR_OF_BIRTH}=")
    for column in (S.OMOP_MONTH_OF_BIRTH, S.OMOP_DAY_OF_BIRTH):
        raw = raw + f" {column}=" + pd.Series(raws[column], dtype=object)
    return dates, raw.to_numpy(dtype=object)


def _visits(
    input_dir: Path, config: EtlConfig, shard: int, n_shards: int, counts: _Counts, notes: dict[str, Any]
) -> pd.DataFrame | None:
    """Per visit id (index): person, first and last day; None without a visit_occurrence table."""
    wanted = (
        S.OMOP_VISIT_OCCURRENCE_ID,
        S.OMOP_PERSON_ID,
        S.OMOP_VISIT_START_DATETIME,
        S.OMOP_VISIT_START_DATE,
        S.OMOP_VISIT_END_DATETIME,
        S.OMOP_VISIT_END_DATE,
    )
    required = (
        S.OMOP_VISIT_OCCURRENCE_ID,
        S.OMOP_PERSON_ID,
        f"{S.OMOP_VISIT_START_DATE}|{S.OMOP_VISIT_START_DATETIME}",
    )
    frames = []
    seen = False
    for path, name, batch, _ in _batches(input_dir, S.OMOP_VISIT, wanted, required, must_exist=False):
        seen = True
        for column in (S.OMOP_VISIT_OCCURRENCE_ID, S.OMOP_PERSON_ID):
            _check(path, column, batch[column], "id")
        ids = integer_text(batch[S.OMOP_PERSON_ID])
        keep = _in_shard(ids, shard, n_shards)
        limit = config.max_invalid_fraction
        start, _ = _times(batch, path, (S.OMOP_VISIT_START_DATETIME, S.OMOP_VISIT_START_DATE), limit)
        end, _ = _times(batch, path, (S.OMOP_VISIT_END_DATETIME, S.OMOP_VISIT_END_DATE), limit)
        counts.rows[name] += int(keep.sum())
        counts.filtered[name] += int(keep.sum())  # a lookup: conditions carry the visit id themselves
        frames.append(
            pd.DataFrame(
                {
                    "visit": integer_text(batch[S.OMOP_VISIT_OCCURRENCE_ID])[keep],
                    "person": ids[keep],
                    "start": start[keep].astype("datetime64[D]").astype("datetime64[us]"),
                    "end": np.where(np.isnat(end), start, end)[keep].astype("datetime64[D]").astype("datetime64[us]"),
                }
            )
        )
    if not seen:
        notes["omop.visit_occurrence"] = "absent: visits come from condition visit ids only"
        return None
    frame = pd.concat(frames, ignore_index=True)
    notes["omop.visit_rows"] = len(frame)
    return frame.drop_duplicates("visit", keep="first").set_index("visit")


def _conditions(
    input_dir: Path,
    config: EtlConfig,
    source: str,
    shard: int,
    n_shards: int,
    counts: _Counts,
    notes: dict[str, Any],
) -> pd.DataFrame:
    """One canonical event row per condition_occurrence row, with the concept id that names it (_CONCEPT)."""
    omop = config.omop
    code_column = S.OMOP_CONDITION_CONCEPT_ID if source == "concept_id" else S.OMOP_CONDITION_SOURCE_VALUE
    concept_column = S.OMOP_CONDITION_CONCEPT_ID if source == "concept_id" else S.OMOP_CONDITION_SOURCE_CONCEPT_ID
    wanted = (
        S.OMOP_PERSON_ID,
        code_column,
        S.OMOP_CONDITION_START_DATETIME,
        S.OMOP_CONDITION_START_DATE,
        S.OMOP_VISIT_OCCURRENCE_ID,
        S.OMOP_CONDITION_SOURCE_CONCEPT_ID,
    )
    required = (S.OMOP_PERSON_ID, code_column, f"{S.OMOP_CONDITION_START_DATE}|{S.OMOP_CONDITION_START_DATETIME}")
    frames = []
    stats: Counter[str] = Counter()
    float_printed: dict[Path, bool] = {}
    for path, name, batch, first_row in _batches(input_dir, S.OMOP_CONDITION, wanted, required):
        for column in (S.OMOP_PERSON_ID, code_column, S.OMOP_VISIT_OCCURRENCE_ID, concept_column):
            if column in batch.column_names:
                _check(path, column, batch[column], "id")
        ids = integer_text(batch[S.OMOP_PERSON_ID])
        keep = _in_shard(ids, shard, n_shards)
        time, time_raw = _times(
            batch, path, (S.OMOP_CONDITION_START_DATETIME, S.OMOP_CONDITION_START_DATE), config.max_invalid_fraction
        )
        if path not in float_printed:
            float_printed[path] = code_column == S.OMOP_CONDITION_SOURCE_VALUE and _float_printed_file(path)
        code = _codes(batch[code_column], code_column, float_printed[path], keep, stats)
        visit = (
            integer_text(batch[S.OMOP_VISIT_OCCURRENCE_ID])
            if S.OMOP_VISIT_OCCURRENCE_ID in batch.column_names
            else None
        )
        zero = (code == NO_CONCEPT) & (code_column == S.OMOP_CONDITION_CONCEPT_ID) & omop.skip_zero_concept
        stats["zero"] += int((zero & keep).sum())
        counts.rows[name] += int(keep.sum())
        frame = events_frame(
            ids[keep],
            time[keep],
            time_raw[keep],
            code[keep],
            np.full(int(keep.sum()), omop.vocabulary, dtype=object),
            None if visit is None else visit[keep],
            name,
            (first_row + np.arange(batch.num_rows))[keep],
        )
        frame[S.REASON] = np.where(zero[keep], S.Reason.NO_MATCHING_CONCEPT, "").astype(object)
        concept = (
            integer_text(batch[concept_column])[keep]
            if concept_column in batch.column_names
            else np.full(int(keep.sum()), "", dtype=object)
        )
        frame[_CONCEPT] = np.where(concept == NO_CONCEPT, "", concept).astype(object)
        frames.append(frame)
    events = concat(frames, (*EVENT_COLUMNS, S.REASON, _CONCEPT))
    notes["omop.condition_rows"] = len(events)
    notes["omop.code_source"] = code_column
    notes["omop.zero_concept_rows_quarantined"] = stats["zero"]
    notes["omop.codes_float_printed_repaired"] = stats["float_printed"]
    notes["omop.codes_non_integral_float"] = stats["non_integral"]
    return events


def _name_codes(
    events: pd.DataFrame, input_dir: Path, config: EtlConfig, source: str, notes: dict[str, Any]
) -> tuple[pd.DataFrame, pd.DataFrame | None]:
    """Name codes ``vocabulary_id/concept_code`` through the concept table, where there is one.

    concept_id: every condition concept is looked up; one the table lacks is quarantined
    (``concept_not_in_concept_table``). source_value: the source value keeps its text and takes the
    vocabulary of its ``condition_source_concept_id`` when the table knows it, else ``etl.omop.vocabulary``.
    Returns the events (without the helper column) and (CODE, CODE_SYSTEM, DESCRIPTION) of the named codes.
    """
    concept_ids = events.pop(_CONCEPT).to_numpy(dtype=object)
    tables = find_table(input_dir, S.OMOP_CONCEPT, required=False)
    if not tables:
        notes["omop.code_naming"] = f"{source} with vocabulary {config.omop.vocabulary!r} (no concept table)"
        return events, None
    concepts = _concepts(input_dir, np.unique(concept_ids[concept_ids != ""]))
    where = pd.Index(concepts.index).get_indexer(concept_ids)
    found = where >= 0
    vocabulary = events[S.CODE_SYSTEM].to_numpy(dtype=object).copy()
    vocabulary[found] = concepts[S.OMOP_VOCABULARY_ID].to_numpy(dtype=object)[where[found]]
    events[S.CODE_SYSTEM] = vocabulary
    if source == "concept_id":
        code = events[S.CODE].to_numpy(dtype=object).copy()
        code[found] = concepts[S.OMOP_CONCEPT_CODE].to_numpy(dtype=object)[where[found]]
        events[S.CODE] = code
        reason = events[S.REASON].to_numpy(dtype=object)
        unknown = ~found & (reason == "") & (concept_ids != "")
        events[S.REASON] = np.where(unknown, S.Reason.UNKNOWN_CONCEPT, reason).astype(object)
        notes["omop.concepts_not_in_concept_table"] = int(unknown.sum())
    notes["omop.code_naming"] = f"{source} named through {tables[0].relative_to(input_dir)}"
    notes["omop.conditions_named_by_concept"] = int(found.sum())
    named = pd.DataFrame(
        {
            S.CODE: events[S.CODE].to_numpy(dtype=object)[found],
            S.CODE_SYSTEM: vocabulary[found],
            S.DESCRIPTION: concepts[S.OMOP_CONCEPT_NAME].to_numpy(dtype=object)[where[found]],
        }
    ).drop_duplicates()
    return events, named


def _concepts(input_dir: Path, wanted: np.ndarray) -> pd.DataFrame:
    """vocabulary_id, concept_code, concept_name of the ``wanted`` concept ids (text), indexed by id.

    The concept table (all of OMOP's vocabularies can be millions of rows) is streamed and only the wanted
    rows are kept. It is reference data, not patient data, so it is not counted in the manifest's tables.
    """
    columns = (S.OMOP_CONCEPT_ID, S.OMOP_VOCABULARY_ID, S.OMOP_CONCEPT_CODE, S.OMOP_CONCEPT_NAME)
    frames = []
    want = pd.Index(wanted)
    for path, _, batch, _ in _batches(input_dir, S.OMOP_CONCEPT, columns, columns[:3]):
        _check(path, S.OMOP_CONCEPT_ID, batch[S.OMOP_CONCEPT_ID], "id")
        ids = integer_text(batch[S.OMOP_CONCEPT_ID])
        keep = want.get_indexer(ids) >= 0
        frame = {c: io.to_text(batch[c])[keep] for c in columns[1:] if c in batch.column_names}
        frame.setdefault(S.OMOP_CONCEPT_NAME, np.full(int(keep.sum()), "", dtype=object))
        frames.append(pd.DataFrame({S.OMOP_CONCEPT_ID: ids[keep], **frame}))
    if not frames:
        return pd.DataFrame(columns=list(columns[1:]), index=pd.Index([], dtype=object))
    table = pd.concat(frames, ignore_index=True).drop_duplicates(S.OMOP_CONCEPT_ID)
    return table.set_index(S.OMOP_CONCEPT_ID)


def _codes(
    array: pa.ChunkedArray, column: str, float_printed: bool, keep: np.ndarray, stats: Counter[str]
) -> np.ndarray:
    """Condition codes as text, repairing float-printed integers where the rule says so (module docstring)."""
    t = array.type
    if pa.types.is_floating(t) or pa.types.is_decimal(t):
        text = _float_text(array)
        values = np.asarray(pc.cast(array, pa.float64()).to_numpy(zero_copy_only=False), dtype=np.float64)
        integral = np.floor(values) == values
        stats["float_printed"] += int((keep & integral).sum())
        stats["non_integral"] += int((keep & ~np.isnan(values) & ~integral).sum())
        return text
    if pa.types.is_integer(t):
        return io.to_text(array)
    text = io.to_text(array)
    if column == S.OMOP_CONDITION_CONCEPT_ID or float_printed:
        repaired = integer_text(array)
        stats["float_printed"] += int(((repaired != text) & keep).sum())
        return repaired
    return text


def _float_printed_file(path: Path) -> bool:
    """Whether every non-empty condition_source_value of the file is an integer printed as a float."""
    seen = False
    for batch in _batches_of(path, S.OMOP_CONDITION_SOURCE_VALUE):
        if not (pa.types.is_string(batch.type) or pa.types.is_large_string(batch.type)):
            return False
        text = pc.utf8_trim_whitespace(batch)
        present = pc.fill_null(pc.greater(pc.utf8_length(text), 0), False)
        matching = pc.fill_null(pc.match_substring_regex(text, FLOAT_PRINTED), False)
        if pc.any(pc.and_(present, pc.invert(matching))).as_py():
            return False
        seen = seen or bool(pc.any(present).as_py())
    return seen


def _batches_of(path: Path, column: str) -> Iterator[pa.ChunkedArray]:
    actual = next(c for c in io.column_names(path) if c.lower() == column)
    for batch in io.iter_batches(path, [actual]):
        yield batch[actual]


def _visit_notes(events: pd.DataFrame, visits: pd.DataFrame | None, notes: dict[str, Any]) -> None:
    """How conditions relate to their visits: none, unknown, or dated outside the visit's first..last day."""
    visit = events[S.VISIT_ID].to_numpy(dtype=object)
    has = visit != ""
    notes["omop.conditions_without_visit"] = int((~has).sum())
    if visits is None:
        return
    where = pd.Index(visits.index).get_indexer(visit)
    known = has & (where >= 0)
    notes["omop.conditions_with_unknown_visit"] = int((has & ~known).sum())
    day = events[S.TIME].to_numpy(dtype="datetime64[us]").astype("datetime64[D]")
    start = visits["start"].to_numpy(dtype="datetime64[us]").astype("datetime64[D]")[where[known]]
    end = visits["end"].to_numpy(dtype="datetime64[us]").astype("datetime64[D]")[where[known]]
    person = visits["person"].to_numpy(dtype=object)[where[known]]
    notes["omop.conditions_before_visit_start"] = int((day[known] < start).sum())
    notes["omop.conditions_after_visit_end"] = int((day[known] > end).sum())
    notes["omop.conditions_visit_of_other_person"] = int(
        (person != events[S.PATIENT_ID].to_numpy(dtype=object)[known]).sum()
    )


__all__ = ["find_table", "integer_text", "read"]
