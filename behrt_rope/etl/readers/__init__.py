"""Readers turn one input layout into canonical :class:`~behrt_rope.etl.raw.RawTables`, shard by shard.

Each reader module exposes ``read(input_dir, config, shard, n_shards) -> RawTables``.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Protocol

from behrt_rope.etl.config import EtlConfig
from behrt_rope.etl.raw import RawTables


class Reader(Protocol):
    def __call__(self, input_dir: Path, config: EtlConfig, shard: int, n_shards: int) -> RawTables: ...


def reader_for(fmt: str) -> Reader:
    """The ``read`` function of format ``fmt`` (visits, meds or omop)."""
    module = importlib.import_module(f"behrt_rope.etl.readers.{fmt}")
    reader: Reader = module.read
    return reader
