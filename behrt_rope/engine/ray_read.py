"""Reading a dataset's input tables with Ray Data, partitioned by patient shard.

:class:`ShardPieces` is a Ray Data file datasource over every file of a reader's :class:`~behrt_rope.etl.
readers.source.Plan`: Ray lists the files and spreads them over read tasks; each task streams its files
with the same batch reader as the local engine (:func:`~behrt_rope.etl.readers.source.read_file`: CSV as
text, Parquet dictionaries decoded, each row's number in its file) and cuts every batch into one *piece*
per patient shard (the shard hash of the local engine). A piece row is (``shard``, ``file``, ``first_row``,
``data``: the rows as Arrow IPC bytes); one more row per batch (``shard`` -1) carries the batch's
dataset-wide facts. Grouping the pieces by ``shard`` gives each shard's rows of every table,
reassembled in file and row order by :func:`shard_input`.

Ray Data's own ``read_parquet``/``read_csv`` are not used because they do not give a row's number in its
file, which the quarantine and the manifest name, and ``read_csv`` would guess column types (the ICD-9 code
``250`` must stay text).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
from ray.data.datasource import FileBasedDatasource

from behrt_rope.etl.readers import source
from behrt_rope.etl.readers.source import BatchFacts, Chunk, IdText, Plan, ShardInput

FACTS_SHARD = -1  # the ``shard`` of a row that carries a batch's facts instead of rows


class ShardPieces(FileBasedDatasource):
    """Every file of ``plan`` read as patient-shard pieces (module docstring)."""

    def __init__(self, plan: Plan, id_text: IdText, facts: BatchFacts, n_shards: int) -> None:
        files = plan.files()
        super().__init__([str(path) for _, path in files])
        self._files = {os.path.abspath(path): (n, table, path) for n, (table, path) in enumerate(files)}
        self._plan, self._id_text, self._facts, self._n_shards = plan, id_text, facts, n_shards

    def _read_stream(self, f: pa.NativeFile, path: str) -> Iterator[pa.Table]:
        """One file's pieces. The file is read by its path (every node sees the input at the same path)
        with the local engine's batch reader, so text stays text and errors read the same."""
        number, table, file = self._files[os.path.abspath(path)]
        name = self._plan.name(file)
        for batch in source.read_file(table, file):
            facts = json.dumps(self._facts(table, name, batch))
            shards = source.shard_numbers(batch[table.id_column], self._id_text, self._n_shards)
            yield pieces(batch, shards, number, facts)


def pieces(batch: pa.Table, shards: np.ndarray, file: int, facts: str) -> pa.Table:
    """One row per shard present in ``batch`` (its rows, in file order, as Arrow IPC) and a facts row.

    ``shards``: the shard of each row, shape (rows,). Columns: shard, file, first_row, data, facts.
    """
    order = np.argsort(shards, kind="stable")  # rows grouped by shard, file order kept within each
    ordered = batch.take(pa.array(order))
    present, starts = np.unique(shards[order], return_index=True)
    ends = [*starts[1:], len(order)]
    data = [_to_ipc(ordered.slice(start, end - start)) for start, end in zip(starts, ends)]
    first = [int(ordered[source.ROW][int(start)].as_py()) for start in starts]
    return pa.table(
        {
            "shard": pa.array([FACTS_SHARD, *present.tolist()], pa.int64()),
            "file": pa.array([file] * (len(present) + 1), pa.int64()),
            "first_row": pa.array([-1, *first], pa.int64()),
            "data": pa.array([b"", *data], pa.large_binary()),
            "facts": pa.array([facts] + [""] * len(present), pa.string()),
        }
    )


def shard_input(group: pa.Table, plan: Plan, n_shards: int, facts: dict[str, bool], lookups: Any) -> ShardInput:
    """One shard's pieces (rows of :func:`pieces`, one shard, any order) as the input of a reader's build."""
    keys = sorted(range(group.num_rows), key=lambda i: (group["file"][i].as_py(), group["first_row"][i].as_py()))
    files = plan.files()
    chunks: dict[str, list[Chunk]] = {name: [] for name in plan.tables}
    for i in keys:
        table, path = files[group["file"][i].as_py()]
        chunks[table.name].append(Chunk(path, plan.name(path), _from_ipc(group["data"][i].as_py())))
    return ShardInput(plan, int(group["shard"][0].as_py()), n_shards, chunks, facts, lookups)


def _to_ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue())


def _from_ipc(data: bytes) -> pa.Table:
    return pa.ipc.open_stream(data).read_all()
