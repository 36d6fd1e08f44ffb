"""Reader of the visits format: a ``patients`` and an ``events`` table (CSV or Parquet, SPEC)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa

from behrt_rope import schema as S
from behrt_rope.etl import io
from behrt_rope.etl.config import EtlConfig
from behrt_rope.etl.raw import EVENT_COLUMNS, PATIENT_COLUMNS, RawTables, concat, events_frame, patients_frame
from behrt_rope.etl.split import shard_of


def read(input_dir: Path, config: EtlConfig, shard: int = 0, n_shards: int = 1) -> RawTables:
    """Read the rows of patient shard ``shard`` (of ``n_shards``) from a visits-format directory."""
    rows_read: dict[str, int] = {}
    patients, id_types = [], set()
    for path, batch, first_row in _batches(input_dir, S.PATIENTS_TABLE, config):
        ids = io.text_array(batch[S.PATIENT_ID])
        id_types.add("int64" if pa.types.is_integer(batch[S.PATIENT_ID].type) else "string")
        keep = shard_of(ids, n_shards) == shard
        birth = io.parse_times(batch[S.BIRTH_DATE])
        io.check_parse_rate(path, S.BIRTH_DATE, batch[S.BIRTH_DATE], birth, config.max_invalid_fraction)
        death, death_raw = None, None
        if S.DEATH_DATE in batch.column_names:
            death, death_raw = io.parse_times(batch[S.DEATH_DATE]), io.text_array(batch[S.DEATH_DATE])
            io.check_parse_rate(path, S.DEATH_DATE, batch[S.DEATH_DATE], death, config.max_invalid_fraction)
        name = _name(input_dir, path)
        rows_read[name] = rows_read.get(name, 0) + int(keep.sum())
        rows = first_row + np.arange(batch.num_rows)
        patients.append(
            patients_frame(
                ids[keep],
                birth[keep],
                io.text_array(batch[S.BIRTH_DATE])[keep],
                None if death is None else death[keep],
                None if death_raw is None else death_raw[keep],
                name,
                rows[keep],
            )
        )
    events = []
    for path, batch, first_row in _batches(input_dir, S.EVENTS_TABLE, config):
        ids = io.text_array(batch[S.PATIENT_ID])
        keep = shard_of(ids, n_shards) == shard
        time = io.parse_times(batch[S.DATE])
        io.check_parse_rate(path, S.DATE, batch[S.DATE], time, config.max_invalid_fraction)
        optional = {c: io.text_array(batch[c])[keep] for c in (S.CODE_SYSTEM, S.VISIT_ID) if c in batch.column_names}
        name = _name(input_dir, path)
        rows_read[name] = rows_read.get(name, 0) + int(keep.sum())
        events.append(
            events_frame(
                ids[keep],
                time[keep],
                io.text_array(batch[S.DATE])[keep],
                io.text_array(batch[S.CODE])[keep],
                optional.get(S.CODE_SYSTEM),
                optional.get(S.VISIT_ID),
                name,
                (first_row + np.arange(batch.num_rows))[keep],
            )
        )
    return RawTables(
        patients=concat(patients, PATIENT_COLUMNS),
        events=concat(events, EVENT_COLUMNS),
        rows_read=rows_read,
        patient_id_type="int64" if id_types == {"int64"} else "string",
    )


def _batches(input_dir: Path, table: str, config: EtlConfig) -> Iterator[tuple[Path, pa.Table, int]]:
    """(file, batch, index of the batch's first row in that file), after checking columns and types."""
    required = S.VISITS_REQUIRED[table]
    for path in io.find_table(input_dir, table):
        present = io.column_names(path)
        io.require_columns(path, required, present)
        wanted = [c for c in (*required, *S.VISITS_OPTIONAL[table]) if c in present]
        first_row = 0
        for batch in io.iter_batches(path, wanted):
            for column in wanted:
                io.check_arrow_type(path, column, batch[column], _KINDS.get(column, "code"))
            yield path, batch, first_row
            first_row += batch.num_rows


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


def _name(input_dir: Path, path: Path) -> str:
    return str(path.relative_to(input_dir))


__all__ = ["pd", "read"]
