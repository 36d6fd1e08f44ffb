"""Discrimination metrics for multi-label risk scores: AP and AUROC (micro, macro, per sample), per-code
tables with bootstrap intervals, and precision/recall at k.

Conventions shared by every function here:

* ``y_true`` is an (N, L) array of 0/1 (or bool): N samples (a patient at a prediction time) by L codes.
* ``y_score`` is an (N, L) array of finite floats (probabilities in [0, 1]; only their order matters here).
* ``mask`` (optional) is an (N, L) bool array selecting the (sample, code) pairs that count; the others are
  ignored entirely, as if absent. New-onset metrics use ``mask = ~history``.
* AP is sklearn's ``average_precision_score`` (step-wise, no interpolation); AUROC is sklearn's
  ``roc_auc_score`` (ties count one half). Both are undefined (NaN) for a set of pairs without at least one
  positive and one negative.
* Every metric uses ``_Ranked``, a vectorised numpy implementation of the same two formulas with sample
  weights (per column: per code or per sample; or over the pooled pairs); the tests check it against
  sklearn. It exists because one sklearn call costs about 10 ms at N = 20,000, so L codes times hundreds
  of bootstrap replicates would take hours; a replicate here is one pass over the (N, L) arrays.
* Bootstrap: samples (rows) are resampled with replacement, i.e. each replicate gives every row a
  multinomial count; the 95 % interval is the 2.5th and 97.5th percentile of the replicate values, NaN
  replicates (metric undefined in that resample) left out. The same ``seed`` and N give the same counts, so
  two models scored on the same rows get paired replicates.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np
import pandas as pd
from numpy.typing import ArrayLike

from behrt_rope import schema

CI_LEVEL = 0.95
_CELL_BUDGET = 2_000_000  # (rows x columns) cells per vectorised chunk: bounds memory at ~150 MB
HEADLINE_METRICS = ("micro_ap", "macro_ap", "samples_ap", "micro_auroc", "macro_auroc", "samples_auroc")


# ---------------------------------------------------------------------------------------------------------
# Input checks
# ---------------------------------------------------------------------------------------------------------
def check_inputs(
    y_true: ArrayLike, y_score: ArrayLike, mask: ArrayLike | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Validate and convert: returns y_true as bool (N, L), y_score as float64 (N, L), mask as bool or None."""
    y = np.asarray(y_true)
    s = np.asarray(y_score, dtype=np.float64)
    if y.ndim != 2 or s.shape != y.shape:
        raise ValueError(f"y_true and y_score must be 2-D of equal shape, got {y.shape} and {s.shape}")
    if y.dtype != bool and not np.isin(y, (0, 1)).all():
        raise ValueError("y_true must hold only 0 and 1")
    if not np.isfinite(s).all():
        raise ValueError("y_score must be finite")
    m = None
    if mask is not None:
        m = np.asarray(mask, dtype=bool)
        if m.shape != y.shape:
            raise ValueError(f"mask shape {m.shape} differs from y_true shape {y.shape}")
    return y.astype(bool), s, m


# ---------------------------------------------------------------------------------------------------------
# Vectorised, weighted AP and AUROC per column
# ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Ranked:
    """Columns sorted once by descending score, then scored for any row weights in about two passes.

    ``rows`` (C, N) holds, for each column, the weight slot at each rank (``n_weights``, a zero-weight slot,
    where the mask drops the pair). The running weight sum of a column is only needed at the tie-block boundaries of its
    positives (sklearn's thresholds are the distinct scores), so a replicate sums the weights between
    those ``cuts`` (flat positions in the (C, N) layout) with ``np.add.reduceat`` instead of a full cumsum.
    The other arrays describe the P selected positives, ordered by (column, rank): their column, their
    row, indices into the cuts (block start, block end + 1) and indices among the positives (first and
    last positive of their block, first of their column).
    """

    n_weights: int
    rows: np.ndarray
    cuts: np.ndarray
    col_start: np.ndarray
    col_stop: np.ndarray
    col: np.ndarray
    row: np.ndarray
    block_start: np.ndarray
    block_stop: np.ndarray
    first_in_block: np.ndarray
    last_in_block: np.ndarray
    first_in_col: np.ndarray

    @classmethod
    def build(
        cls,
        y: np.ndarray,
        s: np.ndarray,
        mask: np.ndarray | None,
        groups: np.ndarray | None = None,
        n_weights: int | None = None,
    ) -> _Ranked:
        """Rank (N, C) labels ``y`` by scores ``s``; ``groups`` (N,) maps rows to weight slots in
        ``range(n_weights)`` (default: row i has weight i, n_weights = N)."""
        n, c = y.shape
        n_weights = n if n_weights is None else n_weights
        order = np.argsort(-s, axis=0, kind="stable")
        ranked = np.take_along_axis(s, order, axis=0)
        rank = np.arange(n)[:, None]
        new = np.ones(ranked.shape, dtype=bool)
        new[1:] = ranked[1:] != ranked[:-1]
        last = np.ones(ranked.shape, dtype=bool)
        last[:-1] = new[1:]
        start = np.maximum.accumulate(np.where(new, rank, 0), axis=0)
        end = np.minimum.accumulate(np.where(last, rank, n - 1)[::-1], axis=0)[::-1]
        positive = np.take_along_axis(y, order, axis=0)
        if mask is not None:
            keep = np.take_along_axis(mask, order, axis=0)
            positive &= keep
        if groups is not None:
            order = groups[order]
        if mask is not None:
            order = np.where(keep, order, n_weights)
        col, rank_p = np.nonzero(positive.T)
        block = start[rank_p, col]
        col_at = np.arange(c) * n
        lo, hi = col * n + block, col * n + end[rank_p, col] + 1
        cuts = np.unique(np.concatenate([col_at, lo, hi]))
        cuts = cuts[cuts < n * c]
        new_block = _boundaries(len(col), col, block)
        return cls(
            n_weights=n_weights,
            rows=np.ascontiguousarray(order.T),
            cuts=cuts,
            col_start=np.searchsorted(cuts, col_at),
            col_stop=np.searchsorted(cuts, col_at + n),
            col=col,
            row=order.T[col, rank_p],
            block_start=np.searchsorted(cuts, lo),
            block_stop=np.searchsorted(cuts, hi),
            first_in_block=_run_starts(new_block),
            last_in_block=_run_ends(new_block),
            first_in_col=_run_starts(_boundaries(len(col), col)),
        )

    def scores(self, weights: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(AP (C,), AUROC (C,)) with weights (n_weights,) (None: all 1); NaN where undefined."""
        c, n = self.rows.shape
        if n * c == 0:
            return np.full(c, np.nan), np.full(c, np.nan)
        w = np.ones(self.n_weights) if weights is None else np.asarray(weights, np.float64)
        w = np.append(w, 0.0)  # the slot of unselected pairs
        running = np.concatenate([[0.0], np.cumsum(np.add.reduceat(w[self.rows].ravel(), self.cuts))])
        base = running[self.col_start]  # weight before each column; running sums are exact integers
        total = running[self.col_stop] - base
        wp = w[self.row]
        inclusive = np.cumsum(wp)
        exclusive = inclusive - wp
        col_base = exclusive[self.first_in_col]
        tp_end = inclusive[self.last_in_block] - col_base
        called_end = running[self.block_stop] - base[self.col]  # weight ranked at or above the block
        fp_end = called_end - tp_end
        fp_before = running[self.block_start] - base[self.col] - (exclusive[self.first_in_block] - col_base)
        n_pos = np.bincount(self.col, wp, minlength=c)
        n_neg = total - n_pos
        precision = np.divide(tp_end, called_end, out=np.zeros_like(tp_end), where=called_end > 0)
        undefined = (n_pos == 0) | (n_neg == 0)
        with np.errstate(divide="ignore", invalid="ignore"):
            ap = np.bincount(self.col, wp * precision, minlength=c) / n_pos
            below = n_neg[self.col] - 0.5 * (fp_end + fp_before)  # negatives ranked below, ties half
            auroc = np.bincount(self.col, wp * below, minlength=c) / (n_pos * n_neg)
        ap[undefined] = np.nan
        auroc[undefined] = np.nan
        return ap, auroc


def _boundaries(n: int, *keys: np.ndarray) -> np.ndarray:
    """(n,) bool: True where any key differs from the previous element (and at 0): runs of equal keys."""
    new = np.zeros(n, dtype=bool)
    new[:1] = True
    for key in keys:
        new[1:] |= key[1:] != key[:-1]
    return new


def _run_starts(new: np.ndarray) -> np.ndarray:
    """Index of the first element of each element's run, given the run boundaries ``new``."""
    idx = np.arange(len(new))
    return np.maximum.accumulate(np.where(new, idx, 0)) if len(new) else idx


def _run_ends(new: np.ndarray) -> np.ndarray:
    """Index of the last element of each element's run, given the run boundaries ``new``."""
    idx = np.arange(len(new))
    if not len(new):
        return idx
    last = np.ones(len(new), dtype=bool)
    last[:-1] = new[1:]
    return np.minimum.accumulate(np.where(last, idx, len(new) - 1)[::-1])[::-1]


def _column_chunks(n_rows: int, n_cols: int) -> Iterator[slice]:
    step = max(1, _CELL_BUDGET // max(n_rows, 1))
    for lo in range(0, n_cols, step):
        yield slice(lo, min(lo + step, n_cols))


def per_column_scores(
    y_true: ArrayLike,
    y_score: ArrayLike,
    mask: ArrayLike | None = None,
    weights: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """AP and AUROC of every column, each (L,), NaN where the column lacks a positive or a negative.

    Equal to sklearn's ``average_precision_score`` / ``roc_auc_score`` on the column's selected rows with
    ``sample_weight=weights``. Pass transposed arrays to score every row (sample) instead.
    """
    y, s, m = check_inputs(y_true, y_score, mask)
    ap = np.full(y.shape[1], np.nan)
    auroc = np.full(y.shape[1], np.nan)
    for cols in _column_chunks(*y.shape):
        ranked = _Ranked.build(y[:, cols], s[:, cols], None if m is None else m[:, cols])
        ap[cols], auroc[cols] = ranked.scores(weights)
    return ap, auroc


# ---------------------------------------------------------------------------------------------------------
# Point estimates
# ---------------------------------------------------------------------------------------------------------
def _pooled(y: np.ndarray, s: np.ndarray, m: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    return (y.ravel(), s.ravel()) if m is None else (y[m], s[m])


def _nanmean(values: np.ndarray) -> float:
    return float(np.mean(values[~np.isnan(values)])) if (~np.isnan(values)).any() else np.nan


def summary_metrics(y_true: ArrayLike, y_score: ArrayLike, mask: ArrayLike | None = None) -> dict:
    """Headline AP and AUROC of (N, L) scores, three ways, with the counts needed to read them.

    * ``micro_*``: all selected (sample, code) pairs pooled into one ranking.
    * ``macro_*``: unweighted mean over codes of the code's metric on its selected samples, over the
      ``n_codes_macro`` codes with at least one positive and one negative there (``n_codes_excluded``
      others are left out, not counted as 0).
    * ``samples_*``: BEHRT's per-patient average: mean over samples of the sample's metric over its
      selected codes, over the ``n_samples_evaluable`` samples with at least one positive and one negative.

    Also: ``n_samples`` (N), ``n_codes`` (L), ``n_pairs`` (selected pairs), ``n_positive_pairs``,
    ``label_cardinality`` (mean positives per sample, selected pairs only) and ``label_density``
    (positive share of the selected pairs). Undefined metrics are NaN.

    >>> m = summary_metrics([[1, 0], [0, 1], [1, 0]], [[0.9, 0.2], [0.3, 0.6], [0.4, 0.1]])
    >>> round(m["macro_ap"], 3), m["n_codes_macro"], m["samples_auroc"]
    (1.0, 2, 1.0)
    """
    return summary_and_replicates(y_true, y_score, mask, n_bootstrap=0)[0]


# ---------------------------------------------------------------------------------------------------------
# Bootstrap
# ---------------------------------------------------------------------------------------------------------
def bootstrap_counts(n_samples: int, n_bootstrap: int, seed: int, clusters: ArrayLike | None = None) -> np.ndarray:
    """(n_bootstrap, n_samples) float counts: how often each row is drawn in each resample of n rows; with
    ``clusters`` (n_samples,) (a patient id per row, say), whole clusters are drawn with replacement, as
    many as there are, and each row counts as often as its cluster (rows of one patient are not independent).

    >>> counts = bootstrap_counts(5, 3, seed=0, clusters=["a", "a", "b", "c", "c"])
    >>> bool((counts[:, 0] == counts[:, 1]).all() and (counts[:, 3] == counts[:, 4]).all())
    True
    """
    rng = np.random.default_rng(seed)
    if n_samples == 0:
        return np.zeros((n_bootstrap, 0))
    if clusters is None:
        return rng.multinomial(n_samples, np.full(n_samples, 1.0 / n_samples), size=n_bootstrap).astype(float)
    ids, row_cluster = np.unique(np.asarray(clusters), return_inverse=True)
    if row_cluster.shape != (n_samples,):
        raise ValueError(f"{row_cluster.size} cluster ids for {n_samples} rows")
    drawn = rng.multinomial(len(ids), np.full(len(ids), 1.0 / len(ids)), size=n_bootstrap).astype(float)
    return drawn[:, row_cluster]


def bootstrap_replicates(
    y_true: ArrayLike,
    y_score: ArrayLike,
    mask: ArrayLike | None = None,
    n_bootstrap: int = 200,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Replicate values of every metric, resampling rows (samples) with replacement.

    Returns ``per_code_ap`` and ``per_code_auroc`` (B, L) (NaN where the code has no positive or no
    negative among the drawn samples) and the headline metrics (B,) named as in ``summary_metrics``
    (``micro_ap`` ...). A replicate's macro value averages the same codes as the point estimate (those
    defined on all samples); a code undefined in a replicate (its few positives not drawn) counts with
    its full-sample value, so the averaged set does not change between replicates (dropping such codes,
    which tend to score low, would shift the macro replicates upwards). Cost: a pass over the (N, L)
    arrays per replicate for the per-code values and another for the pooled ones.

    Note: resampling duplicates positives, which raises AP a little for codes with few positives, so
    AP intervals of rare codes are skewed upwards; AUROC is not affected this way.
    """
    return summary_and_replicates(y_true, y_score, mask, n_bootstrap, seed)[1]


def summary_and_replicates(
    y_true: ArrayLike,
    y_score: ArrayLike,
    mask: ArrayLike | None = None,
    n_bootstrap: int = 200,
    seed: int = 0,
    clusters: ArrayLike | None = None,
) -> tuple[dict, dict[str, np.ndarray]]:
    """``(summary_metrics(...), bootstrap_replicates(...))`` from one ranking of each kind: the scores are
    sorted once per code, once pooled and once per sample, and the point estimates and every replicate are
    read off those rankings (the pooled N x L pairs are the largest ranking at hundreds of codes). With
    ``clusters`` (N,), the replicates resample whole clusters (:func:`bootstrap_counts`)."""
    y, s, m = check_inputs(y_true, y_score, mask)
    counts = bootstrap_counts(y.shape[0], n_bootstrap, seed, clusters)
    code_ap = np.full((n_bootstrap, y.shape[1]), np.nan)
    code_auroc = np.full_like(code_ap, np.nan)
    point_ap = np.full(y.shape[1], np.nan)
    point_auroc = np.full(y.shape[1], np.nan)
    for cols in _column_chunks(*y.shape):
        ranked = _Ranked.build(y[:, cols], s[:, cols], None if m is None else m[:, cols])
        point_ap[cols], point_auroc[cols] = ranked.scores()
        for b in range(n_bootstrap):
            code_ap[b, cols], code_auroc[b, cols] = ranked.scores(counts[b])
    sample_ap, sample_auroc = per_column_scores(y.T, s.T, _t(m))
    micro, reps = _micro_replicates(y, s, m, counts)
    reps.update(
        per_code_ap=code_ap,
        per_code_auroc=code_auroc,
        samples_ap=_weighted_means(sample_ap, counts),
        samples_auroc=_weighted_means(sample_auroc, counts),
        macro_ap=_macro_replicates(code_ap, point_ap),
        macro_auroc=_macro_replicates(code_auroc, point_auroc),
    )
    summary = _summary(y, m, micro, (point_ap, point_auroc), (sample_ap, sample_auroc))
    return summary, reps


def macro_ap_and_replicates(
    y_true: ArrayLike, y_score: ArrayLike, n_bootstrap: int = 200, seed: int = 0, clusters: ArrayLike | None = None
) -> tuple[float, np.ndarray]:
    """Macro AP and its ``(B,)`` bootstrap replicates alone: ``summary_and_replicates``'s ``macro_ap``, the same
    resamples (the same ``seed`` and ``clusters`` give the same replicates), without the pooled and per-sample
    rankings, which cost most of its time at thousands of samples (the pooled N x L pairs are re-weighed per
    replicate). For choices that read macro AP only (``training.clear_gain``)."""
    y, s, _ = check_inputs(y_true, y_score, None)
    counts = bootstrap_counts(y.shape[0], n_bootstrap, seed, clusters)
    code_ap = np.full((n_bootstrap, y.shape[1]), np.nan)
    point_ap = np.full(y.shape[1], np.nan)
    for cols in _column_chunks(*y.shape):
        ranked = _Ranked.build(y[:, cols], s[:, cols], None)
        point_ap[cols] = ranked.scores()[0]
        for b in range(n_bootstrap):
            code_ap[b, cols] = ranked.scores(counts[b])[0]
    return _nanmean(point_ap), _macro_replicates(code_ap, point_ap)


def _summary(
    y: np.ndarray,
    m: np.ndarray | None,
    micro: tuple[float, float],
    per_code: tuple[np.ndarray, np.ndarray],
    per_sample: tuple[np.ndarray, np.ndarray],
) -> dict:
    """``summary_metrics``'s dict from the point values: micro (AP, AUROC), per-code (L,) and per-sample (N,)
    (AP, AUROC) arrays, NaN where undefined."""
    selected = np.ones(y.shape, dtype=bool) if m is None else m
    n_codes_macro = int((~np.isnan(per_code[0])).sum())
    n_pos = int((y & selected).sum())
    n_pairs = int(selected.sum())
    return {
        "micro_ap": micro[0],
        "macro_ap": _nanmean(per_code[0]),
        "samples_ap": _nanmean(per_sample[0]),
        "micro_auroc": micro[1],
        "macro_auroc": _nanmean(per_code[1]),
        "samples_auroc": _nanmean(per_sample[1]),
        "n_samples": int(y.shape[0]),
        "n_codes": int(y.shape[1]),
        "n_codes_macro": n_codes_macro,
        "n_codes_excluded": int(y.shape[1] - n_codes_macro),
        "n_samples_evaluable": int((~np.isnan(per_sample[0])).sum()),
        "n_pairs": n_pairs,
        "n_positive_pairs": n_pos,
        "label_cardinality": n_pos / y.shape[0] if y.shape[0] else np.nan,
        "label_density": n_pos / n_pairs if n_pairs else np.nan,
    }


def _macro_replicates(replicates: np.ndarray, point: np.ndarray) -> np.ndarray:
    """(B,) means over the codes defined in ``point`` (L,), undefined replicate values replaced by it."""
    defined = ~np.isnan(point)
    if not defined.any():
        return np.full(replicates.shape[0], np.nan)
    values = replicates[:, defined]
    return np.where(np.isnan(values), point[defined], values).mean(axis=1)


def _micro_replicates(
    y: np.ndarray, s: np.ndarray, m: np.ndarray | None, counts: np.ndarray
) -> tuple[tuple[float, float], dict[str, np.ndarray]]:
    """Pooled (micro) ``(AP, AUROC)`` and their replicates ``{"micro_ap", "micro_auroc"}`` (B,) from one
    ranking of the selected pairs, each pair weighted by its row's count."""
    rows = np.broadcast_to(np.arange(y.shape[0])[:, None], y.shape)
    yp, sp = _pooled(y, s, m)
    rows_p = rows.ravel() if m is None else rows[m]
    ranked = _Ranked.build(yp[:, None], sp[:, None], None, groups=rows_p, n_weights=y.shape[0])
    ap, auroc = (float(v[0]) for v in ranked.scores())
    values = np.array([[v[0] for v in ranked.scores(c)] for c in counts]).reshape(-1, 2)
    return (ap, auroc), {"micro_ap": values[:, 0], "micro_auroc": values[:, 1]}


def _weighted_means(per_sample: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """(B,) count-weighted means of the defined per-sample values (N,) (BEHRT's per-sample average)."""
    defined = ~np.isnan(per_sample)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.asarray(counts[:, defined] @ per_sample[defined] / counts[:, defined].sum(axis=1))


def _t(mask: np.ndarray | None) -> np.ndarray | None:
    return None if mask is None else mask.T


def percentile_interval(
    replicates: ArrayLike, level: float = CI_LEVEL, point: float | None = None
) -> tuple[float, float]:
    """(low, high) bootstrap interval of 1-D replicate values, NaN replicates left out (NaN if none).

    Without ``point``: the plain percentile interval. With the full-sample estimate ``point``: Efron's
    bias-corrected (BC) percentile interval. Resampling duplicates positives, which raises the AP of codes
    with few positives, so AP replicates sit above their estimate and a plain percentile interval of macro
    AP can lie wholly above it; BC moves both percentiles by the replicates' median bias ``z0 =
    Phi^-1(share of replicates below the point)``, to ``Phi(2 z0 -+ z)``. ``z0`` is clipped to +-``z``
    (the (1 - level)/2 quantile of the normal), so the point stays inside unless it lies beyond every
    replicate, in which case the interval is stretched to it. Unbiased replicates (half below the point)
    give the plain percentile interval.

    >>> [round(v, 6) for v in percentile_interval(np.arange(101.0), 0.9)]
    [5.0, 95.0]
    >>> low, high = percentile_interval(np.arange(101.0) + 10, 0.9, point=10.0)
    >>> bool(low <= 10.0 <= high), low == 10.0
    (True, True)
    """
    values = np.asarray(replicates, dtype=float).ravel()
    values = values[~np.isnan(values)]
    if values.size == 0:
        return np.nan, np.nan
    low, high = np.quantile(values, _interval_quantiles(values, level, point))
    if point is not None and np.isfinite(point):
        low, high = min(low, point), max(high, point)
    return float(low), float(high)


def _interval_quantiles(values: np.ndarray, level: float, point: float | None) -> np.ndarray:
    """(2,) quantile levels of the (BC) percentile interval of non-NaN ``values`` around ``point``."""
    if point is None or not np.isfinite(point):
        return np.array([0.5 - level / 2, 0.5 + level / 2])
    normal = NormalDist()
    z = normal.inv_cdf(0.5 + level / 2)
    below = (np.count_nonzero(values < point) + 0.5 * np.count_nonzero(values == point)) / values.size
    z0 = normal.inv_cdf(min(max(below, 1e-12), 1 - 1e-12))
    z0 = min(max(z0, -z), z)
    return np.array([normal.cdf(2 * z0 - z), normal.cdf(2 * z0 + z)])


def percentile_intervals(
    replicates: np.ndarray, level: float = CI_LEVEL, point: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Column-wise (low (C,), high (C,)) of (B, C) replicates, NaN replicates left out, NaN if none;
    bias-corrected around ``point`` (C,) when given (see :func:`percentile_interval`)."""
    values = np.asarray(replicates, dtype=float)
    low = np.full(values.shape[1], np.nan)
    high = np.full(values.shape[1], np.nan)
    for c in range(values.shape[1]):
        low[c], high[c] = percentile_interval(values[:, c], level, None if point is None else float(point[c]))
    return low, high


def bootstrap_ci(
    y_true: ArrayLike,
    y_score: ArrayLike,
    mask: ArrayLike | None = None,
    n_bootstrap: int = 200,
    seed: int = 0,
    level: float = CI_LEVEL,
) -> dict[str, tuple[float, float]]:
    """Bias-corrected percentile bootstrap interval (low, high) of each headline metric of
    ``summary_metrics`` (see :func:`percentile_interval`).

    Keys: ``micro_ap``, ``macro_ap``, ``samples_ap``, ``micro_auroc``, ``macro_auroc``, ``samples_auroc``.
    Reproducible: the same inputs and seed give the same intervals.
    """
    point, reps = summary_and_replicates(y_true, y_score, mask, n_bootstrap, seed)
    return {name: percentile_interval(reps[name], level, point[name]) for name in HEADLINE_METRICS}


# ---------------------------------------------------------------------------------------------------------
# Per-code table
# ---------------------------------------------------------------------------------------------------------
PER_CODE_COLUMNS = (
    schema.CODE,
    "n_positive",
    "n_samples",
    "prevalence",
    "ap",
    "ap_low",
    "ap_high",
    "auroc",
    "auroc_low",
    "auroc_high",
)


def per_code_frame(
    y_true: ArrayLike,
    y_score: ArrayLike,
    label_codes: Sequence[str],
    replicates: dict[str, np.ndarray] | None = None,
    mask: ArrayLike | None = None,
    level: float = CI_LEVEL,
) -> pd.DataFrame:
    """``per_code_table`` from precomputed ``bootstrap_replicates`` (None: intervals left NaN)."""
    y, s, m = check_inputs(y_true, y_score, mask)
    if len(label_codes) != y.shape[1]:
        raise ValueError(f"{len(label_codes)} label codes for {y.shape[1]} columns")
    selected = np.ones(y.shape, dtype=bool) if m is None else m
    n_samples = selected.sum(axis=0)
    n_positive = (y & selected).sum(axis=0)
    ap, auroc = per_column_scores(y, s, m)
    frame = pd.DataFrame(
        {
            schema.CODE: [str(c) for c in label_codes],
            "n_positive": n_positive.astype(int),
            "n_samples": n_samples.astype(int),
            "prevalence": np.divide(n_positive, n_samples, out=np.full(len(ap), np.nan), where=n_samples > 0),
            "ap": ap,
            "auroc": auroc,
        }
    )
    for name in ("ap", "auroc"):
        if replicates is None:
            low = high = np.full(len(ap), np.nan)
        else:
            low, high = percentile_intervals(replicates[f"per_code_{name}"], level, frame[name].to_numpy())
        frame[f"{name}_low"], frame[f"{name}_high"] = low, high
    frame = frame.sort_values(["prevalence", schema.CODE], ascending=[False, True], kind="stable")
    return frame.loc[:, list(PER_CODE_COLUMNS)].reset_index(drop=True)


def per_code_table(
    y_true: ArrayLike,
    y_score: ArrayLike,
    label_codes: Sequence[str],
    n_bootstrap: int = 200,
    seed: int = 0,
    mask: ArrayLike | None = None,
) -> pd.DataFrame:
    """One row per code, most prevalent first, with 95 % bootstrap intervals.

    Columns: ``code``, ``n_positive`` and ``n_samples`` (selected samples), ``prevalence``
    (n_positive / n_samples), ``ap``, ``ap_low``, ``ap_high``, ``auroc``, ``auroc_low``, ``auroc_high``.
    AP and AUROC are NaN for a code without both a positive and a negative among its selected samples;
    intervals resample samples (rows) with replacement ``n_bootstrap`` times (0: no intervals).
    """
    reps = bootstrap_replicates(y_true, y_score, mask, n_bootstrap, seed) if n_bootstrap > 0 else None
    return per_code_frame(y_true, y_score, label_codes, reps, mask)


# ---------------------------------------------------------------------------------------------------------
# Ranking metrics
# ---------------------------------------------------------------------------------------------------------
def precision_recall_at_k(
    y_true: ArrayLike,
    y_score: ArrayLike,
    ks: Sequence[int] = (1, 5, 10),
    mask: ArrayLike | None = None,
) -> dict[str, float]:
    """Mean precision@k and recall@k over samples, for each k in ``ks``.

    Conventions: each sample's codes are ranked by score (ties: the earlier column first); the top k are
    its "predicted" codes, with k capped at L. ``precision@k`` = positives in the top k / k, averaged over
    all N samples (a sample without positives scores 0). ``recall@k`` = positives in the top k / the
    sample's positives, averaged over the ``n_samples_with_positive`` samples with at least one positive.
    With a mask, unselected pairs are never ranked and never count as positives (a sample with fewer than
    k selected codes still divides by k).

    >>> r = precision_recall_at_k([[1, 0, 1], [0, 0, 1]], [[0.9, 0.8, 0.1], [0.2, 0.3, 0.4]], ks=(1, 2))
    >>> r["precision@1"], r["recall@1"], r["precision@2"], r["recall@2"]
    (1.0, 0.75, 0.5, 0.75)
    """
    y, s, m = check_inputs(y_true, y_score, mask)
    if m is not None:
        y = y & m
        s = np.where(m, s, -np.inf)
    n_positive = y.sum(axis=1)
    has_pos = n_positive > 0
    order = np.argsort(-s, axis=1, kind="stable")
    hits = np.cumsum(np.take_along_axis(y, order, axis=1), axis=1)
    out: dict[str, float] = {}
    for k in ks:
        kk = min(int(k), y.shape[1])
        top = hits[:, kk - 1] if kk > 0 else np.zeros(y.shape[0])
        out[f"precision@{k}"] = float(np.mean(top / kk)) if y.shape[0] and kk > 0 else np.nan
        recall = top[has_pos] / n_positive[has_pos]
        out[f"recall@{k}"] = float(recall.mean()) if has_pos.any() else np.nan
    out["n_samples_with_positive"] = int(has_pos.sum())
    return out
