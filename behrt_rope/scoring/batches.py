"""Padded model inputs for scoring whole token streams, built with array indexing (no Python per patient).

Patients are sorted by length and cut into batches of at most ``max_tokens`` padded tokens (length
bucketing), so a batch pads only to the longest of similar lengths.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from behrt_rope import schema as S
from behrt_rope.data.batching import FIELDS
from behrt_rope.data.sequences import Sequences, ragged_positions


def length_buckets(lengths: np.ndarray, max_tokens: int, max_batch: int = 1024) -> list[np.ndarray]:
    """Row indices in ascending length order, cut so that ``rows * longest <= max_tokens`` (at least one
    row per batch) and ``rows <= max_batch``.

    >>> [b.tolist() for b in length_buckets(np.array([5, 1, 3, 2]), max_tokens=6)]
    [[1, 3], [2], [0]]
    """
    order = np.argsort(lengths, kind="stable")
    ordered = np.asarray(lengths)[order]
    batches: list[np.ndarray] = []
    start = 0
    while start < len(order):
        window = ordered[start : start + max_batch]
        padded = np.arange(1, len(window) + 1) * window  # tokens of a batch ending at each row (ascending)
        stop = start + max(1, int(np.searchsorted(padded, max_tokens, side="right")))
        batches.append(order[start:stop])
        start = stop
    return batches


def padded_batch(seqs: Sequences, rows: np.ndarray, score_last: bool) -> dict[str, torch.Tensor]:
    """The whole streams of patients ``rows`` as one padded batch.

    Returns token_ids / segments / visit_index (B, T) long, ages (B, T) float32 years, attention_mask
    (B, T) bool and, with ``score_last``, score_at (B, T) bool True at each stream's last token (the [SEP]
    that closes its last visit). T is the longest stream of the batch. Same values as
    ``pad_batch`` over ``VisitScoredDataset`` items cut at the full length.

    >>> seqs = Sequences(None, np.array([0, 3, 5]), np.array([1, 7, 2, 1, 2]), np.zeros(5, np.float32),
    ...                  np.zeros(5, int), np.array([0, 0, 0, 0, 0]), np.zeros(5, int))
    >>> b = padded_batch(seqs, np.array([1, 0]), score_last=True)
    >>> b["token_ids"].tolist(), b["score_at"].nonzero().tolist()
    ([[1, 2, 0], [1, 7, 2]], [[0, 1], [1, 2]])
    """
    lengths = seqs.lengths[rows]
    n, longest = len(rows), int(lengths.max())
    flat = ragged_positions(seqs.offsets[rows], lengths)  # every token of the batch, row by row
    row = np.repeat(np.arange(n), lengths)
    col = np.arange(len(flat)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    batch: dict[str, torch.Tensor] = {}
    for name in FIELDS:
        dtype = np.float32 if name == "ages" else np.int64
        out = np.full((n, longest), S.PAD_ID if name == "token_ids" else 0, dtype=dtype)
        out[row, col] = getattr(seqs, name)[flat]
        batch[name] = torch.from_numpy(out)
    mask = np.zeros((n, longest), dtype=bool)
    mask[row, col] = True
    batch["attention_mask"] = torch.from_numpy(mask)
    if score_last:
        score_at = np.zeros((n, longest), dtype=bool)
        score_at[np.arange(n), lengths - 1] = True
        batch["score_at"] = torch.from_numpy(score_at)
    return batch


def iter_batches(
    seqs: Sequences, max_tokens: int, score_last: bool, max_batch: int = 1024
) -> Iterator[tuple[np.ndarray, dict[str, torch.Tensor]]]:
    """(rows, padded batch) for every length bucket of ``seqs``; empty streams are skipped."""
    lengths = seqs.lengths
    for rows in length_buckets(lengths, max_tokens, max_batch):
        rows = rows[lengths[rows] > 0]
        if len(rows):
            yield rows, padded_batch(seqs, rows, score_last)
