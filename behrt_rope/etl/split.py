"""Deterministic patient-level splits and shards from a salted hash of the patient id."""

from __future__ import annotations

import hashlib

import numpy as np
import pandas as pd

from behrt_rope.etl.codes import factorize_text
from behrt_rope.etl.config import SplitConfig
from behrt_rope.schema import SPLITS


def patient_hash(patient_ids: np.ndarray | pd.api.extensions.ExtensionArray, salt: str) -> np.ndarray:
    """A uint64 per id, stable across runs, machines and row order (pandas' SipHash with a salted key).

    >>> a = patient_hash(np.array(["p1", "p2"], dtype=object), "s")
    >>> bool((a == patient_hash(np.array(["p1", "p2"], dtype=object), "s")).all())
    True
    """
    key = hashlib.md5(salt.encode()).hexdigest()[:16]
    codes, uniques = factorize_text(patient_ids, sort=False)  # each distinct id is hashed once
    return pd.util.hash_array(uniques, hash_key=key, categorize=False)[codes]


def assign_splits(patient_ids: np.ndarray, config: SplitConfig) -> np.ndarray:
    """Split name per patient: the hash, scaled to [0, 1), falls into one of the cumulative shares.

    >>> ids = np.array([f"p{i}" for i in range(10_000)], dtype=object)
    >>> splits = assign_splits(ids, SplitConfig(train=0.8, tuning=0.1, held_out=0.1))
    >>> round(float((splits == "train").mean()), 2)
    0.8
    """
    unit = (patient_hash(patient_ids, "split:" + config.salt) >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    edges = np.cumsum([config.train, config.tuning])
    index = np.searchsorted(edges, unit, side="right")
    return np.asarray(SPLITS, dtype=object)[np.minimum(index, len(SPLITS) - 1)]


def shard_of(patient_ids: np.ndarray | pd.api.extensions.ExtensionArray, n_shards: int) -> np.ndarray:
    """Shard number in [0, n_shards) per patient id; independent of the split draw."""
    if n_shards == 1:
        return np.zeros(len(patient_ids), dtype=np.int64)
    return (patient_hash(patient_ids, "shard") % np.uint64(n_shards)).astype(np.int64)
