"""Which labels share one hidden-state chain in the state path: codes that travel together.

A condition often shows through more than one code: a symptom code early on and a diagnosis code once it is
established, both readings of one hidden stage. A chain per label re-learns that stage once per code, each
from half the evidence. Two label codes share a chain when, over the train patients, each is the other's most
correlated label code (presence anywhere in the history; the phi coefficient, Pearson's correlation of two
0/1 columns) and that correlation is at least ``min_correlation``; each keeps its own chance of being recorded
from each shared state. Found from the data alone: no code system or catalogue is consulted. On a progression
draw's tuning split a shared chain of 6 states lifted one set of chains alone from 0.1295 / 0.1280 to 0.1315 /
0.1304 macro AP (two seeds; docs/benchmarks.md, "Forty-seventh round").
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from behrt_rope.data.sequences import Sequences

PAIR_CORRELATION = 0.2
"""Default least correlation of two label codes' presence across patients for them to share a chain."""


def presence_correlation(seqs: Sequences, label_token_ids: np.ndarray) -> np.ndarray:
    """``(L, L)`` float64: the correlation across the patients of ``seqs`` of the presence of each pair of label
    codes (``label_token_ids`` ``(L,)``, -1 for none) anywhere in their histories; 0 where a code is on every
    patient's record or on none (no variance), and on the diagonal."""
    L, n = len(label_token_ids), len(seqs.offsets) - 1
    label_of_token = np.full(max(int(seqs.token_ids.max(initial=0)), int(label_token_ids.max(initial=0))) + 1, -1)
    known = label_token_ids >= 0
    label_of_token[label_token_ids[known]] = np.flatnonzero(known)
    patient = np.repeat(np.arange(n), np.diff(seqs.offsets))
    label = label_of_token[seqs.token_ids]
    hit = label >= 0
    presence = sp.csr_array((np.ones(int(hit.sum())), (patient[hit], label[hit])), shape=(n, L))
    presence.data[:] = 1.0  # duplicates summed: present or not
    together = (presence.T @ presence).toarray() / max(n, 1)  # (L, L) share of patients with both
    share = np.diag(together).copy()
    covariance = together - np.outer(share, share)
    spread = np.sqrt(share * (1 - share))
    scale = np.outer(spread, spread)
    with np.errstate(divide="ignore", invalid="ignore"):
        correlation = np.where(scale > 0, covariance / scale, 0.0)
    np.fill_diagonal(correlation, 0.0)
    return correlation


def paired_chains(
    seqs: Sequences, label_token_ids: np.ndarray, min_correlation: float = PAIR_CORRELATION
) -> np.ndarray:
    """``(L,)`` int64: the chain each label reads. Labels ``a < b`` that are each other's most correlated label
    code (:func:`presence_correlation`, at least ``min_correlation``) both read chain ``a``; every other label
    its own."""
    correlation = presence_correlation(seqs, np.asarray(label_token_ids, dtype=np.int64))
    chains = np.arange(len(correlation))
    if len(correlation) < 2:
        return chains
    best = correlation.argmax(1)
    for a, b in enumerate(best):
        if a < b and best[b] == a and correlation[a, b] >= min_correlation:
            chains[b] = a
    return chains
