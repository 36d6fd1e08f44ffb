"""Shared test helpers: write raw tables in the visits format, run the ETL, read its outputs back.

Generic on purpose: any test that needs a small raw cohort on disk (CSV or Parquet) or a finished ETL
directory can use these. Helpers are plain functions (usable inside hypothesis tests, where function-scoped
fixtures are not); the fixtures below wrap them with ``tmp_path``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from behrt_rope import config as config_lib
from behrt_rope import schema as S
from behrt_rope.etl.config import EtlConfig
from behrt_rope.etl.runner import run_etl


def write_table(directory: Path, name: str, frame: pd.DataFrame, fmt: str = "csv") -> Path:
    """Write ``frame`` as ``directory/name.csv`` (every value as text; None -> empty field) or ``.parquet``.

    Parquet keeps the frame's own column types, so tests can hand in int ids, floats or timestamps.
    """
    directory.mkdir(parents=True, exist_ok=True)
    if fmt == "csv":
        path = directory / f"{name}.csv"
        frame.to_csv(path, index=False)
    elif fmt == "parquet":
        path = directory / f"{name}.parquet"
        pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), path)
    else:
        raise ValueError(f"unknown format {fmt!r}")
    return path


def write_visits(
    directory: Path,
    patients: pd.DataFrame | list[dict[str, Any]],
    events: pd.DataFrame | list[dict[str, Any]],
    fmt: str = "csv",
) -> Path:
    """A visits-format input directory holding ``patients`` and ``events`` (frames or lists of row dicts)."""
    write_table(directory, S.PATIENTS_TABLE, _frame(patients, (S.PATIENT_ID, S.BIRTH_DATE)), fmt)
    write_table(directory, S.EVENTS_TABLE, _frame(events, (S.PATIENT_ID, S.DATE, S.CODE)), fmt)
    return directory


def _frame(rows: pd.DataFrame | list[dict[str, Any]], columns: tuple[str, ...]) -> pd.DataFrame:
    if isinstance(rows, pd.DataFrame):
        return rows
    return pd.DataFrame(rows) if rows else pd.DataFrame({c: pd.Series(dtype=object) for c in columns})


@dataclass
class EtlOutput:
    """A finished ETL directory, read back."""

    out: Path
    manifest: dict[str, Any]

    @property
    def tokens(self) -> pd.DataFrame:
        """All token parts, one row per patient, sorted by patient id (list columns as numpy arrays)."""
        table = pq.read_table(self.out / S.TOKENS_DIR)
        return table.to_pandas().sort_values(S.PATIENT_ID).reset_index(drop=True)

    @property
    def vocab(self) -> pd.DataFrame:
        return pd.read_parquet(self.out / S.VOCAB_FILE)

    @property
    def quarantine(self) -> pd.DataFrame:
        return pd.read_parquet(self.out / S.QUARANTINE_FILE)

    def token_strings(self, patient_id: str) -> list[str]:
        """One patient's token stream as token strings."""
        names = self.vocab.set_index("token_id")["token"]
        row = self.tokens.set_index(S.PATIENT_ID).loc[patient_id]
        return [names[i] for i in row[S.TOKEN_IDS]]

    def reasons(self) -> dict[int, str]:
        """Quarantine reason by source row, for a cohort written as single files."""
        q = self.quarantine
        return dict(zip(q[S.SOURCE_ROW].tolist(), q[S.REASON].tolist()))


def etl(input_dir: Path, out: Path, **settings: Any) -> EtlOutput:
    """Run the ETL library entry point with ``EtlConfig`` settings given as keyword arguments.

    Nested settings use a dict: ``etl(d, out, split={"train": 1.0, "tuning": 0.0, "held_out": 0.0})``.
    """
    overrides = [f"{k}={v}" for k, v in _flatten(settings)]
    config = config_lib.build(EtlConfig, {}, overrides)
    manifest = run_etl(input_dir, out, config, progress=False)
    return EtlOutput(out, json.loads(json.dumps(manifest, default=str)))


def _flatten(settings: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    items: list[tuple[str, Any]] = []
    for key, value in settings.items():
        if isinstance(value, dict):
            items.extend(_flatten(value, f"{prefix}{key}."))
        else:
            items.append((f"{prefix}{key}", "null" if value is None else value))
    return items


ALL_TRAIN = {"train": 1.0, "tuning": 0.0, "held_out": 0.0}
"""Split settings that put every patient in train (tests that look at tokens, not at splits)."""


@pytest.fixture
def visits_dir(tmp_path: Path) -> Callable[..., Path]:
    """``visits_dir(patients, events, fmt="csv")`` -> a fresh input directory under ``tmp_path``."""
    count = iter(range(1_000_000))

    def make(patients: Any, events: Any, fmt: str = "csv") -> Path:
        return write_visits(tmp_path / f"input{next(count)}", patients, events, fmt)

    return make


@pytest.fixture
def etl_run(tmp_path: Path, visits_dir: Callable[..., Path]) -> Callable[..., EtlOutput]:
    """``etl_run(patients, events, fmt="csv", **settings)`` -> the ETL output of that cohort."""
    count = iter(range(1_000_000))

    def go(patients: Any, events: Any, fmt: str = "csv", **settings: Any) -> EtlOutput:
        return etl(visits_dir(patients, events, fmt), tmp_path / f"out{next(count)}", **settings)

    return go
