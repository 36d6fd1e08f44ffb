"""A dataset's input as the readers see it, split into a plan, a read and a shard of rows.

- :class:`Plan`: which files make up each table and which of their columns to read, checked on the schemas
  alone (missing columns and wrong types stop here, naming the file, column and an example row);
- :func:`read_file`: one file's batches, with each row's number in its file (column ``__row``);
- :class:`ShardInput`: one patient shard's rows of every table, as :class:`Chunk` s in file and row order,
  plus the dataset-wide facts and lookups a reader's pure ``build`` step needs.

The local engine streams the files and keeps one shard's rows (:func:`gather`); the Ray engine reads them
with Ray Data and hands each shard's rows to the same ``build`` (:mod:`behrt_rope.engine.ray_read`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from behrt_rope.errors import InputSchemaError
from behrt_rope.etl import io
from behrt_rope.etl.split import shard_of

ROW = "__row"  # a row's 0-based number in its file (int64)
IdText = Callable[[pa.Array], np.ndarray]  # patient ids (any type) -> stripped text, '' for null
Checker = Callable[[Path, str, pa.ChunkedArray, str], None]  # (file, column, values, kind) -> raise or not


@dataclass
class TablePlan:
    """One logical table (``events``, ``person``, ...): its files and what to read from each."""

    name: str
    files: list[Path]
    columns: dict[Path, list[str]]  # per file: the columns to read, spelled as in the file
    id_column: str  # the patient id column (as the reader names it, after ``lower_case``)
    lower_case: bool = False  # column names are lower-cased after reading (OMOP)


@dataclass
class Plan:
    """Every table a reader reads, in reading order, and dataset-wide facts known from the schemas."""

    input_dir: Path
    tables: dict[str, TablePlan]
    facts: dict[str, bool] = field(default_factory=dict)
    choices: dict[str, str] = field(default_factory=dict)  # settings resolved on the dataset (OMOP code column)

    def name(self, path: Path) -> str:
        """A file's name in the manifest: its path relative to the input directory."""
        return str(path.relative_to(self.input_dir))

    def files(self) -> list[tuple[TablePlan, Path]]:
        """(table, file) for every file, in reading order; the index is a file's number."""
        return [(table, path) for table in self.tables.values() for path in table.files]


@dataclass
class Chunk:
    """Rows of one file that fall into one patient shard, in file order (columns as planned, plus ``ROW``)."""

    path: Path
    name: str
    table: pa.Table

    @property
    def rows(self) -> np.ndarray:
        """Each row's number in its file, shape (rows,)."""
        return np.asarray(self.table[ROW].to_numpy(), dtype=np.int64)


@dataclass
class ShardInput:
    """One patient shard of a dataset: per table, its chunks in (file, row) order."""

    plan: Plan
    shard: int
    n_shards: int
    chunks: dict[str, list[Chunk]]
    facts: dict[str, bool]  # dataset-wide (all shards): the plan's, merged with every batch's
    lookups: Any = None  # a reader's small reference tables (MEDS metadata, OMOP concepts)

    def names(self, table: str) -> list[str]:
        """Every file of ``table`` by manifest name, also those without a row in this shard."""
        return [self.plan.name(p) for p in self.plan.tables[table].files] if table in self.plan.tables else []

    def of(self, table: str) -> list[Chunk]:
        return self.chunks.get(table, [])


def empty_shard(plan: Plan, shard: int, n_shards: int, facts: dict[str, bool], lookups: Any) -> ShardInput:
    """A shard none of whose patients has a row."""
    return ShardInput(plan, shard, n_shards, {t: [] for t in plan.tables}, facts, lookups)


def merge_facts(facts: Iterable[Mapping[str, bool]]) -> dict[str, bool]:
    """Combine findings: keys starting with ``all:`` hold when they hold everywhere, others when anywhere.

    >>> merge_facts([{"all:x": True, "y": False}, {"all:x": False, "y": True}])
    {'all:x': False, 'y': True}
    """
    merged: dict[str, bool] = {}
    for found in facts:
        for key, value in found.items():
            if key not in merged:
                merged[key] = bool(value)
            elif key.startswith("all:"):
                merged[key] = merged[key] and bool(value)
            else:
                merged[key] = merged[key] or bool(value)
    return merged


def plan_table(
    input_dir: Path,
    name: str,
    files: list[Path],
    wanted: tuple[str, ...],
    required: tuple[str, ...],
    id_column: str,
    lower_case: bool = False,
) -> TablePlan:
    """Check each file's columns (``required`` may hold alternatives ``a|b``) and pick the ``wanted`` ones.

    With ``lower_case``, ``wanted``/``required`` are lower-case names matched in any case.
    """
    columns = {}
    for path in files:
        present = io.column_names(path)
        by_name: dict[str, str] = {}
        for column in present:
            by_name.setdefault(column.lower() if lower_case else column, column)
        for need in required:
            options = need.split("|")
            if not any(o in by_name for o in options):
                io.require_columns(path, [options[0]], list(by_name) if lower_case else present)
        columns[path] = [by_name[c] for c in wanted if c in by_name]
    return TablePlan(name, files, columns, id_column, lower_case)


def check_types(table: TablePlan, kinds: Mapping[str, str], check: Checker = io.check_arrow_type) -> None:
    """Check each file's column types against ``kinds`` (column -> 'id', 'code' or 'time') from its schema.

    CSV columns are read as text and always pass. A wrong type is reported with the file's first non-null
    value of the column as example, read only then.
    """
    for path in table.files:
        if not path.name.endswith(".parquet"):
            continue
        schema = pq.read_schema(path)
        for actual in table.columns[path]:
            column = actual.lower() if table.lower_case else actual
            if column not in kinds:
                continue
            try:
                check(path, column, schema.empty_table()[actual], kinds[column])
            except InputSchemaError:
                check(path, column, next(io.iter_batches(path, [actual]))[actual], kinds[column])


def integer_ids(table: TablePlan) -> bool:
    """Whether every file holds the patient id as integers (Parquet integer columns; CSV is text)."""
    for path in table.files:
        if not path.name.endswith(".parquet"):
            return False
        actual = next(c for c in table.columns[path] if (c.lower() if table.lower_case else c) == table.id_column)
        kind = pq.read_schema(path).field(actual).type
        if not pa.types.is_integer(kind.value_type if pa.types.is_dictionary(kind) else kind):
            return False
    return True


def read_file(table: TablePlan, path: Path) -> Iterator[pa.Table]:
    """Stream a file's planned columns (names lower-cased where planned), each batch with ``ROW`` appended."""
    first_row = 0
    for batch in io.iter_batches(path, table.columns[path]):
        if table.lower_case:
            batch = batch.rename_columns([c.lower() for c in batch.column_names])
        rows = np.arange(first_row, first_row + batch.num_rows, dtype=np.int64)
        yield batch.append_column(ROW, pa.array(rows))
        first_row += batch.num_rows


def shard_numbers(ids: pa.ChunkedArray | pa.Array, id_text: IdText, n_shards: int) -> np.ndarray:
    """Patient shard per row, shape (rows,), int64; the id hash runs once per distinct id."""
    if n_shards == 1:
        return np.zeros(len(ids), dtype=np.int64)
    single = ids.combine_chunks() if isinstance(ids, pa.ChunkedArray) else ids
    encoded = pc.dictionary_encode(single, null_encoding="encode")
    per_id = shard_of(id_text(encoded.dictionary), n_shards)
    return per_id[encoded.indices.to_numpy(zero_copy_only=False)]


BatchFacts = Callable[[TablePlan, str, pa.Table], dict[str, bool]]


def gather(plan: Plan, id_text: IdText, batch_facts: BatchFacts, shard: int, n_shards: int, lookups: Any) -> ShardInput:
    """The local engine's read: stream every file, keep the rows of patient shard ``shard``.

    Facts are taken from every batch before the shard's rows are picked, so all shards agree on them.
    """
    chunks: dict[str, list[Chunk]] = {t: [] for t in plan.tables}
    facts = [plan.facts]
    for table, path in plan.files():
        name = plan.name(path)
        for batch in read_file(table, path):
            facts.append(batch_facts(table, name, batch))
            if n_shards > 1:
                keep = shard_numbers(batch[table.id_column], id_text, n_shards) == shard
                batch = batch.filter(pa.array(keep))
            chunks[table.name].append(Chunk(path, name, batch))
    return ShardInput(plan, shard, n_shards, chunks, merge_facts(facts), lookups)


def no_facts(table: TablePlan, name: str, batch: pa.Table) -> dict[str, bool]:
    """For readers that need no dataset-wide findings from the rows."""
    return {}
