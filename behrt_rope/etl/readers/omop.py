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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from behrt_rope import schema as S
from behrt_rope.errors import InputSchemaError
from behrt_rope.etl import io
from behrt_rope.etl.config import EtlConfig
from behrt_rope.etl.raw import EVENT_COLUMNS, PATIENT_COLUMNS, RawTables, concat, events_frame, patients_frame
from behrt_rope.etl.readers import source
from behrt_rope.etl.readers.source import Chunk, Plan, ShardInput, TablePlan
from behrt_rope.etl.sex import UNKNOWN, normalise_sex

FLOAT_PRINTED = r"^([+-]?\d+)\.0+$"  # an integer printed as a float: 65363002.0
NO_CONCEPT = "0"
_CONCEPT = "__concept_id"  # the concept id that names a condition's code through the concept table


def read(input_dir: Path, config: EtlConfig, shard: int = 0, n_shards: int = 1) -> RawTables:
    """Read the rows of patient shard ``shard`` (of ``n_shards``) from a directory of OMOP CDM tables."""
    plan_ = plan(input_dir, config)
    data = source.gather(plan_, id_text, facts(plan_, config), shard, n_shards, lookups(plan_, config))
    return build(data, config)


def plan(input_dir: Path, config: EtlConfig) -> Plan:
    """The death, person, visit_occurrence and condition_occurrence files and their columns, checked on their
    schemas; the concept table's columns too. ``choices['code_column']``: the column codes come from."""
    code_column = (
        S.OMOP_CONDITION_CONCEPT_ID
        if code_source(input_dir, config.omop.code_source) == "concept_id"
        else S.OMOP_CONDITION_SOURCE_VALUE
    )
    tables = {}
    for name, (wanted, required, kinds) in _tables(code_column).items():
        files = find_table(input_dir, name, required=name in (S.OMOP_PERSON, S.OMOP_CONDITION))
        try:
            tables[name] = source.plan_table(input_dir, name, files, wanted, required, S.OMOP_PERSON_ID, True)
        except InputSchemaError as err:
            raise _with_code_source_hint(err, code_column, config.omop.code_source) from err
        source.check_types(tables[name], kinds, _check)
    facts = {"all:integer_ids": source.integer_ids(tables[S.OMOP_PERSON])}
    return Plan(input_dir, {k: v for k, v in tables.items() if v.files}, facts, {"code_column": code_column})


_TIME_COLUMNS = (
    S.OMOP_DEATH_DATETIME,
    S.OMOP_DEATH_DATE,
    S.OMOP_BIRTH_DATETIME,
    S.OMOP_VISIT_START_DATETIME,
    S.OMOP_VISIT_START_DATE,
    S.OMOP_VISIT_END_DATETIME,
    S.OMOP_VISIT_END_DATE,
    S.OMOP_CONDITION_START_DATETIME,
    S.OMOP_CONDITION_START_DATE,
)
_ID_COLUMNS = (
    S.OMOP_PERSON_ID,
    S.OMOP_VISIT_OCCURRENCE_ID,
    S.OMOP_YEAR_OF_BIRTH,
    S.OMOP_MONTH_OF_BIRTH,
    S.OMOP_DAY_OF_BIRTH,
)


def _tables(code_column: str) -> dict[str, tuple[tuple[str, ...], tuple[str, ...], dict[str, str]]]:
    """Per patient table, in reading order: (columns wanted, columns required (``a|b``: one of), kinds)."""
    concept_column = (
        S.OMOP_CONDITION_CONCEPT_ID
        if code_column == S.OMOP_CONDITION_CONCEPT_ID
        else S.OMOP_CONDITION_SOURCE_CONCEPT_ID
    )
    kinds = dict.fromkeys(_TIME_COLUMNS, "time") | dict.fromkeys((*_ID_COLUMNS, code_column, concept_column), "id")
    kinds |= {S.OMOP_GENDER_CONCEPT_ID: "id", S.OMOP_GENDER_SOURCE_VALUE: "code"}
    death = (S.OMOP_PERSON_ID, S.OMOP_DEATH_DATETIME, S.OMOP_DEATH_DATE)
    person = (
        S.OMOP_PERSON_ID,
        S.OMOP_BIRTH_DATETIME,
        S.OMOP_YEAR_OF_BIRTH,
        S.OMOP_MONTH_OF_BIRTH,
        S.OMOP_DAY_OF_BIRTH,
        S.OMOP_DEATH_DATETIME,
        S.OMOP_GENDER_CONCEPT_ID,
        S.OMOP_GENDER_SOURCE_VALUE,
    )
    visit = (
        S.OMOP_VISIT_OCCURRENCE_ID,
        S.OMOP_PERSON_ID,
        S.OMOP_VISIT_START_DATETIME,
        S.OMOP_VISIT_START_DATE,
        S.OMOP_VISIT_END_DATETIME,
        S.OMOP_VISIT_END_DATE,
    )
    condition = (
        S.OMOP_PERSON_ID,
        code_column,
        S.OMOP_CONDITION_START_DATETIME,
        S.OMOP_CONDITION_START_DATE,
        S.OMOP_VISIT_OCCURRENCE_ID,
        S.OMOP_CONDITION_SOURCE_CONCEPT_ID,
    )
    visit_start = f"{S.OMOP_VISIT_START_DATE}|{S.OMOP_VISIT_START_DATETIME}"
    condition_start = f"{S.OMOP_CONDITION_START_DATE}|{S.OMOP_CONDITION_START_DATETIME}"
    tables = {
        S.OMOP_DEATH: (death, (S.OMOP_PERSON_ID, f"{S.OMOP_DEATH_DATE}|{S.OMOP_DEATH_DATETIME}")),
        S.OMOP_PERSON: (person, (S.OMOP_PERSON_ID, f"{S.OMOP_YEAR_OF_BIRTH}|{S.OMOP_BIRTH_DATETIME}")),
        S.OMOP_VISIT: (visit, (S.OMOP_VISIT_OCCURRENCE_ID, S.OMOP_PERSON_ID, visit_start)),
        S.OMOP_CONDITION: (condition, (S.OMOP_PERSON_ID, code_column, condition_start)),
    }
    return {
        name: (wanted, required, {c: kinds[c] for c in wanted if c in kinds})
        for name, (wanted, required) in tables.items()
    }


def id_text(array: pa.Array) -> np.ndarray:
    """Person ids as text (``34.0`` and ``34`` are both ``34``)."""
    return integer_text(array)


def facts(plan: Plan, config: EtlConfig) -> source.BatchFacts:
    """Per condition batch when codes are source values: whether each non-empty value is a float-printed
    integer (``all:float_printed.FILE``) and whether there is one (``present.FILE``)."""
    wanted = plan.choices.get("code_column") == S.OMOP_CONDITION_SOURCE_VALUE

    def float_printed(table: source.TablePlan, name: str, batch: pa.Table) -> dict[str, bool]:
        if not wanted or table.name != S.OMOP_CONDITION:
            return {}
        values = batch[S.OMOP_CONDITION_SOURCE_VALUE]
        if not (pa.types.is_string(values.type) or pa.types.is_large_string(values.type)):
            return {f"all:float_printed.{name}": False}
        text = pc.utf8_trim_whitespace(values)
        present = pc.fill_null(pc.greater(pc.utf8_length(text), 0), False)
        matching = pc.fill_null(pc.match_substring_regex(text, FLOAT_PRINTED), False)
        ok = not pc.any(pc.and_(present, pc.invert(matching))).as_py()
        return {f"all:float_printed.{name}": ok, f"present.{name}": bool(pc.any(present).as_py())}

    return float_printed


def build(data: ShardInput, config: EtlConfig) -> RawTables:
    """Canonical patients and conditions of one shard's rows (module docstring for the rules)."""
    counts = _Counts()
    for table in (S.OMOP_DEATH, S.OMOP_PERSON, S.OMOP_VISIT, S.OMOP_CONDITION):
        for name in data.names(table):
            counts.rows[name] += 0
            if table in (S.OMOP_DEATH, S.OMOP_VISIT):
                counts.filtered[name] += 0
    notes: dict[str, Any] = {}
    deaths = _deaths(data, config, counts, notes)
    patients = _persons(data, config, deaths, counts, notes)
    visits = _visits(data, config, counts, notes)
    code_column = data.plan.choices["code_column"]
    events = _conditions(data, config, code_column, counts, notes)
    source_name = "concept_id" if code_column == S.OMOP_CONDITION_CONCEPT_ID else "source_value"
    events, named = _name_codes(events, data.lookups, config, source_name, notes)
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
        patient_id_type="int64" if data.facts.get("all:integer_ids") else "string",
        descriptions=named,
    )


def _with_code_source_hint(err: InputSchemaError, code_column: str, setting: str) -> InputSchemaError:
    """A missing source value column that ``code_source=auto`` chose (no concept table): say how to read
    concept ids instead; any other error as it is."""
    missing = f"missing required column '{S.OMOP_CONDITION_SOURCE_VALUE}'"
    if setting != "auto" or code_column != S.OMOP_CONDITION_SOURCE_VALUE or missing not in str(err):
        return err
    return InputSchemaError(
        f"{err}; etl.omop.code_source=auto reads {code_column} when there is no concept table: "
        f"set etl.omop.code_source=concept_id to read {S.OMOP_CONDITION_CONCEPT_ID}"
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


def _times(
    batch: pa.Table, path: Path, columns: tuple[str, ...], limit: float, rows: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Parsed time and raw text from the first of ``columns`` (datetime) that parses, else the second (date).

    ``rows``: each row's number in its file, shape (rows,), for the example of a column that does not parse.
    """
    time = np.full(batch.num_rows, np.datetime64("NaT"), dtype="datetime64[us]")
    raw = np.full(batch.num_rows, "", dtype=object)
    for column in columns:
        if column not in batch.column_names:
            continue
        parsed = io.parse_times(batch[column])
        io.check_parse_rate(path, column, batch[column], parsed, limit, rows)
        text = io.to_text(batch[column])
        fill = np.isnat(time) & ((text != "") | (raw == ""))
        time[fill], raw[fill] = parsed[fill], text[fill]
    return time, raw


# ---------------------------------------------------------------------------------------------------------
def _deaths(data: ShardInput, config: EtlConfig, counts: _Counts, notes: dict[str, Any]) -> pd.DataFrame:
    """Per person id (index): the earliest death (``time``) and its raw text (``raw``) from the death table."""
    frames = [_empty_deaths()]
    for chunk in data.of(S.OMOP_DEATH):
        batch = chunk.table
        limit = config.max_invalid_fraction
        time, raw = _times(batch, chunk.path, (S.OMOP_DEATH_DATETIME, S.OMOP_DEATH_DATE), limit, chunk.rows)
        counts.rows[chunk.name] += batch.num_rows
        counts.filtered[chunk.name] += batch.num_rows  # a lookup: its facts land in the person rows
        frames.append(pd.DataFrame({"id": integer_text(batch[S.OMOP_PERSON_ID]), "time": time, "raw": raw}))
    frame = pd.concat(frames, ignore_index=True)
    notes["omop.death_rows"] = len(frame)
    frame = frame[frame["id"] != ""].sort_values(["id", "time"], na_position="last", kind="stable")
    notes["omop.persons_with_several_death_dates"] = int(
        (frame.assign(day=frame["time"].dt.floor("D")).groupby("id")["day"].nunique() > 1).sum()
    )
    return frame.drop_duplicates("id", keep="first").set_index("id")


def _empty_deaths() -> pd.DataFrame:
    return pd.DataFrame(
        {"id": pd.Series(dtype=object), "time": pd.Series(dtype="datetime64[us]"), "raw": pd.Series(dtype=object)}
    )


def _persons(
    data: ShardInput, config: EtlConfig, deaths: pd.DataFrame, counts: _Counts, notes: dict[str, Any]
) -> pd.DataFrame:
    """One canonical patient row per person row."""
    frames = []
    from_parts = 0
    limit = config.max_invalid_fraction
    for chunk in data.of(S.OMOP_PERSON):
        batch, path, rows = chunk.table, chunk.path, chunk.rows
        ids = integer_text(batch[S.OMOP_PERSON_ID])
        birth, birth_raw = _times(batch, path, (S.OMOP_BIRTH_DATETIME,), limit, rows)
        use_parts = np.isnat(birth)
        if S.OMOP_YEAR_OF_BIRTH in batch.column_names and use_parts.any():
            parts_birth, parts_raw = _birth_from_parts(batch)
            birth[use_parts], birth_raw[use_parts] = parts_birth[use_parts], parts_raw[use_parts]
            from_parts += int((use_parts & ~np.isnat(parts_birth)).sum())
        death = deaths["time"].reindex(ids).to_numpy(dtype="datetime64[us]")
        death_raw = deaths["raw"].reindex(ids).fillna("").to_numpy(dtype=object)
        if S.OMOP_DEATH_DATETIME in batch.column_names:  # CDM versions with death on the person row
            own, own_raw = _times(batch, path, (S.OMOP_DEATH_DATETIME,), limit, rows)
            fill = death_raw == ""
            death[fill], death_raw[fill] = own[fill], own_raw[fill]
        counts.rows[chunk.name] += batch.num_rows
        sex = _gender(batch)
        frames.append(patients_frame(ids, birth, birth_raw, death, death_raw, chunk.name, rows, sex_raw=sex))
    patients = concat(frames, PATIENT_COLUMNS)
    notes["omop.person_rows"] = len(patients)
    notes["omop.births_from_year_month_day"] = from_parts
    notes["omop.births_unparseable"] = int(patients[S.BIRTH_DATE].isna().sum())
    return patients


def _gender(batch: pa.Table) -> np.ndarray | None:
    """Per person row, the raw sex: ``gender_concept_id`` where it names female, male or other, else
    ``gender_source_value`` (sites that leave the concept 0 or unknown); None without either column."""
    columns = [c for c in (S.OMOP_GENDER_CONCEPT_ID, S.OMOP_GENDER_SOURCE_VALUE) if c in batch.column_names]
    if not columns:
        return None
    raw = integer_text(batch[columns[0]]) if columns[0] == S.OMOP_GENDER_CONCEPT_ID else io.to_text(batch[columns[0]])
    if columns == [S.OMOP_GENDER_CONCEPT_ID, S.OMOP_GENDER_SOURCE_VALUE]:
        fallback = io.to_text(batch[S.OMOP_GENDER_SOURCE_VALUE])
        raw = np.where(normalise_sex(raw) == UNKNOWN, fallback, raw).astype(object)
    return np.asarray(raw, dtype=object)


def _birth_from_parts(batch: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """Birth from year/month/day of birth (missing month or day: the 1st); the raw parts as text."""
    parts, raws = {}, {}
    for column in (S.OMOP_YEAR_OF_BIRTH, S.OMOP_MONTH_OF_BIRTH, S.OMOP_DAY_OF_BIRTH):
        if column in batch.column_names:
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


def _visits(data: ShardInput, config: EtlConfig, counts: _Counts, notes: dict[str, Any]) -> pd.DataFrame | None:
    """Per visit id (index): person, first and last day; None without a visit_occurrence table."""
    if S.OMOP_VISIT not in data.plan.tables:
        notes["omop.visit_occurrence"] = "absent: visits come from condition visit ids only"
        return None
    frames = [pd.DataFrame({"visit": [], "person": [], "start": [], "end": []}).astype(_VISIT_TYPES)]
    limit = config.max_invalid_fraction
    for chunk in data.of(S.OMOP_VISIT):
        batch, path, rows = chunk.table, chunk.path, chunk.rows
        start, _ = _times(batch, path, (S.OMOP_VISIT_START_DATETIME, S.OMOP_VISIT_START_DATE), limit, rows)
        end, _ = _times(batch, path, (S.OMOP_VISIT_END_DATETIME, S.OMOP_VISIT_END_DATE), limit, rows)
        counts.rows[chunk.name] += batch.num_rows
        counts.filtered[chunk.name] += batch.num_rows  # a lookup: conditions carry the visit id themselves
        frames.append(
            pd.DataFrame(
                {
                    "visit": integer_text(batch[S.OMOP_VISIT_OCCURRENCE_ID]),
                    "person": integer_text(batch[S.OMOP_PERSON_ID]),
                    "start": start.astype("datetime64[D]").astype("datetime64[us]"),
                    "end": np.where(np.isnat(end), start, end).astype("datetime64[D]").astype("datetime64[us]"),
                }
            ).astype(_VISIT_TYPES)
        )
    frame = pd.concat(frames, ignore_index=True)
    notes["omop.visit_rows"] = len(frame)
    return frame.drop_duplicates("visit", keep="first").set_index("visit")


_VISIT_TYPES: dict[str, Any] = {"visit": object, "person": object, "start": "datetime64[us]", "end": "datetime64[us]"}


def _conditions(
    data: ShardInput, config: EtlConfig, code_column: str, counts: _Counts, notes: dict[str, Any]
) -> pd.DataFrame:
    """One canonical event row per condition_occurrence row, with the concept id that names it (_CONCEPT)."""
    frames = []
    stats: Counter[str] = Counter()
    for chunk in data.of(S.OMOP_CONDITION):
        fact = f"all:float_printed.{chunk.name}"
        float_printed = bool(data.facts.get(fact)) and bool(data.facts.get(f"present.{chunk.name}"))
        frames.append(_condition_frame(chunk, config, code_column, float_printed, stats))
        counts.rows[chunk.name] += chunk.table.num_rows
    events = concat(frames, (*EVENT_COLUMNS, S.REASON, _CONCEPT))
    notes["omop.condition_rows"] = len(events)
    notes["omop.code_source"] = code_column
    notes["omop.zero_concept_rows_quarantined"] = stats["zero"]
    notes["omop.codes_float_printed_repaired"] = stats["float_printed"]
    notes["omop.codes_non_integral_float"] = stats["non_integral"]
    return events


def _condition_frame(
    chunk: Chunk, config: EtlConfig, code_column: str, float_printed: bool, stats: Counter[str]
) -> pd.DataFrame:
    """Canonical event rows of one chunk of conditions, with REASON (zero concept) and _CONCEPT."""
    omop, batch = config.omop, chunk.table
    concept_column = (
        S.OMOP_CONDITION_CONCEPT_ID
        if code_column == S.OMOP_CONDITION_CONCEPT_ID
        else (S.OMOP_CONDITION_SOURCE_CONCEPT_ID)
    )
    time, time_raw = _times(
        batch,
        chunk.path,
        (S.OMOP_CONDITION_START_DATETIME, S.OMOP_CONDITION_START_DATE),
        config.max_invalid_fraction,
        chunk.rows,
    )
    code = _codes(batch[code_column], code_column, float_printed, stats)
    has_visit = S.OMOP_VISIT_OCCURRENCE_ID in batch.column_names
    zero = (code == NO_CONCEPT) & (code_column == S.OMOP_CONDITION_CONCEPT_ID) & omop.skip_zero_concept
    stats["zero"] += int(zero.sum())
    frame = events_frame(
        integer_text(batch[S.OMOP_PERSON_ID]),
        time,
        time_raw,
        code,
        np.full(batch.num_rows, omop.vocabulary, dtype=object),
        integer_text(batch[S.OMOP_VISIT_OCCURRENCE_ID]) if has_visit else None,
        chunk.name,
        chunk.rows,
    )
    frame[S.REASON] = np.where(zero, S.Reason.NO_MATCHING_CONCEPT, "").astype(object)
    concept = (
        integer_text(batch[concept_column])
        if concept_column in batch.column_names
        else np.full(batch.num_rows, "", dtype=object)
    )
    frame[_CONCEPT] = np.where(concept == NO_CONCEPT, "", concept).astype(object)
    return frame


def _name_codes(
    events: pd.DataFrame, concepts: Concepts, config: EtlConfig, source: str, notes: dict[str, Any]
) -> tuple[pd.DataFrame, pd.DataFrame | None]:
    """Name codes ``vocabulary_id/concept_code`` through the concept table, where there is one.

    concept_id: every condition concept is looked up; one the table lacks is quarantined
    (``concept_not_in_concept_table``). source_value: the source value keeps its text and takes the
    vocabulary of its ``condition_source_concept_id`` when the table knows it, else ``etl.omop.vocabulary``.
    Returns the events (without the helper column) and (CODE, CODE_SYSTEM, DESCRIPTION) of the named codes.
    """
    concept_ids = events.pop(_CONCEPT).to_numpy(dtype=object)
    if concepts.table is None:
        notes["omop.code_naming"] = f"{source} with vocabulary {config.omop.vocabulary!r} (no concept table)"
        return events, None
    found_concepts = concepts.find(np.unique(concept_ids[concept_ids != ""]))
    where = pd.Index(found_concepts.index).get_indexer(concept_ids)
    found = where >= 0
    vocabulary = events[S.CODE_SYSTEM].to_numpy(dtype=object).copy()
    vocabulary[found] = found_concepts[S.OMOP_VOCABULARY_ID].to_numpy(dtype=object)[where[found]]
    events[S.CODE_SYSTEM] = vocabulary
    if source == "concept_id":
        code = events[S.CODE].to_numpy(dtype=object).copy()
        code[found] = found_concepts[S.OMOP_CONCEPT_CODE].to_numpy(dtype=object)[where[found]]
        events[S.CODE] = code
        reason = events[S.REASON].to_numpy(dtype=object)
        unknown = ~found & (reason == "") & (concept_ids != "")
        events[S.REASON] = np.where(unknown, S.Reason.UNKNOWN_CONCEPT, reason).astype(object)
        notes["omop.concepts_not_in_concept_table"] = int(unknown.sum())
    notes["omop.code_naming"] = f"{source} named through {concepts.name}"
    notes["omop.conditions_named_by_concept"] = int(found.sum())
    named = pd.DataFrame(
        {
            S.CODE: events[S.CODE].to_numpy(dtype=object)[found],
            S.CODE_SYSTEM: vocabulary[found],
            S.DESCRIPTION: found_concepts[S.OMOP_CONCEPT_NAME].to_numpy(dtype=object)[where[found]],
        }
    ).drop_duplicates()
    return events, named


_CONCEPT_COLUMNS = (S.OMOP_CONCEPT_ID, S.OMOP_VOCABULARY_ID, S.OMOP_CONCEPT_CODE, S.OMOP_CONCEPT_NAME)


@dataclass
class Concepts:
    """The concept table: streamed for the wanted ids on every lookup, or (``loaded``) held in memory whole.

    It is reference data, not patient data, so it is not counted in the manifest's tables.
    """

    table: TablePlan | None
    name: str = ""
    loaded: pd.DataFrame | None = None

    def find(self, wanted: np.ndarray) -> pd.DataFrame:
        """vocabulary_id, concept_code, concept_name of the ``wanted`` concept ids (text), indexed by id."""
        if self.loaded is not None:
            return self.loaded[self.loaded.index.isin(wanted)]
        return _read_concepts(self.table, pd.Index(wanted))

    def load(self) -> Concepts:
        """The same table held in memory (what a Ray engine broadcasts to its tasks)."""
        return Concepts(self.table, self.name, _read_concepts(self.table, None))


def lookups(plan: Plan, config: EtlConfig) -> Concepts:
    """The concept table, its columns checked (names and types), when the dataset has one."""
    files = find_table(plan.input_dir, S.OMOP_CONCEPT, required=False)
    if not files:
        return Concepts(None)
    table = source.plan_table(
        plan.input_dir, S.OMOP_CONCEPT, files, _CONCEPT_COLUMNS, _CONCEPT_COLUMNS[:3], S.OMOP_CONCEPT_ID, True
    )
    source.check_types(table, {S.OMOP_CONCEPT_ID: "id"}, _check)
    return Concepts(table, plan.name(files[0]))


def _read_concepts(table: TablePlan | None, want: pd.Index | None) -> pd.DataFrame:
    """The concept rows whose id is in ``want`` (all rows when None), streamed; the first row of an id wins."""
    columns = _CONCEPT_COLUMNS
    frames = []
    for path in [] if table is None else table.files:
        for batch in source.read_file(table, path):  # type: ignore[arg-type]
            ids = integer_text(batch[S.OMOP_CONCEPT_ID])
            keep = np.ones(len(ids), dtype=bool) if want is None else want.get_indexer(pd.Index(ids)) >= 0
            frame = {c: io.to_text(batch[c])[keep] for c in columns[1:] if c in batch.column_names}
            frame.setdefault(S.OMOP_CONCEPT_NAME, np.full(int(keep.sum()), "", dtype=object))
            frames.append(pd.DataFrame({S.OMOP_CONCEPT_ID: ids[keep], **frame}))
    if not frames:
        return pd.DataFrame(columns=list(columns[1:]), index=pd.Index([], dtype=object))
    found = pd.concat(frames, ignore_index=True).drop_duplicates(S.OMOP_CONCEPT_ID)
    return found.set_index(S.OMOP_CONCEPT_ID)


def _codes(array: pa.ChunkedArray, column: str, float_printed: bool, stats: Counter[str]) -> np.ndarray:
    """Condition codes as text, repairing float-printed integers where the rule says so (module docstring)."""
    t = array.type
    if pa.types.is_floating(t) or pa.types.is_decimal(t):
        text = _float_text(array)
        values = np.asarray(pc.cast(array, pa.float64()).to_numpy(zero_copy_only=False), dtype=np.float64)
        integral = np.floor(values) == values
        stats["float_printed"] += int(integral.sum())
        stats["non_integral"] += int((~np.isnan(values) & ~integral).sum())
        return text
    if pa.types.is_integer(t):
        return io.to_text(array)
    text = io.to_text(array)
    if column == S.OMOP_CONDITION_CONCEPT_ID or float_printed:
        repaired = integer_text(array)
        stats["float_printed"] += int((repaired != text).sum())
        return repaired
    return text


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


__all__ = ["build", "find_table", "integer_text", "lookups", "plan", "read"]
