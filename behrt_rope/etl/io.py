"""Reading raw tables: file discovery, streaming batches, column checks and time parsing.

CSV columns are always read as text: type guessing would turn the ICD-9 code ``250`` into ``250.0``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from behrt_rope.errors import InputSchemaError

TABLE_SUFFIXES = (".parquet", ".csv", ".csv.gz")
BATCH_ROWS = 1 << 20


def find_table(input_dir: Path, name: str, required: bool = True) -> list[Path]:
    """Files holding table ``name``: ``name.parquet``, ``name.csv(.gz)``, or a folder ``name/`` of parts.

    >>> find_table(Path("/nonexistent"), "events", required=False)
    []
    """
    for suffix in TABLE_SUFFIXES:
        path = input_dir / f"{name}{suffix}"
        if path.is_file():
            return [path]
    folder = input_dir / name
    if folder.is_dir():
        parts = sorted(p for p in folder.rglob("*") if p.is_file() and p.name.endswith(TABLE_SUFFIXES))
        if parts:
            return parts
    if required:
        raise InputSchemaError(
            f"{input_dir}: no '{name}' table (looked for {name}.parquet, {name}.csv, {name}.csv.gz "
            f"or a folder {name}/ of such files)"
        )
    return []


def column_names(path: Path) -> list[str]:
    """The columns of a CSV or Parquet file, without reading its rows."""
    if path.name.endswith(".parquet"):
        return list(pq.read_schema(path).names)
    reader = pacsv.open_csv(path, read_options=pacsv.ReadOptions(block_size=1 << 16))
    return list(reader.schema.names)


def iter_batches(path: Path, columns: Sequence[str]) -> Iterator[pa.Table]:
    """Stream ``columns`` of a file in row order, as tables of up to ~1M rows; CSV columns as text."""
    if path.name.endswith(".parquet"):
        parquet = pq.ParquetFile(path)
        for batch in parquet.iter_batches(batch_size=BATCH_ROWS, columns=list(columns)):
            yield pa.Table.from_batches([batch])
        return
    names = column_names(path)
    convert = pacsv.ConvertOptions(
        column_types={c: pa.string() for c in names}, include_columns=list(columns), strings_can_be_null=False
    )
    reader = pacsv.open_csv(path, read_options=pacsv.ReadOptions(block_size=64 << 20), convert_options=convert)
    for batch in reader:
        yield pa.Table.from_batches([batch])


def require_columns(path: Path, required: Sequence[str], present: Sequence[str]) -> None:
    """Stop with the file, the missing column and an example row when a required column is absent."""
    missing = [c for c in required if c not in present]
    if missing:
        raise InputSchemaError(
            f"{path}: missing required column '{missing[0]}' (found columns {list(present)}; "
            f"example row: {example_row(path)})"
        )


def example_row(path: Path, row: int = 0) -> dict[str, object]:
    """Row ``row`` of a file as a dict, for error messages."""
    for table in iter_batches(path, column_names(path)):
        if row < table.num_rows:
            return {k: v[0] for k, v in table.slice(row, 1).to_pydict().items()}
        row -= table.num_rows
    return {}


def check_arrow_type(path: Path, column: str, array: pa.ChunkedArray | pa.Array, allowed: str) -> None:
    """Reject a column whose Arrow type cannot hold ``allowed`` ('id', 'code' or 'time') values.

    Ids and codes must be text or integers (a float column would print ``250`` as ``250.0``); times must be
    text, dates or timestamps.
    """
    t = array.type
    ok = {
        "id": pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_integer(t),
        "code": pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_integer(t),
        "time": pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_temporal(t),
    }[allowed]
    if pa.types.is_null(t):
        ok = True
    if not ok:
        first = next((v for v in array.to_pylist()[:1000] if v is not None), None)
        expected = {"id": "text or integer", "code": "text or integer", "time": "an ISO date/datetime"}[allowed]
        raise InputSchemaError(
            f"{path}: column '{column}' has type {t}, expected {expected} (example value: {first!r})"
        )


def to_text(array: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """Any id/code column as a numpy object array of stripped strings; nulls become ''.

    >>> to_text(pa.array([" E11 ", None])).tolist(), to_text(pa.array([250, 7])).tolist()
    (['E11', ''], ['250', '7'])
    """
    if pa.types.is_null(array.type):
        return np.full(len(array), "", dtype=object)
    text = pc.utf8_trim_whitespace(pc.cast(array, pa.string()))
    return np.asarray(pc.fill_null(text, "").to_numpy(zero_copy_only=False), dtype=object)


def parse_times(array: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """Parse ISO dates or datetimes into ``datetime64[us]``; what does not parse becomes NaT.

    Timestamps with a time zone are converted to UTC and the zone dropped.

    >>> parse_times(pa.array(["2020-01-02", "2020-01-02T10:30:00", "2020-13-40", "", None])).tolist()
    [datetime.datetime(2020, 1, 2, 0, 0), datetime.datetime(2020, 1, 2, 10, 30), None, None, None]
    """
    t = array.type
    if pa.types.is_timestamp(t) or pa.types.is_date(t):
        # Arrow stores zoned timestamps as UTC instants: dropping the zone keeps UTC wall time.
        naive = pc.cast(array, pa.timestamp("us", t.tz if pa.types.is_timestamp(t) else None), safe=False)
        if pa.types.is_timestamp(t) and t.tz is not None:
            naive = naive.cast(pa.int64()).cast(pa.timestamp("us"))
        return np.asarray(naive.to_numpy(zero_copy_only=False), dtype="datetime64[us]")
    if pa.types.is_null(t):
        return np.full(len(array), np.datetime64("NaT"), dtype="datetime64[us]")
    text = pc.utf8_trim_whitespace(pc.cast(array, pa.string()))
    fast = pc.strptime(text, format="%Y-%m-%d", unit="us", error_is_null=True)
    out = np.asarray(fast.to_numpy(zero_copy_only=False), dtype="datetime64[us]")
    retry = np.isnat(out) & (pc.fill_null(pc.utf8_length(text), 0).to_numpy(zero_copy_only=False) > 0)
    if retry.any():
        slow = pd.to_datetime(
            pd.Series(np.asarray(text.to_numpy(zero_copy_only=False), dtype=object)[retry]),
            format="ISO8601", errors="coerce", utc=True,
        )
        out[retry] = slow.dt.tz_localize(None).to_numpy(dtype="datetime64[us]")
    return out


def present_mask(array: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """True where a raw value is neither null nor blank text."""
    if pa.types.is_null(array.type):
        return np.zeros(len(array), dtype=bool)
    if not (pa.types.is_string(array.type) or pa.types.is_large_string(array.type)):
        return np.asarray(pc.is_valid(array).to_numpy(zero_copy_only=False), dtype=bool)
    length = pc.utf8_length(pc.utf8_trim_whitespace(array))
    return np.asarray(pc.fill_null(pc.greater(length, 0), False).to_numpy(zero_copy_only=False), dtype=bool)


def check_parse_rate(
    path: Path, column: str, raw: pa.ChunkedArray | pa.Array, parsed: np.ndarray, limit: float
) -> None:
    """Stop when most non-empty values of a date column fail to parse: the column has the wrong format."""
    present = present_mask(raw)
    failed = present & np.isnat(parsed)
    if present.sum() == 0 or failed.sum() / present.sum() <= limit:
        return
    row = int(np.flatnonzero(failed)[0])
    raise InputSchemaError(
        f"{path}: column '{column}' is not in ISO date format (YYYY-MM-DD or YYYY-MM-DDTHH:MM:SS): "
        f"{failed.sum():,} of {present.sum():,} values do not parse (example row {row}: {raw[row].as_py()!r})"
    )
