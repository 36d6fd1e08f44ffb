"""Discrimination metrics: golden numbers on a hand example, agreement with scikit-learn, masks, bootstrap."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.metrics import average_precision_score, roc_auc_score

from behrt_rope import schema
from behrt_rope.evaluation.metrics import (
    bootstrap_ci,
    bootstrap_counts,
    bootstrap_replicates,
    macro_ap_and_replicates,
    per_code_table,
    per_column_scores,
    percentile_interval,
    percentile_intervals,
    precision_recall_at_k,
    summary_and_replicates,
    summary_metrics,
)

# 4 samples x 4 codes; code 3 has no positive, sample 3 has no positive. Worked by hand:
#   code 0 ranked perfectly (AP 1, AUROC 1); code 1: .8(+) .6(-) .2(-) .05(+): AP (1 + 2/4)/2 = 0.75,
#   AUROC 2/4 = 0.5; code 2 perfect. Sample 2: .7(+) .2(-) .1(-) .05(+): AP 0.75, AUROC 0.5; others perfect.
#   Pooled: thresholds .9 (tie +/-) .8 .7 .6 (tie +/-) ... .05 give precision 1/2, 2/3, 3/4, 4/6, 5/16 at
#   recall steps of 1/5: AP 0.2 * (1/2 + 2/3 + 3/4 + 2/3 + 5/16); AUROC (10.5 + 10 + 10 + 9.5 + 0) / 55.
Y = np.array([[1, 0, 1, 0], [0, 1, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
S = np.array([[0.9, 0.2, 0.6, 0.5], [0.3, 0.8, 0.4, 0.1], [0.7, 0.05, 0.1, 0.2], [0.2, 0.6, 0.3, 0.9]])


def _random(seed: int, n: int = 120, n_codes: int = 6, rate: float = 0.2) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = rng.random((n, n_codes)) < rate
    score = np.clip(0.3 * y + rng.random((n, n_codes)) * 0.8, 0, 1).round(2)  # rounded: ties
    return y, score


def test_golden_hand_example() -> None:
    m = summary_metrics(Y, S)
    assert m["macro_ap"] == pytest.approx((1 + 0.75 + 1) / 3)
    assert m["macro_auroc"] == pytest.approx((1 + 0.5 + 1) / 3)
    assert m["samples_ap"] == pytest.approx((1 + 1 + 0.75) / 3)
    assert m["samples_auroc"] == pytest.approx((1 + 1 + 0.5) / 3)
    assert m["micro_ap"] == pytest.approx(0.2 * (1 / 2 + 2 / 3 + 3 / 4 + 2 / 3 + 5 / 16))
    assert m["micro_auroc"] == pytest.approx(40 / 55)
    assert (m["n_codes_macro"], m["n_codes_excluded"], m["n_samples_evaluable"]) == (3, 1, 3)
    assert (m["n_samples"], m["n_codes"], m["n_pairs"], m["n_positive_pairs"]) == (4, 4, 16, 5)
    assert m["label_cardinality"] == pytest.approx(5 / 4)


def test_hand_example_equals_sklearn() -> None:
    m = summary_metrics(Y, S)
    keep = Y.any(axis=0)
    assert m["macro_ap"] == pytest.approx(average_precision_score(Y[:, keep], S[:, keep], average="macro"))
    assert m["macro_auroc"] == pytest.approx(roc_auc_score(Y[:, keep], S[:, keep], average="macro"))
    assert m["micro_ap"] == pytest.approx(average_precision_score(Y, S, average="micro"))
    assert m["micro_auroc"] == pytest.approx(roc_auc_score(Y, S, average="micro"))
    rows = Y.any(axis=1)
    assert m["samples_ap"] == pytest.approx(average_precision_score(Y[rows], S[rows], average="samples"))
    assert m["samples_auroc"] == pytest.approx(roc_auc_score(Y[rows], S[rows], average="samples"))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(2, 40), weighted=st.booleans(), masked=st.booleans())
def test_per_column_scores_equal_sklearn(seed: int, n: int, weighted: bool, masked: bool) -> None:
    rng = np.random.default_rng(seed)
    y = rng.random((n, 4)) < rng.uniform(0.1, 0.9)
    score = rng.random((n, 4)).round(int(rng.integers(0, 3)))
    mask = rng.random((n, 4)) < 0.7 if masked else np.ones((n, 4), dtype=bool)
    weights = rng.integers(0, 4, n).astype(float) if weighted else np.ones(n)
    ap, auroc = per_column_scores(y, score, mask if masked else None, weights if weighted else None)
    for j in range(4):
        sel = mask[:, j] & (weights > 0)
        yj, sj, wj = y[sel, j], score[sel, j], weights[sel]
        if yj.all() or not yj.any():
            assert np.isnan(ap[j]) and np.isnan(auroc[j])
            continue
        assert ap[j] == pytest.approx(average_precision_score(yj, sj, sample_weight=wj))
        assert auroc[j] == pytest.approx(roc_auc_score(yj, sj, sample_weight=wj))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 30), masked=st.booleans())
def test_pooled_scores_equal_sklearn_with_ties(seed: int, n: int, masked: bool) -> None:
    """The micro values come from the same ranking as their bootstrap replicates (no sklearn call), so they
    must still equal sklearn's pooled metrics, ties and masks included."""
    rng = np.random.default_rng(seed)
    y = rng.random((n, 3)) < rng.uniform(0.05, 0.95)
    score = rng.random((n, 3)).round(int(rng.integers(0, 3)))
    mask = rng.random((n, 3)) < 0.7 if masked else np.ones((n, 3), dtype=bool)
    summary, reps = summary_and_replicates(y, score, mask if masked else None, n_bootstrap=2, seed=seed)
    assert reps["micro_ap"].shape == (2,)
    yp, sp = y[mask], score[mask]
    if yp.all() or not yp.any():
        assert np.isnan(summary["micro_ap"]) and np.isnan(summary["micro_auroc"])
        return
    assert summary["micro_ap"] == pytest.approx(average_precision_score(yp, sp))
    assert summary["micro_auroc"] == pytest.approx(roc_auc_score(yp, sp))


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(2, 40), clustered=st.booleans())
def test_macro_ap_alone_has_the_full_summarys_value_and_replicates(seed: int, n: int, clustered: bool) -> None:
    """The choices on the tuning split read macro AP only: the lighter function gives the same point estimate
    and the same resamples as the full summary, ties, undefined codes and patient clusters included."""
    rng = np.random.default_rng(seed)
    y = rng.random((n, 4)) < rng.uniform(0.05, 0.95)
    score = rng.random((n, 4)).round(int(rng.integers(0, 3)))
    clusters = rng.integers(0, max(1, n // 3), n) if clustered else None
    summary, reps = summary_and_replicates(y, score, None, n_bootstrap=5, seed=seed, clusters=clusters)
    point, replicates = macro_ap_and_replicates(y, score, n_bootstrap=5, seed=seed, clusters=clusters)
    np.testing.assert_allclose(point, summary["macro_ap"], equal_nan=True)
    np.testing.assert_allclose(replicates, reps["macro_ap"], equal_nan=True)
    assert replicates.shape == (5,)


def test_masked_metrics_equal_sklearn_on_selected_pairs() -> None:
    y, score = _random(1)
    mask = np.random.default_rng(2).random(y.shape) < 0.6
    m = summary_metrics(y, score, mask)
    assert m["micro_ap"] == pytest.approx(average_precision_score(y[mask], score[mask]))
    assert m["micro_auroc"] == pytest.approx(roc_auc_score(y[mask], score[mask]))
    code_ap = [average_precision_score(y[mask[:, j], j], score[mask[:, j], j]) for j in range(y.shape[1])]
    code_auc = [roc_auc_score(y[mask[:, j], j], score[mask[:, j], j]) for j in range(y.shape[1])]
    assert m["macro_ap"] == pytest.approx(np.mean(code_ap))
    assert m["macro_auroc"] == pytest.approx(np.mean(code_auc))
    rows = [i for i in range(len(y)) if 0 < y[i, mask[i]].sum() < mask[i].sum()]
    sample_ap = [average_precision_score(y[i, mask[i]], score[i, mask[i]]) for i in rows]
    assert m["samples_ap"] == pytest.approx(np.mean(sample_ap))
    assert m["n_samples_evaluable"] == len(rows)
    assert m["n_pairs"] == mask.sum() and m["n_positive_pairs"] == (y & mask).sum()


def test_codes_without_positives_are_excluded_and_counted() -> None:
    y, score = _random(3)
    y[:, 1] = False
    y[:, 4] = True  # no negatives either
    m = summary_metrics(y, score)
    keep = [0, 2, 3, 5]
    assert (m["n_codes_macro"], m["n_codes_excluded"]) == (4, 2)
    assert m["macro_ap"] == pytest.approx(average_precision_score(y[:, keep], score[:, keep]))


def test_undefined_micro_is_nan() -> None:
    m = summary_metrics(np.zeros((3, 2)), np.full((3, 2), 0.5))
    assert np.isnan(m["micro_ap"]) and np.isnan(m["macro_auroc"]) and m["n_codes_excluded"] == 2


def test_bootstrap_ci_contains_point_and_is_reproducible() -> None:
    y, score = _random(4, n=300)
    point = summary_metrics(y, score)
    ci = bootstrap_ci(y, score, n_bootstrap=100, seed=7)
    for name, (low, high) in ci.items():
        assert low <= point[name] <= high, name
        assert high - low < 0.3
    assert bootstrap_ci(y, score, n_bootstrap=100, seed=7) == ci
    assert bootstrap_ci(y, score, n_bootstrap=100, seed=8) != ci


def test_bias_corrected_interval_follows_the_replicates_bias() -> None:
    """Replicates that sit above the estimate (as AP replicates of rare codes do) move the interval down
    so that it keeps the estimate; unbiased replicates give the plain percentile interval."""
    rng = np.random.default_rng(3)
    unbiased = rng.normal(0.0, 1.0, 4000)
    plain = percentile_interval(unbiased)
    assert percentile_interval(unbiased, point=float(np.median(unbiased))) == pytest.approx(plain, abs=0.02)
    biased = unbiased + 1.5  # the estimate 0 sits at the 7% quantile of its replicates
    low, high = percentile_interval(biased)
    assert low > -0.5  # the plain interval barely reaches the estimate ...
    bc_low, bc_high = percentile_interval(biased, point=0.0)
    assert bc_low < low - 0.5 and bc_high < high - 0.5  # ... the corrected one moves down by the bias
    assert bc_low < 0.0 < bc_high
    all_above = np.linspace(0.275, 0.317, 200)  # the session-4 demo's macro AP 0.273 with 0.275-0.317
    low, high = percentile_interval(all_above, point=0.273)
    assert low == 0.273 and high < 0.317  # stretched to the estimate, upper end pulled down


def test_per_code_intervals_are_bias_corrected_around_each_point() -> None:
    reps = np.stack([np.linspace(1.0, 2.0, 101), np.linspace(-1.0, 1.0, 101)], axis=1)  # (B, 2)
    low, high = percentile_intervals(reps, 0.9, point=np.array([1.0, 0.0]))
    assert low[0] == pytest.approx(1.0) and high[0] < 1.95  # estimate at the bottom: interval pulled down
    assert (low[1], high[1]) == pytest.approx((-0.9, 0.9))  # estimate at the median: plain interval


def test_bootstrap_replicates_are_resampled_metrics() -> None:
    y, score = _random(5, n=50)
    reps = bootstrap_replicates(y, score, n_bootstrap=3, seed=0)
    counts = np.random.default_rng(0).multinomial(50, np.full(50, 1 / 50), size=3)
    rows = np.repeat(np.arange(50), counts[1])
    assert reps["micro_ap"][1] == pytest.approx(average_precision_score(y[rows].ravel(), score[rows].ravel()))
    assert reps["per_code_auroc"][1, 2] == pytest.approx(roc_auc_score(y[rows, 2], score[rows, 2]))


def test_per_code_table() -> None:
    y, score = _random(6, n=200)
    y[:, 5] = False
    codes = [f"C{j}" for j in range(6)]
    table = per_code_table(y, score, codes, n_bootstrap=50, seed=1)
    assert list(table[schema.CODE])[-1] == "C5"
    assert table["prevalence"].is_monotonic_decreasing
    row = table.set_index(schema.CODE).loc["C2"]
    assert row["n_positive"] == y[:, 2].sum() and row["n_samples"] == 200
    assert row["ap"] == pytest.approx(average_precision_score(y[:, 2], score[:, 2]))
    assert row["ap_low"] <= row["ap"] <= row["ap_high"]
    assert row["auroc_low"] <= row["auroc"] <= row["auroc_high"]
    empty = table.set_index(schema.CODE).loc["C5"]
    assert np.isnan(empty["ap"]) and np.isnan(empty["ap_low"]) and empty["n_positive"] == 0
    again = per_code_table(y, score, codes, n_bootstrap=50, seed=1)
    assert again.equals(table)


def test_precision_recall_at_k_hand_example() -> None:
    y = [[1, 0, 1, 0], [0, 0, 0, 1], [0, 0, 0, 0]]
    s = [[0.9, 0.8, 0.1, 0.3], [0.2, 0.3, 0.4, 0.1], [0.5, 0.4, 0.3, 0.2]]
    r = precision_recall_at_k(y, s, ks=(1, 2, 10))
    # top-1: hit, miss, miss; top-2: 1 hit, 0, 0; k=10 caps at 4 codes: 2, 1, 0 hits.
    assert r["precision@1"] == pytest.approx(1 / 3)
    assert r["recall@1"] == pytest.approx((1 / 2 + 0) / 2)
    assert r["precision@2"] == pytest.approx((1 / 2) / 3)
    assert r["recall@2"] == pytest.approx((1 / 2 + 0) / 2)
    assert r["precision@10"] == pytest.approx((2 / 4 + 1 / 4) / 3)
    assert r["recall@10"] == pytest.approx(1.0)
    assert r["n_samples_with_positive"] == 2


def test_precision_at_k_with_mask_skips_history_codes() -> None:
    y = np.array([[1, 1, 0]])
    s = np.array([[0.9, 0.5, 0.1]])
    mask = np.array([[False, True, True]])
    r = precision_recall_at_k(y, s, ks=(1,), mask=mask)
    assert r["precision@1"] == 1.0 and r["recall@1"] == 1.0


def test_input_checks() -> None:
    with pytest.raises(ValueError, match="shape"):
        summary_metrics(np.zeros((2, 2)), np.zeros((2, 3)))
    with pytest.raises(ValueError, match="0 and 1"):
        summary_metrics(np.full((2, 2), 2), np.zeros((2, 2)))
    with pytest.raises(ValueError, match="finite"):
        summary_metrics(np.zeros((2, 2)), np.full((2, 2), np.nan))


def test_a_clustered_bootstrap_draws_whole_patients_and_as_many_as_there_are() -> None:
    patients = np.array([5, 5, 5, 9, 2, 2])  # three patients with 3, 1 and 2 samples
    counts = bootstrap_counts(len(patients), 500, seed=4, clusters=patients)
    assert counts.shape == (500, 6)
    per_patient = counts[:, [0, 3, 4]]  # one row of each patient
    assert (per_patient.sum(axis=1) == 3).all()  # three patients drawn per resample
    assert (counts[:, 1] == counts[:, 0]).all() and (counts[:, 5] == counts[:, 4]).all()
    assert (counts.sum(axis=1) == per_patient @ np.array([3, 1, 2])).all()  # a patient brings all its samples
    assert set(np.unique(per_patient)) == {0, 1, 2, 3}
    with pytest.raises(ValueError, match="2 cluster ids for 6 rows"):
        bootstrap_counts(6, 2, seed=0, clusters=[1, 2])
