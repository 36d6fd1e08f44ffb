"""Calibration of multi-label probabilities: Brier score, expected and maximum calibration error, and the
reliability bins behind them, all over the pooled (sample, code) pairs.

Binning follows ``sklearn.calibration.calibration_curve`` exactly (same edges, same assignment: bin b holds
the predictions p with ``edges[b] < p <= edges[b + 1]``, the first bin also holding ``edges[0]``), so its
non-empty bins give the same points; the counts that calibration_curve does not return come from the same
``np.searchsorted`` call.

Definitions, with n pairs, bins b holding n_b pairs, mean prediction p_b and observed positive rate o_b:

* Brier score = mean over pairs of (p - y)^2 (sklearn ``brier_score_loss``).
* ECE (expected calibration error) = sum over non-empty bins of (n_b / n) * |p_b - o_b|.
* MCE (maximum calibration error) = max over non-empty bins of |p_b - o_b|.

Pooled over all codes, most pairs are rare-code negatives with small predictions, so with uniform bins
most pairs land in the first bin; ``strategy="quantile"`` spreads them evenly instead.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from numpy.typing import ArrayLike
from sklearn.metrics import brier_score_loss

Strategy = Literal["uniform", "quantile"]


def bin_edges(y_prob: ArrayLike, n_bins: int = 10, strategy: Strategy = "uniform") -> np.ndarray:
    """(n_bins + 1,) edges: equal widths on [0, 1] (uniform) or the predictions' quantiles (quantile)."""
    if n_bins < 1:
        raise ValueError(f"n_bins must be at least 1, got {n_bins}")
    if strategy == "uniform":
        return np.linspace(0.0, 1.0, n_bins + 1)
    if strategy == "quantile":
        p = np.asarray(y_prob, dtype=float).ravel()
        return np.percentile(p, np.linspace(0, 100, n_bins + 1)) if p.size else np.zeros(n_bins + 1)
    raise ValueError(f"strategy must be 'uniform' or 'quantile', got {strategy!r}")


def reliability_bins(
    y_true: ArrayLike, y_prob: ArrayLike, n_bins: int = 10, strategy: Strategy = "uniform"
) -> dict[str, np.ndarray]:
    """Per-bin arrays, each (n_bins,): ``lower``/``upper`` edges, ``count``, ``mean_predicted`` and
    ``observed_rate`` (NaN in empty bins). Inputs are 1-D: labels in {0, 1} and probabilities in [0, 1]."""
    y = np.asarray(y_true, dtype=float).ravel()
    p = np.asarray(y_prob, dtype=float).ravel()
    edges = bin_edges(p, n_bins, strategy)
    ids = np.searchsorted(edges[1:-1], p)  # as sklearn.calibration.calibration_curve
    count = np.bincount(ids, minlength=n_bins).astype(float)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_predicted = np.bincount(ids, weights=p, minlength=n_bins) / count
        observed_rate = np.bincount(ids, weights=y, minlength=n_bins) / count
    return {
        "lower": edges[:-1],
        "upper": edges[1:],
        "count": count.astype(int),
        "mean_predicted": mean_predicted,
        "observed_rate": observed_rate,
    }


def calibration_summary(
    y_true: ArrayLike,
    y_score: ArrayLike,
    n_bins: int = 10,
    strategy: Strategy = "uniform",
    mask: ArrayLike | None = None,
) -> dict:
    """Brier score, ECE, MCE and reliability bins of (N, L) probabilities, pooled over selected pairs.

    ``y_true`` and ``y_score`` are (N, L) (any shape works: they are flattened); ``mask`` (same shape,
    bool) selects the pairs. Returns ``brier``, ``ece``, ``mce`` (definitions in the module docstring),
    ``n_pairs``, ``mean_predicted`` and ``observed_rate`` over all selected pairs, ``n_bins``,
    ``strategy`` and ``bins``: a list of dicts (``lower``, ``upper``, ``count``, ``mean_predicted``,
    ``observed_rate``), one per bin, empty bins included with NaN means.

    >>> s = calibration_summary([[1, 0], [1, 0]], [[0.9, 0.9], [0.9, 0.9]])
    >>> round(s["ece"], 6), round(s["mce"], 6), round(s["brier"], 6)
    (0.4, 0.4, 0.41)
    """
    y = np.asarray(y_true, dtype=float)
    p = np.asarray(y_score, dtype=float)
    if y.shape != p.shape:
        raise ValueError(f"y_true shape {y.shape} differs from y_score shape {p.shape}")
    if mask is not None:
        y, p = y[np.asarray(mask, dtype=bool)], p[np.asarray(mask, dtype=bool)]
    y, p = y.ravel(), p.ravel()
    if ((p < 0) | (p > 1)).any() or not np.isfinite(p).all():
        raise ValueError("y_score must be probabilities in [0, 1]")
    bins = reliability_bins(y, p, n_bins, strategy)
    filled = bins["count"] > 0
    gap = np.abs(bins["mean_predicted"] - bins["observed_rate"])[filled]
    n = len(p)
    return {
        "brier": float(brier_score_loss(y, p)) if n else np.nan,
        "ece": float(np.sum(bins["count"][filled] / n * gap)) if n else np.nan,
        "mce": float(gap.max()) if n else np.nan,
        "n_pairs": int(n),
        "mean_predicted": float(p.mean()) if n else np.nan,
        "observed_rate": float(y.mean()) if n else np.nan,
        "n_bins": int(n_bins),
        "strategy": strategy,
        "bins": [{key: _scalar(values[b]) for key, values in bins.items()} for b in range(len(bins["count"]))],
    }


def _scalar(value: np.generic) -> float | int:
    return int(value) if np.issubdtype(type(value), np.integer) else float(value)
