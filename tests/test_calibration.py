"""Calibration: ECE and MCE on hand examples, agreement with scikit-learn's calibration_curve and Brier."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.calibration import calibration_curve
from sklearn.metrics import brier_score_loss

from behrt_rope.evaluation.calibration import Strategy, calibration_summary, reliability_bins


def test_constant_prediction_with_half_positives() -> None:
    y = np.array([[1, 0], [1, 0], [0, 1], [0, 1]])
    s = calibration_summary(y, np.full(y.shape, 0.9))
    assert s["ece"] == pytest.approx(0.4)
    assert s["mce"] == pytest.approx(0.4)
    assert s["brier"] == pytest.approx((0.1**2 + 0.9**2) / 2)
    assert [b["count"] for b in s["bins"]] == [0] * 8 + [8, 0]
    assert s["bins"][8]["observed_rate"] == 0.5 and np.isnan(s["bins"][0]["mean_predicted"])


def test_perfectly_calibrated_bins_give_zero() -> None:
    # bin [0.2, 0.3]: predictions 0.25, 1 of 4 positive; bin [0.7, 0.8]: 0.75, 3 of 4 positive.
    y = np.array([1, 0, 0, 0, 1, 1, 1, 0])
    p = np.array([0.25] * 4 + [0.75] * 4)
    s = calibration_summary(y, p)
    assert s["ece"] == pytest.approx(0.0, abs=1e-12)
    assert s["mce"] == pytest.approx(0.0, abs=1e-12)


def test_ece_weights_bins_by_share() -> None:
    # 3 pairs at 0.15 with 0 positives (gap 0.15), 1 pair at 0.95 positive (gap 0.05).
    s = calibration_summary(np.array([0, 0, 0, 1]), np.array([0.15, 0.15, 0.15, 0.95]))
    assert s["ece"] == pytest.approx(0.75 * 0.15 + 0.25 * 0.05)
    assert s["mce"] == pytest.approx(0.15)


@pytest.mark.parametrize("strategy", ["uniform", "quantile"])
def test_bins_agree_with_sklearn(strategy: Strategy) -> None:
    rng = np.random.default_rng(0)
    p = rng.beta(0.5, 3, (200, 5))
    y = rng.random(p.shape) < p
    s = calibration_summary(y, p, n_bins=8, strategy=strategy)
    prob_true, prob_pred = calibration_curve(y.ravel(), p.ravel(), n_bins=8, strategy=strategy)
    filled = [b for b in s["bins"] if b["count"]]
    assert np.allclose([b["observed_rate"] for b in filled], prob_true)
    assert np.allclose([b["mean_predicted"] for b in filled], prob_pred)
    assert sum(b["count"] for b in s["bins"]) == p.size == s["n_pairs"]
    assert s["brier"] == pytest.approx(brier_score_loss(y.ravel(), p.ravel()))
    gaps = [b["count"] / p.size * abs(b["mean_predicted"] - b["observed_rate"]) for b in filled]
    assert s["ece"] == pytest.approx(sum(gaps))


def test_mask_selects_pairs() -> None:
    y = np.array([[1, 0], [0, 1]])
    p = np.array([[0.9, 0.1], [0.2, 0.6]])
    mask = np.array([[True, False], [True, True]])
    s = calibration_summary(y, p, mask=mask)
    assert s["n_pairs"] == 3
    assert s["brier"] == pytest.approx(brier_score_loss([1, 0, 1], [0.9, 0.2, 0.6]))


def test_edge_values_and_errors() -> None:
    bins = reliability_bins(np.array([0, 1, 1]), np.array([0.0, 0.1, 1.0]), n_bins=10)
    assert bins["count"][0] == 2 and bins["count"][9] == 1  # 0.1 is the first bin's closed upper edge
    with pytest.raises(ValueError, match="probabilities"):
        calibration_summary(np.array([0, 1]), np.array([0.5, 1.5]))
    with pytest.raises(ValueError, match="strategy"):
        calibration_summary(np.array([0, 1]), np.array([0.5, 0.5]), strategy="kmeans")  # type: ignore[arg-type]
