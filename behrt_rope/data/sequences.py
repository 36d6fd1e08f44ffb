"""The ETL's token dataset in memory: flat per-token arrays plus per-patient offsets (a ragged array).

Patient ``i``'s tokens are ``token_ids[offsets[i]:offsets[i + 1]]`` (and the same slice of ``ages``,
``segments``, ``visit_index``, ``visit_days`` and ``sex``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from behrt_rope import schema as S
from behrt_rope.errors import ArtifactError
from behrt_rope.etl.sex import UNKNOWN, sex_ids


@dataclass
class Sequences:
    """Token streams of some patients. Flat arrays have one entry per token."""

    patients: pd.DataFrame  # PATIENT_ID, SPLIT, BIRTH_DATE, DEATH_DATE, N_VISITS, N_TOKENS, LAST_EVENT_TIME, SEX,
    # N_THINNED_VISITS
    offsets: np.ndarray  # (N + 1,) int64
    token_ids: np.ndarray  # (M,) int64
    ages: np.ndarray  # (M,) float32, years
    segments: np.ndarray  # (M,) int64
    visit_index: np.ndarray  # (M,) int64
    visit_days: np.ndarray  # (M,) int64, days since 1970-01-01 of the token's visit
    sex: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int8))
    """(M,) int8, the patient's sex id (``behrt_rope.etl.sex.SEX_IDS``, 0 unknown) repeated on each of its
    tokens, so that batching treats it like any per-token field; left out: all unknown."""

    def __post_init__(self) -> None:
        if len(self.sex) != len(self.token_ids):
            if len(self.sex):
                raise ValueError(f"sex has {len(self.sex)} entries for {len(self.token_ids)} tokens")
            self.sex = np.zeros(len(self.token_ids), dtype=np.int8)

    def __len__(self) -> int:
        return len(self.patients)

    @property
    def thinned_visits(self) -> np.ndarray:
        """Per patient, how many of the stream's first visits hold only their codes' first records, (N,)."""
        if S.N_THINNED_VISITS not in self.patients.columns:
            return np.zeros(len(self.patients), dtype=np.int64)
        return self.patients[S.N_THINNED_VISITS].to_numpy().astype(np.int64)

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per patient, (N,)."""
        return np.diff(self.offsets)

    def select(self, rows: np.ndarray) -> Sequences:
        """The patients at ``rows`` (in that order), as a new compact ``Sequences``."""
        rows = np.asarray(rows, dtype=np.int64)
        lengths = self.lengths[rows]
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        take = ragged_positions(self.offsets[rows], lengths)
        return Sequences(
            self.patients.iloc[rows].reset_index(drop=True),
            offsets,
            self.token_ids[take],
            self.ages[take],
            self.segments[take],
            self.visit_index[take],
            self.visit_days[take],
            self.sex[take],
        )

    def split(self, name: str) -> Sequences:
        """Patients of one split (train, tuning or held_out)."""
        return self.select(np.flatnonzero(self.patients[S.SPLIT].to_numpy() == name))


def ragged_positions(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Flat positions ``start, start+1, ..., start+length-1`` for every (start, length), concatenated.

    >>> ragged_positions(np.array([10, 0]), np.array([2, 3])).tolist()
    [10, 11, 0, 1, 2]
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    ends = np.cumsum(lengths)
    base = np.repeat(np.asarray(starts, dtype=np.int64) - (ends - lengths), lengths)
    return base + np.arange(total, dtype=np.int64)


def from_table(table: pa.Table) -> Sequences:
    """Build ``Sequences`` from a table with the ``S.TOKENS`` schema."""
    meta_cols = [S.PATIENT_ID, S.SPLIT, S.BIRTH_DATE, S.DEATH_DATE, S.N_VISITS, S.N_TOKENS, S.LAST_EVENT_TIME]
    patients = table.select(meta_cols).to_pandas()
    patients[S.PATIENT_ID] = patients[S.PATIENT_ID].astype(object)
    # token datasets written before sex was read have no SEX column: every patient is 'unknown'
    sex = table.column(S.SEX).to_numpy(zero_copy_only=False) if S.SEX in table.column_names else None
    patients[S.SEX] = np.full(len(patients), UNKNOWN, dtype=object) if sex is None else sex.astype(object)
    # ... and those written before older visits could be thinned have none thinned
    thinned = table.column(S.N_THINNED_VISITS).to_numpy() if S.N_THINNED_VISITS in table.column_names else 0
    patients[S.N_THINNED_VISITS] = np.zeros(len(patients), dtype=np.int32) + thinned
    lengths = table.column(S.N_TOKENS).to_numpy().astype(np.int64)

    def flat(name: str, dtype: str) -> np.ndarray:
        column = table.column(name)
        values = [chunk.flatten() for chunk in column.chunks]
        if not values:
            return np.zeros(0, dtype=dtype)
        return np.asarray(pa.concat_arrays(values).to_numpy(zero_copy_only=False)).astype(dtype)

    days = flat(S.VISIT_DATES, "datetime64[us]").astype("datetime64[D]").astype(np.int64)
    return Sequences(
        patients=patients,
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        token_ids=flat(S.TOKEN_IDS, "int64"),
        ages=flat(S.AGES, "float32"),
        segments=flat(S.SEGMENTS, "int64"),
        visit_index=flat(S.VISIT_INDEX, "int64"),
        visit_days=days,
        sex=np.repeat(sex_ids(patients[S.SEX].to_numpy(dtype=object)), lengths),
    )


def load_tokens(etl_dir: str | Path) -> Sequences:
    """Read every ``tokens/part-*.parquet`` of an ETL output directory."""
    folder = Path(etl_dir) / S.TOKENS_DIR
    parts = sorted(folder.glob("part-*.parquet"))
    if not parts:
        raise ArtifactError(f"{etl_dir}: no token dataset found ({folder}/part-*.parquet); run `behrt-rope etl` first")
    table = pa.concat_tables([_read_part(p) for p in parts], promote_options="permissive")
    return from_table(table)


def _read_part(path: Path) -> pa.Table:
    """One token file with the ``S.TOKENS`` types; a file from before the SEX or N_THINNED_VISITS column is read
    without it."""
    names = set(pq.read_schema(path).names)
    schema = pa.schema([f for f in S.TOKENS if f.name in names or f.name not in (S.SEX, S.N_THINNED_VISITS)])
    return pq.read_table(path, schema=schema)


def load_vocabulary(etl_dir: str | Path) -> pd.DataFrame:
    """The ETL's vocabulary table (``token_id``, ``token``, ``train_count``)."""
    path = Path(etl_dir) / S.VOCAB_FILE
    if not path.exists():
        raise ArtifactError(f"{etl_dir}: {S.VOCAB_FILE} not found; run `behrt-rope etl` first")
    return pd.read_parquet(path)
