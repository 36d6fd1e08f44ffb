"""Fine-tuning samples and multi-label targets for the tasks ``next_visit``, ``6m`` and ``12m``.

A sample is a patient at a prediction time: the end of one of their visits, visit ``k``. Its input is
the token stream up to and including visit ``k``'s [SEP], nothing later (no leakage). Its label is the set
of label-vocabulary codes recorded

* ``next_visit``: at visit ``k + 1``; a visit with no later visit gives no sample;
* ``6m`` / ``12m``: at any later visit dated at most ``horizon_days`` (183 / 365) days after visit ``k``'s
  date. Follow-up must reach the horizon: a sample is kept only if the patient's last recorded event is at
  least ``horizon_days`` after visit ``k``'s date; otherwise the window is not fully observed and the
  sample has no label (it is dropped, never counted as negative). A patient who died inside the window is
  therefore dropped too: the follow-up ended before the horizon.

Where the ETL thinned a long history's oldest visits to their codes' first records (``etl.keep_first_records``),
those visits are history only: prediction times are whole visits (every later visit is whole too), so no label
comes from a thinned visit and none skips the visits dropped between thinned ones.

Samples are taken at every eligible visit (``every_visit``) or at one random eligible visit per patient
(``random_visit``, as BEHRT did). Splits never mix: samples are built from one split's patients at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import pandas as pd

from behrt_rope import schema as S
from behrt_rope.data.sequences import Sequences, ragged_positions

HORIZON_DAYS = {"6m": 183, "12m": 365}


@dataclass
class TaskConfig:
    """Which samples and labels fine-tuning and evaluation use."""

    name: Literal["next_visit", "6m", "12m"] = "next_visit"
    """Prediction task: codes at the next visit, or within 6 or 12 months."""
    sampling: Literal["every_visit", "random_visit"] = "every_visit"
    """Prediction times: the end of every eligible visit, or one random eligible visit per patient."""
    min_history_visits: int = 1
    """A sample's input holds at least this many visits."""
    min_label_count: int | None = None
    """A code is a label if it occurs in at least this many train samples' label sets; null: adapt to the
    data (20, lowered for small cohorts to 1% of the train samples, at least 2)."""
    seed: int = 0
    """Seeds the random visit choice."""

    def __post_init__(self) -> None:
        if self.min_history_visits < 1:
            raise ValueError("min_history_visits must be >= 1")
        if self.min_label_count is not None and self.min_label_count < 1:
            raise ValueError("min_label_count must be >= 1")


@dataclass
class Samples:
    """Samples of one split. ``rows``: patient row in the Sequences; ``cuts``: input length in tokens;
    ``label_spans``: (N, 2) flat token positions [start, stop) whose codes are the label set;
    ``times``: prediction time (datetime64[D], the date of the last input visit)."""

    rows: np.ndarray
    cuts: np.ndarray
    label_spans: np.ndarray
    times: np.ndarray

    def __len__(self) -> int:
        return len(self.rows)

    def take(self, index: np.ndarray) -> Samples:
        """The samples at ``index`` (an integer array), in that order."""
        return Samples(self.rows[index], self.cuts[index], self.label_spans[index], self.times[index])


def subsample_index(n: int, limit: int, seed: int) -> np.ndarray:
    """Sorted positions of a seeded random subsample of at most ``limit`` of ``n`` items (all of them when
    ``n <= limit``).

    >>> subsample_index(3, 5, seed=0).tolist(), len(subsample_index(10, 4, seed=0))
    ([0, 1, 2], 4)
    """
    if n <= limit:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).choice(n, limit, replace=False))


def visit_table(seqs: Sequences) -> pd.DataFrame:
    """One row per visit: patient row, visit number k, flat position of its [SEP], its date (days)."""
    sep = np.flatnonzero(seqs.token_ids == S.SEP_ID)
    patient = np.searchsorted(seqs.offsets, sep, side="right") - 1
    return pd.DataFrame({"patient": patient, "k": seqs.visit_index[sep], "sep": sep, "day": seqs.visit_days[sep]})


def build_samples(seqs: Sequences, task: TaskConfig) -> Samples:
    """All samples of ``seqs`` for ``task`` (see the module docstring for the rules)."""
    visits = visit_table(seqs)
    patient = visits["patient"].to_numpy()
    sep = visits["sep"].to_numpy()
    day = visits["day"].to_numpy()
    n = len(visits)
    has_next = np.zeros(n, dtype=bool)
    has_next[:-1] = patient[1:] == patient[:-1]
    k = visits["k"].to_numpy()
    # a thinned visit holds only its first records, and the visits between it and the next one were dropped
    whole = k >= seqs.thinned_visits[patient]
    eligible = has_next & (k + 1 >= task.min_history_visits) & whole
    if task.name == "next_visit":
        last = np.minimum(np.arange(n) + 1, n - 1)
    else:
        horizon = HORIZON_DAYS[task.name]
        last_day = _last_event_days(seqs)[patient]
        eligible &= last_day - day >= horizon
        key = patient.astype(np.int64) * (1 << 32) + day  # days fit easily in 32 bits
        last = np.searchsorted(key, key + horizon, side="right") - 1
    label_spans = np.stack([sep + 1, sep[last]], axis=1)
    label_spans[:, 1] = np.maximum(label_spans[:, 1], label_spans[:, 0])  # empty window -> empty span
    chosen = np.flatnonzero(eligible)
    if task.sampling == "random_visit" and len(chosen):
        chosen = _one_per_patient(chosen, patient[chosen], task.seed)
    rows = patient[chosen]
    return Samples(
        rows=rows,
        cuts=sep[chosen] - seqs.offsets[rows] + 1,
        label_spans=label_spans[chosen],
        times=day[chosen].astype("datetime64[D]"),
    )


def _last_event_days(seqs: Sequences) -> np.ndarray:
    """Per patient, the day of the last recorded event (follow-up end)."""
    times = seqs.patients[S.LAST_EVENT_TIME].to_numpy("datetime64[us]")
    return times.astype("datetime64[D]").astype(np.int64)


def _one_per_patient(candidates: np.ndarray, patient: np.ndarray, seed: int) -> np.ndarray:
    """One random candidate per patient (deterministic for a seed)."""
    draw = np.random.default_rng(seed).random(len(candidates))
    order = np.lexsort((draw, patient))
    first = np.ones(len(order), dtype=bool)
    first[1:] = patient[order][1:] != patient[order][:-1]
    return np.sort(candidates[order[first]])


def span_pairs(seqs: Sequences, starts: np.ndarray, stops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sample index, token id) for every token in each sample's [start, stop) span."""
    lengths = np.maximum(stops - starts, 0)
    positions = ragged_positions(starts, lengths)
    return np.repeat(np.arange(len(starts)), lengths), seqs.token_ids[positions]


def fit_label_vocabulary(seqs: Sequences, samples: Samples, min_count: int) -> np.ndarray:
    """Token ids that are labels: codes present in >= ``min_count`` train samples' label sets (sorted)."""
    return np.flatnonzero(label_counts(seqs, samples) >= min_count).astype(np.int64)


AUTO_MAX_LABEL_COUNT = 20
AUTO_MIN_LABEL_COUNT = 2


def resolve_min_label_count(task: TaskConfig, n_train_samples: int) -> int:
    """The label threshold: the configured one, or (null) 20 lowered to 1% of the train samples, at least 2.

    >>> [resolve_min_label_count(TaskConfig(), n) for n in (50, 800, 5000)]
    [2, 8, 20]
    >>> resolve_min_label_count(TaskConfig(min_label_count=5), 50)
    5
    """
    if task.min_label_count is not None:
        return task.min_label_count
    return max(AUTO_MIN_LABEL_COUNT, min(AUTO_MAX_LABEL_COUNT, n_train_samples // 100))


def label_counts(seqs: Sequences, samples: Samples) -> np.ndarray:
    """(vocab ids,) number of samples whose label set holds each token id (0 for special tokens)."""
    sample, token = span_pairs(seqs, samples.label_spans[:, 0], samples.label_spans[:, 1])
    codes = token >= S.N_SPECIAL
    pairs = np.unique(np.stack([sample[codes], token[codes]], axis=1), axis=0)
    return np.bincount(pairs[:, 1], minlength=S.N_SPECIAL) if len(pairs) else np.zeros(S.N_SPECIAL, int)


def label_index(label_token_ids: np.ndarray, vocab_size: int) -> np.ndarray:
    """(vocab_size,) array mapping a token id to its label column, -1 for non-labels."""
    index = np.full(vocab_size, -1, dtype=np.int64)
    index[label_token_ids] = np.arange(len(label_token_ids))
    return index


def multi_hot(seqs: Sequences, starts: np.ndarray, stops: np.ndarray, label_of_token: np.ndarray) -> np.ndarray:
    """(N, L) bool: which label codes occur in each sample's span."""
    n_labels = int(label_of_token.max()) + 1 if len(label_of_token) else 0
    out = np.zeros((len(starts), n_labels), dtype=bool)
    sample, token = span_pairs(seqs, starts, stops)
    column = label_of_token[token]
    keep = column >= 0
    out[sample[keep], column[keep]] = True
    return out


def targets(seqs: Sequences, samples: Samples, label_of_token: np.ndarray) -> np.ndarray:
    """(N, L) bool label matrix of ``samples``."""
    return multi_hot(seqs, samples.label_spans[:, 0], samples.label_spans[:, 1], label_of_token)


def history(seqs: Sequences, samples: Samples, label_of_token: np.ndarray) -> np.ndarray:
    """(N, L) bool: label codes already recorded in each sample's input (for new-onset metrics)."""
    starts = seqs.offsets[samples.rows]
    return multi_hot(seqs, starts, starts + samples.cuts, label_of_token)
