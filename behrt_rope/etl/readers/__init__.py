"""Readers turn one input layout into canonical :class:`~behrt_rope.etl.raw.RawTables`, shard by shard.

Each reader module exposes ``read(input_dir, config, shard, n_shards) -> RawTables`` and the parts it is
made of, so that another engine can do the reading (:class:`FormatReader`, :mod:`.source`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

import numpy as np
import pyarrow as pa

from behrt_rope.etl.config import EtlConfig
from behrt_rope.etl.raw import RawTables
from behrt_rope.etl.readers import source
from behrt_rope.etl.readers.source import BatchFacts, Plan, ShardInput


class FormatReader(Protocol):
    """A reader module, split into what reads the files and what turns one shard's rows into tables."""

    def read(self, input_dir: Path, config: EtlConfig, shard: int = 0, n_shards: int = 1) -> RawTables:
        """:func:`plan`, :func:`lookups`, a streaming read of one shard (``source.gather``), :func:`build`."""
        ...

    def plan(self, input_dir: Path, config: EtlConfig) -> Plan:
        """Files and columns to read, checked on the schemas (raises ``InputSchemaError``)."""
        ...

    def lookups(self, plan: Plan, config: EtlConfig) -> Any:
        """Small reference tables every shard needs (None, MEDS metadata, OMOP concepts)."""
        ...

    def id_text(self, array: pa.Array) -> np.ndarray:
        """Patient ids as the text the shard hash is taken of."""
        ...

    def facts(self, plan: Plan, config: EtlConfig) -> BatchFacts:
        """Dataset-wide findings per batch, taken before a shard's rows are picked."""
        ...

    def build(self, data: ShardInput, config: EtlConfig) -> RawTables:
        """The pure step: one shard's rows (however they were read) -> canonical tables."""
        ...


def format_reader(fmt: str) -> FormatReader:
    """The reader module of format ``fmt`` (visits, meds or omop)."""
    return cast(FormatReader, importlib.import_module(f"behrt_rope.etl.readers.{fmt}"))


@dataclass
class ShardSource:
    """An input directory planned once, then read shard by shard by the local engine: the plan (files,
    columns, schema checks), the reference tables (MEDS metadata, OMOP concepts) and the per-batch findings
    are the same for every shard, so they are taken once however many shards are read."""

    etl: EtlConfig
    reader: FormatReader
    plan: Plan
    lookups: Any
    facts: BatchFacts

    @classmethod
    def open(cls, input_dir: Path, etl: EtlConfig) -> ShardSource:
        """Plan ``input_dir`` in ``etl.format``; raises ``InputSchemaError`` before any row is read."""
        reader = format_reader(etl.format)
        plan = reader.plan(input_dir, etl)
        return cls(etl, reader, plan, reader.lookups(plan, etl), reader.facts(plan, etl))

    def read(self, shard: int, shards: int) -> RawTables:
        """Canonical tables of patient shard ``shard`` of ``shards`` (the rows of every file are streamed)."""
        data = source.gather(self.plan, self.reader.id_text, self.facts, shard, shards, self.lookups)
        return self.reader.build(data, self.etl)
