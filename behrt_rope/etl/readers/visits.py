"""Reader of the visits format: a ``patients`` and an ``events`` table (CSV or Parquet, SPEC).

``plan`` checks the files' schemas; ``build`` turns one patient shard's rows (however they were read) into
canonical tables; ``read`` does both for the local engine. A ``code_system`` is read by its letters and digits,
in upper case (:func:`system_name`), so that one vocabulary spelt three ways is one vocabulary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from behrt_rope import schema as S
from behrt_rope.etl import io
from behrt_rope.etl.config import EtlConfig
from behrt_rope.etl.raw import EVENT_COLUMNS, PATIENT_COLUMNS, RawTables, concat, events_frame, patients_frame
from behrt_rope.etl.readers import source
from behrt_rope.etl.readers.source import Chunk, Plan, ShardInput

_KINDS = {
    S.PATIENT_ID: "id",
    S.BIRTH_DATE: "time",
    S.DEATH_DATE: "time",
    S.DATE: "time",
    S.CODE: "code",
    S.VISIT_ID: "id",
    S.CODE_SYSTEM: "code",
    S.SEX: "code",
}
id_text = io.to_text


def read(input_dir: Path, config: EtlConfig, shard: int = 0, n_shards: int = 1) -> RawTables:
    """Read the rows of patient shard ``shard`` (of ``n_shards``) from a visits-format directory."""
    plan_ = plan(input_dir, config)
    return build(source.gather(plan_, id_text, facts(plan_, config), shard, n_shards, None), config)


def plan(input_dir: Path, config: EtlConfig) -> Plan:
    """The ``patients`` and ``events`` files and their columns, checked (names and types) on their schemas."""
    tables = {}
    for table in (S.PATIENTS_TABLE, S.EVENTS_TABLE):
        required = S.VISITS_REQUIRED[table]
        wanted = (*required, *S.VISITS_OPTIONAL[table])
        files = io.find_table(input_dir, table)
        tables[table] = source.plan_table(input_dir, table, files, wanted, required, S.PATIENT_ID)
        source.check_types(tables[table], {c: _KINDS.get(c, "code") for c in wanted})
    return Plan(input_dir, tables, {"all:integer_ids": source.integer_ids(tables[S.PATIENTS_TABLE])})


def facts(plan: Plan, config: EtlConfig) -> source.BatchFacts:
    """The visits format needs no dataset-wide findings from the rows."""
    return source.no_facts


def lookups(plan: Plan, config: EtlConfig) -> Any:
    """The visits format has no reference tables."""
    return None


def build(data: ShardInput, config: EtlConfig) -> RawTables:
    """Canonical patients and events of one shard's rows."""
    rows_read = {name: 0 for name in (*data.names(S.PATIENTS_TABLE), *data.names(S.EVENTS_TABLE))}
    patients = [_patients(chunk, config) for chunk in data.of(S.PATIENTS_TABLE)]
    events = [_events(chunk, config) for chunk in data.of(S.EVENTS_TABLE)]
    for chunk in (*data.of(S.PATIENTS_TABLE), *data.of(S.EVENTS_TABLE)):
        rows_read[chunk.name] += chunk.table.num_rows
    return RawTables(
        patients=concat(patients, PATIENT_COLUMNS),
        events=concat(events, EVENT_COLUMNS),
        rows_read=rows_read,
        patient_id_type="int64" if data.facts.get("all:integer_ids") else "string",
    )


def _patients(chunk: Chunk, config: EtlConfig) -> Any:
    batch, path, rows = chunk.table, chunk.path, chunk.rows
    birth = io.parse_times(batch[S.BIRTH_DATE])
    io.check_parse_rate(path, S.BIRTH_DATE, batch[S.BIRTH_DATE], birth, config.max_invalid_fraction, rows)
    death, death_raw = None, None
    if S.DEATH_DATE in batch.column_names:
        death, death_raw = io.parse_times(batch[S.DEATH_DATE]), io.text_array(batch[S.DEATH_DATE])
        io.check_parse_rate(path, S.DEATH_DATE, batch[S.DEATH_DATE], death, config.max_invalid_fraction, rows)
    return patients_frame(
        io.text_array(batch[S.PATIENT_ID]),
        birth,
        io.text_array(batch[S.BIRTH_DATE]),
        death,
        death_raw,
        chunk.name,
        rows,
        sex_raw=io.text_array(batch[S.SEX]) if S.SEX in batch.column_names else None,
    )


def _events(chunk: Chunk, config: EtlConfig) -> Any:
    batch, path = chunk.table, chunk.path
    time = io.parse_times(batch[S.DATE])
    io.check_parse_rate(path, S.DATE, batch[S.DATE], time, config.max_invalid_fraction, chunk.rows)
    optional = {c: io.text_array(batch[c]) for c in (S.CODE_SYSTEM, S.VISIT_ID) if c in batch.column_names}
    if S.CODE_SYSTEM in optional:
        optional[S.CODE_SYSTEM] = system_name(optional[S.CODE_SYSTEM])
    return events_frame(
        io.text_array(batch[S.PATIENT_ID]),
        time,
        io.text_array(batch[S.DATE]),
        io.text_array(batch[S.CODE]),
        optional.get(S.CODE_SYSTEM),
        optional.get(S.VISIT_ID),
        chunk.name,
        chunk.rows,
    )


def system_name(text: pd.api.extensions.ExtensionArray) -> pd.api.extensions.ExtensionArray:
    """Code systems by their letters and digits, in upper case: blanks, dots, hyphens and underscores dropped.

    >>> list(system_name(pd.array(["ICD-10-CM", "icd10cm", "ICD10CM", "Icd 9 cm", "", "read_v2"], dtype="str")))
    ['ICD10CM', 'ICD10CM', 'ICD10CM', 'ICD9CM', '', 'READV2']
    """
    index, uniques = pd.factorize(np.asarray(text, dtype=object))
    named = pd.Series(uniques, dtype="str").str.upper().str.replace(r"[\s._-]+", "", regex=True)
    return pd.array(named.to_numpy(dtype=object)[index] if len(index) else [], dtype="str")


__all__ = ["build", "plan", "read", "system_name"]
