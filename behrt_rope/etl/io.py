"""Reading raw tables: file discovery, streaming batches, column checks and time parsing.

CSV columns are always read as text: type guessing would turn the ICD-9 code ``250`` into ``250.0``.
"""

from __future__ import annotations

import re
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
BATCH_ROWS = 1 << 18  # rows per streamed batch: bounds the reader's transient memory
CSV_DELIMITERS = (",", "\t", ";", "|")  # the first one the header holds separates the columns
CSV_NULLS = ("", "NA", "NULL", "null", "\\N")  # missing values as R, SQL exports and PostgreSQL COPY write them


def find_table(input_dir: Path, name: str, required: bool = True) -> list[Path]:
    """Files holding table ``name``: ``name.parquet``, ``name.csv(.gz)``, or a folder ``name/`` of parts. Two of
    these side by side stop the run (which one is the table? reading one would silently drop the other).

    >>> find_table(Path("/nonexistent"), "events", required=False)
    []
    """
    sources = [
        [input_dir / f"{name}{suffix}"] for suffix in TABLE_SUFFIXES if (input_dir / f"{name}{suffix}").is_file()
    ]
    folder = input_dir / name
    if folder.is_dir():
        parts = sorted(p for p in folder.rglob("*") if p.is_file() and p.name.endswith(TABLE_SUFFIXES))
        if parts:
            sources.append(parts)
    if len(sources) > 1:
        names = [str(files[0]) if len(files) == 1 else f"{folder}/ ({len(files)} files)" for files in sources]
        raise InputSchemaError(
            f"{input_dir}: the '{name}' table is given {len(sources)} times ({', '.join(names)}); keep one of them"
        )
    if sources:
        return sources[0]
    if required:
        raise InputSchemaError(
            f"{input_dir}: no '{name}' table (looked for {name}.parquet, {name}.csv, {name}.csv.gz "
            f"or a folder {name}/ of such files)"
        )
    return []


def column_names(path: Path) -> list[str]:
    """The columns of a CSV or Parquet file, without reading its rows; a duplicated name stops (ambiguous)."""
    try:
        if path.name.endswith(".parquet"):
            names = list(pq.read_schema(path).names)
        else:
            names = list(_open_csv(path).schema.names)
    except (pa.ArrowException, OSError) as err:
        raise InputSchemaError(f"{path}: cannot read the file: {_first_line(err)}") from err
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice is not None:
        raise InputSchemaError(
            f"{path}: column '{twice}' appears {names.count(twice)} times (columns {names}; "
            f"example row: {_first_row(path)}); rename or drop the duplicate"
        )
    return names


def _open_csv(path: Path) -> pacsv.CSVStreamingReader:
    return pacsv.open_csv(path, read_options=pacsv.ReadOptions(block_size=1 << 16), parse_options=_parse_options(path))


def _parse_options(path: Path) -> pacsv.ParseOptions:
    """The CSV's delimiter: the first of :data:`CSV_DELIMITERS` found in its header line (a comma if none).

    Tab-separated files (Athena's vocabulary tables, PostgreSQL ``COPY``) and semicolons (Excel in many
    locales) are read as they are; a header with a comma is always read as comma-separated.
    """
    with pa.input_stream(str(path), compression="detect") as stream:
        header = stream.read(1 << 16).split(b"\n", 1)[0].decode("utf-8", errors="replace")
    return pacsv.ParseOptions(delimiter=next((d for d in CSV_DELIMITERS if d in header), ","))


def _first_row(path: Path) -> list[object]:
    """The first row's values by position (works with duplicated column names), for error messages."""
    try:
        if path.name.endswith(".parquet"):
            batch = next(pq.ParquetFile(path).iter_batches(batch_size=1), None)
        else:
            batch = _open_csv(path).read_next_batch()
    except (pa.ArrowException, OSError, StopIteration):
        return []
    return [] if batch is None or not batch.num_rows else [_clip(first_value(c.slice(0, 1))) for c in batch.columns]


def iter_batches(path: Path, columns: Sequence[str]) -> Iterator[pa.Table]:
    """Stream ``columns`` of a file in row order, as tables of up to ~1M rows; CSV columns as text, with
    the null markers of :data:`CSV_NULLS` (``NA``, ``NULL``, ``\\N``) read as missing.

    Dictionary-encoded Parquet columns (a pandas ``category`` column, say) come back decoded. A file that
    cannot be parsed stops with an :class:`InputSchemaError` naming it.
    """
    try:
        yield from _batches(path, columns)
    except pa.ArrowException as err:
        raise InputSchemaError(f"{path}: cannot read the file: {_first_line(err)}{_bad_text(path, err)}") from err


def _bad_text(path: Path, err: BaseException) -> str:
    """For a CSV with bytes that are not UTF-8: the column by name and the first such line, as an example."""
    found = re.search(r"CSV column #(\d+)", str(err))
    if not found or "UTF8" not in str(err):
        return ""
    names = column_names(path)
    index = int(found.group(1))
    column = f" (column '{names[index]}')" if index < len(names) else ""
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError:
                return f"{column}; example: line {number}: {line.rstrip()[:200]!r}; save the file as UTF-8"
    return column


def _batches(path: Path, columns: Sequence[str]) -> Iterator[pa.Table]:
    empty = True
    if path.name.endswith(".parquet"):
        parquet = pq.ParquetFile(path)
        for batch in parquet.iter_batches(batch_size=BATCH_ROWS, columns=list(columns)):
            empty = False
            yield _decode_dictionaries(pa.Table.from_batches([batch]))
        if empty:  # a file without rows still yields one (empty) batch, so that readers count it
            yield _decode_dictionaries(parquet.schema_arrow.empty_table().select(list(columns)))
        return
    names = column_names(path)
    convert = pacsv.ConvertOptions(
        column_types={c: pa.string() for c in names},
        include_columns=list(columns),
        null_values=list(CSV_NULLS),
        strings_can_be_null=True,
    )
    reader = pacsv.open_csv(
        path,
        read_options=pacsv.ReadOptions(block_size=16 << 20),
        parse_options=_parse_options(path),
        convert_options=convert,
    )
    for batch in reader:
        empty = False
        yield pa.Table.from_batches([batch])
    if empty:
        yield reader.schema.empty_table()


def _decode_dictionaries(table: pa.Table) -> pa.Table:
    """Replace dictionary columns by their plain value type."""
    for i, f in enumerate(table.schema):
        if pa.types.is_dictionary(f.type):
            table = table.set_column(i, f.name, table.column(i).cast(f.type.value_type))
    return table


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


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
            one = table.slice(row, 1)
            return {name: _clip(first_value(one.column(i))) for i, name in enumerate(one.column_names)}
        row -= table.num_rows
    return {}


def check_arrow_type(path: Path, column: str, array: pa.ChunkedArray | pa.Array, allowed: str) -> None:
    """Reject a column whose Arrow type cannot hold ``allowed`` ('id', 'code' or 'time') values.

    Ids and codes must be text or integers (a float column would print ``250`` as ``250.0``); times must be
    text, dates or timestamps.

    >>> check_arrow_type(Path("events.parquet"), "code", pa.array([250.0, None]), "code")
    Traceback (most recent call last):
    ...
    behrt_rope.errors.InputSchemaError: events.parquet: column 'code' has type double, expected text or \
integer (example value: 250.0)
    """
    t = array.type
    if pa.types.is_dictionary(t):
        t = t.value_type
    ok = {
        "id": _is_text(t) or pa.types.is_integer(t),
        "code": _is_text(t) or pa.types.is_integer(t),
        "time": _is_text(t) or pa.types.is_temporal(t),
    }[allowed]
    if pa.types.is_null(t):
        ok = True
    if not ok:
        first = first_value(array)
        expected = {"id": "text or integer", "code": "text or integer", "time": "an ISO date/datetime"}[allowed]
        raise InputSchemaError(
            f"{path}: column '{column}' has type {t}, expected {expected} (example value: {shown(first)})"
        )


def first_value(array: pa.ChunkedArray | pa.Array) -> object:
    """The first non-null value, for error messages; as text where Python cannot hold it (year 300000).

    >>> first_value(pa.array([None, 7])), first_value(pa.array([2**62], pa.timestamp("us")))
    (7, '<value out of range: 4611686018427387904>')
    """
    present = array.drop_null()
    if not len(present):
        return None
    try:
        return present[0].as_py()
    except (OverflowError, ValueError):
        return pc.cast(present.slice(0, 1), pa.string())[0].as_py()


def shown(value: object, limit: int = 60) -> str:
    """``repr(value)`` for an error message, cut to about ``limit`` characters (messages stay one short line).

    >>> shown("E11"), shown("Z" * 500)
    ("'E11'", "'ZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZ... (500 characters)")
    """
    return repr(_clip(value, limit))


def _clip(value: object, limit: int = 60) -> object:
    if isinstance(value, (str, bytes)) and len(value) > limit:
        return _Clipped(value, limit)
    return value


class _Clipped:
    """A long text shown by its start and its length."""

    def __init__(self, value: str | bytes, limit: int) -> None:
        self.value, self.limit = value, limit

    def __repr__(self) -> str:
        return f"{self.value[: self.limit - 1]!r}... ({len(self.value)} characters)"


def _is_text(t: pa.DataType) -> bool:
    return bool(pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t))


def to_text(array: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """Any id/code column as a numpy object array of stripped strings; nulls become ''.

    Each distinct value becomes one Python string, shared by all its rows (columns repeat values a lot).

    >>> to_text(pa.array([" E11 ", None])).tolist(), to_text(pa.array([250, 7])).tolist()
    (['E11', ''], ['250', '7'])
    """
    if pa.types.is_null(array.type):
        return np.full(len(array), "", dtype=object)
    uniques, index = _distinct_text(array)
    return np.asarray(uniques.to_numpy(zero_copy_only=False), dtype=object)[index]


def text_array(array: pa.ChunkedArray | pa.Array) -> pd.api.extensions.ExtensionArray:
    """Like :func:`to_text`, as an Arrow-backed pandas string array (no Python string per row).

    For readers building canonical frames: pandas keeps it as it is, where an object array of strings
    would be converted to Arrow again, value by value.

    >>> text_array(pa.array([" E11 ", None], pa.large_string())).tolist(), text_array(pa.array([250])).tolist()
    (['E11', ''], ['250'])
    """
    if pa.types.is_null(array.type):
        return pd.array(pa.array([""], pa.large_string()).take(np.zeros(len(array), dtype=np.int32)), dtype="str")
    if pa.types.is_string(array.type) or pa.types.is_large_string(array.type):
        # text already: stripping every row costs less than hashing the column and taking the distinct values
        trimmed = pc.utf8_trim_whitespace(pc.cast(_single(array), pa.large_string()))
        return pd.array(pc.fill_null(trimmed, ""), dtype="str")
    uniques, index = _distinct_text(array)
    return pd.array(uniques.cast(pa.large_string()).take(pa.array(index)), dtype="str")


def parse_times(array: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """Parse ISO dates or datetimes into ``datetime64[us]``; what does not parse becomes NaT.

    Times with a time zone (a UTC offset in the text, or a zoned timestamp) keep their local wall-clock
    time and lose the zone, unconverted: birth dates are local dates, so an event's calendar day must be
    its local day too. Impossible calendar dates are NaT, never rolled over into the next month, and so are
    partial dates (a year, or a year and month): no day is invented for them. Each distinct text is parsed once.

    >>> parse_times(pa.array(["2020-01-02", "2020-01-02T10:30:00", "2020-13-40", "2020-02-30", "", None])).tolist()
    [datetime.datetime(2020, 1, 2, 0, 0), datetime.datetime(2020, 1, 2, 10, 30), None, None, None, None]
    >>> parse_times(pa.array(["2002", "2002-04", " 2002-4 ", "20020415"])).tolist()
    [None, None, None, datetime.datetime(2002, 4, 15, 0, 0)]
    >>> parse_times(pa.array(["2020-01-02T01:00:00+02:00", "2020-01-02T01:00:00-0500", "2020-01-02T01:00Z"])).tolist()
    [datetime.datetime(2020, 1, 2, 1, 0), datetime.datetime(2020, 1, 2, 1, 0), datetime.datetime(2020, 1, 2, 1, 0)]
    """
    t = array.type
    if pa.types.is_timestamp(t) or pa.types.is_date(t):
        naive = pc.cast(array, pa.timestamp("us", t.tz if pa.types.is_timestamp(t) else None), safe=False)
        if pa.types.is_timestamp(t) and t.tz is not None:
            naive = pc.local_timestamp(naive)  # Arrow holds UTC instants: back to the zone's wall time
        return np.asarray(naive.to_numpy(zero_copy_only=False), dtype="datetime64[us]")
    if pa.types.is_null(t):
        return np.full(len(array), np.datetime64("NaT"), dtype="datetime64[us]")
    uniques, index = _distinct_text(array)
    return _parse_distinct(uniques)[index]


def _parse_distinct(text: pa.Array) -> np.ndarray:
    """Parse (mostly distinct) ISO texts: Arrow's fast date parser, pandas' ISO 8601 parser for the rest."""
    fast = pc.strptime(text, format="%Y-%m-%d", unit="us", error_is_null=True)
    # strptime rolls impossible dates over (2020-02-30 -> 2020-03-01): keep only exact round trips. It parses
    # years 0000-9999 only, which a date cast writes as strftime's %Y-%m-%d does, 20x faster.
    exact = pc.fill_null(pc.equal(pc.cast(pc.cast(fast, pa.date32()), pa.string()), text), False)
    out = np.asarray(pc.if_else(exact, fast, None).to_numpy(zero_copy_only=False), dtype="datetime64[us]")
    retry = np.isnat(out) & (pc.utf8_length(text).to_numpy(zero_copy_only=False) > 0)
    if retry.any():
        local = without_offset(text.filter(pa.array(retry)))
        slow = pd.to_datetime(
            pd.Series(np.asarray(local.to_numpy(zero_copy_only=False), dtype=object)),
            format="ISO8601",
            errors="coerce",
            utc=True,  # only a zone the offset pattern does not know is left: read as UTC, never a crash
        )
        partial = pc.match_substring_regex(local, _PARTIAL).to_numpy(zero_copy_only=False)
        out[retry] = np.where(partial, np.datetime64("NaT"), slow.dt.tz_localize(None).to_numpy(dtype="datetime64[us]"))
    return out


_PARTIAL = r"^[+-]?\d{4}(?:-\d{1,2})?$"  # a year, or a year and month, which pandas reads as their first day


_OFFSET = r"^(.*[T ].*?\S)\s*(?:Z|[+-]\d{2}(?::?\d{2})?)$"  # date, time, then Z, +hh, +hhmm or +hh:mm


def without_offset(text: pa.Array) -> pa.Array:
    """ISO datetimes with their UTC offset cut off, unconverted (the local wall-clock time); dates, and
    times without an offset, unchanged. Only a text with a time part (after ``T`` or a blank) loses its end.

    >>> without_offset(pa.array(["2020-01-02T10:30:00+02:00", "2020-01-02 10:30 -0500", "2020-01-02T10Z",
    ...                          "2020-01-02", "2020-01-02T10:30"])).to_pylist()
    ['2020-01-02T10:30:00', '2020-01-02 10:30', '2020-01-02T10', '2020-01-02', '2020-01-02T10:30']
    """
    return pc.replace_substring_regex(text, pattern=_OFFSET, replacement=r"\1")


def _distinct_text(array: pa.ChunkedArray | pa.Array) -> tuple[pa.Array, np.ndarray]:
    """(distinct values as stripped text, with '' for null; index of each row's value) of any column.

    The hash runs on the raw values and the stripping on the distinct ones only (they are far fewer).
    """
    encoded = pc.dictionary_encode(_single(array), null_encoding="encode")
    uniques = pc.fill_null(pc.utf8_trim_whitespace(pc.cast(encoded.dictionary, pa.string())), "")
    return uniques, encoded.indices.to_numpy(zero_copy_only=False)


def _single(array: pa.ChunkedArray | pa.Array) -> pa.Array:
    """One contiguous array (a batch's chunks joined)."""
    if isinstance(array, pa.ChunkedArray):
        return array.combine_chunks() if array.num_chunks != 1 else array.chunk(0)
    return array


def present_mask(array: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """True where a raw value is neither null nor blank text."""
    if pa.types.is_null(array.type):
        return np.zeros(len(array), dtype=bool)
    if not (pa.types.is_string(array.type) or pa.types.is_large_string(array.type)):
        return np.asarray(pc.is_valid(array).to_numpy(zero_copy_only=False), dtype=bool)
    length = pc.utf8_length(pc.utf8_trim_whitespace(array))
    return np.asarray(pc.fill_null(pc.greater(length, 0), False).to_numpy(zero_copy_only=False), dtype=bool)


def check_parse_rate(
    path: Path,
    column: str,
    raw: pa.ChunkedArray | pa.Array,
    parsed: np.ndarray,
    limit: float,
    rows: np.ndarray | None = None,
) -> None:
    """Stop when most non-empty values of a date column fail to parse: the column has the wrong format.

    ``rows``: each value's row number in the file, shape (values,), for the example (default: 0, 1, ...).
    """
    if limit >= 0 and not np.isnat(parsed).any():  # nothing failed: no need to find the blank values
        return
    present = present_mask(raw)
    failed = present & np.isnat(parsed)
    if present.sum() == 0 or failed.sum() / present.sum() <= limit:
        return
    first = int(np.flatnonzero(failed)[0])
    example = shown(first_value(raw[first : first + 1]))
    row = first if rows is None else int(rows[first])
    raise InputSchemaError(
        f"{path}: column '{column}' is not in ISO date format (YYYY-MM-DD or YYYY-MM-DDTHH:MM:SS): "
        f"{failed.sum():,} of {present.sum():,} values do not parse (example row {row}: {example})"
    )
