"""Hand-made time features of each sample's history, for the gradient-boosted reference model.

Per label code ``c`` (at the prediction time, i.e. the end of the sample's last input visit ``k``):

* ``ever``: ``c`` recorded at any visit ``<= k`` (0/1);
* ``n_visits``: number of visits ``<= k`` that recorded ``c``;
* ``visits_since``: ``k`` minus the last visit that recorded ``c`` (NaN if never);
* ``days_since``: days from that visit to visit ``k`` (NaN if never);
* ``years_since_first``: years from the first visit that recorded ``c`` to visit ``k`` (NaN if never);
* ``in_last``: ``c`` recorded at visit ``k`` itself (0/1);

plus four columns per sample: age at visit ``k`` (years), number of visits ``k + 1``, days since the
previous visit (NaN at the first visit) and the patient's sex id (``schema.SEX_VALUES`` position, 0 unknown).
Nothing here is specific to a cohort: these are what a data scientist would build by hand in an afternoon,
which is why the transformer must beat a model trained on them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from behrt_rope import schema as S
from behrt_rope.data.labels import Samples, visit_table
from behrt_rope.data.sequences import Sequences

PER_CODE = ("ever", "n_visits", "visits_since", "days_since", "years_since_first", "in_last")
PER_SAMPLE = ("age", "n_visits_total", "days_since_previous_visit", "sex")
DAYS_PER_YEAR = 365.25


@dataclass
class TimeFeatures:
    """Features of N samples over L label codes."""

    per_code: np.ndarray
    """(N, L, 6) float32, the :data:`PER_CODE` features of every label code."""
    per_sample: np.ndarray
    """(N, 4) float32, the :data:`PER_SAMPLE` features."""

    def __len__(self) -> int:
        return len(self.per_sample)

    def for_label(self, j: int) -> np.ndarray:
        """(N, 6 + L + 4) matrix for label ``j``'s model: its own six features, whether each label code was
        ever recorded (how the history relates to ``j``: parents, comorbidities), and the per-sample
        features. Keeping the other codes to one column each makes a model ~5x cheaper to fit than on every
        feature of every code, with the same information about label ``j`` itself."""
        ever = self.per_code[:, :, 0]  # (N, L)
        return np.concatenate([self.per_code[:, j, :], ever, self.per_sample], axis=1)

    def names_for_label(self, j: int, label_codes: list[str]) -> list[str]:
        """Column names of :meth:`for_label`.

        >>> f = TimeFeatures(np.zeros((1, 2, 6), np.float32), np.zeros((1, 4), np.float32))
        >>> f.names_for_label(1, ["E11", "I10"])[:2], f.names_for_label(1, ["E11", "I10"])[6:8]
        (['I10:ever', 'I10:n_visits'], ['E11:ever', 'I10:ever'])
        """
        own = [f"{label_codes[j]}:{name}" for name in PER_CODE]
        return own + [f"{code}:ever" for code in label_codes] + list(PER_SAMPLE)


def time_features(seqs: Sequences, samples: Samples, label_of_token: np.ndarray) -> TimeFeatures:
    """Features of each sample's input history (see the module docstring and :class:`TimeFeatures`).

    ``label_of_token`` ``(V,)`` maps a token id to its label column (-1: not a label), as
    ``behrt_rope.data.labels.label_index`` returns. Cost: O(visits x L) time and memory over ``seqs``.
    """
    n_labels = int(label_of_token.max()) + 1 if len(label_of_token) and label_of_token.max() >= 0 else 0
    visits = visit_table(seqs)  # one row per visit, ordered by patient then visit
    patient = visits["patient"].to_numpy()
    day = visits["day"].to_numpy().astype(np.float64)
    k = visits["k"].to_numpy()
    present = _presence(seqs, patient, len(visits), label_of_token, n_labels)  # (visits, L) bool
    first_row = np.searchsorted(patient, patient, side="left")  # (visits,) row of the patient's first visit
    row = np.arange(len(visits))
    count = _cumsum_by_patient(present.astype(np.int32), first_row)  # (visits, L)
    last = _forward_fill_rows(np.where(present, row[:, None], -1), first_row)  # (visits, L) row or -1
    first = _forward_fill_rows(np.where(present & (count == 1), row[:, None], -1), first_row)
    chosen = _sample_visit_rows(seqs, samples, visits["sep"].to_numpy())  # (N,) visit row of each sample
    never = last[chosen] < 0  # (N, L)
    last_c, first_c = np.maximum(last[chosen], 0), np.maximum(first[chosen], 0)
    now_k, now_day = k[chosen][:, None], day[chosen][:, None]
    per_code = np.stack(
        [
            count[chosen] > 0,
            count[chosen],
            np.where(never, np.nan, now_k - k[last_c]),
            np.where(never, np.nan, now_day - day[last_c]),
            np.where(never, np.nan, (now_day - day[first_c]) / DAYS_PER_YEAR),
            present[chosen],
        ],
        axis=-1,
    ).astype(np.float32)  # (N, L, 6)
    previous = np.where(row > first_row, day - day[np.maximum(row - 1, 0)], np.nan)
    sep_positions = visits["sep"].to_numpy()[chosen]
    sex = seqs.sex[sep_positions]
    per_sample = np.stack([seqs.ages[sep_positions], k[chosen] + 1, previous[chosen], sex], axis=1).astype(np.float32)
    return TimeFeatures(per_code, per_sample)


def _presence(
    seqs: Sequences, patient: np.ndarray, n_visits: int, label_of_token: np.ndarray, n_labels: int
) -> np.ndarray:
    """(visits, L) bool: label code recorded at the visit (visit rows as in ``visit_table``)."""
    token_patient = np.searchsorted(seqs.offsets, np.arange(len(seqs.token_ids)), side="right") - 1
    visit_start = np.searchsorted(patient, np.arange(len(seqs)), side="left")  # first visit row per patient
    column = label_of_token[seqs.token_ids]
    keep = (column >= 0) & (seqs.token_ids >= S.N_SPECIAL)
    visit_row = visit_start[token_patient[keep]] + seqs.visit_index[keep]
    out = np.zeros((n_visits, n_labels), dtype=bool)
    out[visit_row, column[keep]] = True
    return out


def _cumsum_by_patient(values: np.ndarray, first_row: np.ndarray) -> np.ndarray:
    """Running sum down the rows, restarting at each patient's first row. ``values`` (R, L)."""
    total = np.cumsum(values, axis=0)
    before = np.where(first_row[:, None] > 0, total[np.maximum(first_row - 1, 0)], 0)
    return np.asarray(total - before)


def _forward_fill_rows(marks: np.ndarray, first_row: np.ndarray) -> np.ndarray:
    """Latest marked row index at or above each row within the patient (-1 when none). ``marks`` (R, L)."""
    filled = np.maximum.accumulate(marks, axis=0)
    return np.where(filled >= first_row[:, None], filled, -1)


def _sample_visit_rows(seqs: Sequences, samples: Samples, sep: np.ndarray) -> np.ndarray:
    """The visit row (in ``visit_table`` order) whose [SEP] ends each sample's input."""
    end = seqs.offsets[samples.rows] + samples.cuts - 1  # flat position of the last input token, a [SEP]
    rows = np.searchsorted(sep, end)
    if len(rows) and (rows.max() >= len(sep) or not np.array_equal(sep[rows], end)):
        raise ValueError("every sample's input must end at a visit's [SEP]")
    return rows
