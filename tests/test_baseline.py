"""The bag-of-codes logistic-regression baseline."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from behrt_rope import schema
from behrt_rope.evaluation.baseline import C_GRID, age_features, bag_of_codes, choose_c, fit_predict_baseline


def test_bag_of_codes_from_lists_and_offsets() -> None:
    lists = [np.array([schema.CLS_ID, 7, 7, schema.SEP_ID, 9]), np.array([], dtype=int), np.array([5])]
    from_lists = bag_of_codes(lists, 10, binary=False)
    flat = np.concatenate(lists)
    offsets = np.array([0, 5, 5, 6])
    from_flat = bag_of_codes(flat, 10, offsets, binary=False)
    expected = np.zeros((3, 10))
    expected[0, 7], expected[0, 9], expected[2, 5] = 2, 1, 1
    assert np.array_equal(from_lists.toarray(), expected)
    assert np.array_equal(from_flat.toarray(), expected)
    assert bag_of_codes(lists, 10).toarray()[0, 7] == 1.0  # binary by default
    assert from_lists.format == "csr" and from_lists.shape == (3, 10)


def test_bag_of_codes_sliced_offsets_and_errors() -> None:
    flat = np.array([5, 6, 7, 8])
    assert bag_of_codes(flat, 10, np.array([1, 3, 4])).toarray()[:, 5:9].tolist() == [[0, 1, 1, 0], [0, 0, 0, 1]]
    with pytest.raises(ValueError, match="token ids"):
        bag_of_codes([np.array([10])], 10)


def _separable(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Label j is present iff code 10 + j is in the history (plus noise codes)."""
    rng = np.random.default_rng(seed)
    lists, labels = [], np.zeros((n, 3), dtype=int)
    for i in range(n):
        codes = rng.choice(np.arange(10, 30), size=rng.integers(1, 6), replace=False)
        lists.append(codes)
        labels[i] = [int(10 + j in codes) for j in range(3)]
    return bag_of_codes(lists, 30), labels, rng.uniform(20, 90, n)


def test_baseline_learns_a_separable_problem_and_handles_constant_labels() -> None:
    X, Y, _ = _separable(400, 0)
    Y = np.hstack([Y, np.zeros((400, 1), dtype=int), np.ones((400, 1), dtype=int)])
    probs = fit_predict_baseline(X[:300], Y[:300], X[300:], C=1.0, n_jobs=1)
    assert probs.shape == (100, 5)
    assert ((probs >= 0) & (probs <= 1)).all()
    for j in range(3):
        assert roc_auc_score(Y[300:, j], probs[:, j]) > 0.95
    assert (probs[:, 3] == 0.0).all() and (probs[:, 4] == 1.0).all()


def test_baseline_age_hook_and_parallel_fit() -> None:
    X, Y, age = _separable(200, 1)
    plain = fit_predict_baseline(X[:150], Y[:150], X[150:], n_jobs=1)
    with_age = fit_predict_baseline(
        X[:150],
        Y[:150],
        X[150:],
        extra_train=age_features(age[:150]),
        extra_eval=age_features(age[150:]),
        n_jobs=2,
    )
    assert with_age.shape == plain.shape
    assert not np.allclose(with_age, plain)
    assert np.allclose(fit_predict_baseline(X[:150], Y[:150], X[150:], n_jobs=2), plain)
    with pytest.raises(ValueError, match="both"):
        fit_predict_baseline(X[:150], Y[:150], X[150:], extra_train=age_features(age[:150]))


def _many_noise_codes(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A weak signal among many noise codes: label 0 is more likely (35% vs 5%) when code 10 is on file, and
    every row carries 10 of 400 noise codes, so a weakly penalised fit learns the noise."""
    rng = np.random.default_rng(seed)
    lists, labels = [], np.zeros((n, 1), dtype=int)
    for i in range(n):
        signal = rng.random() < 0.3
        codes = rng.choice(np.arange(11, 411), size=10, replace=False)
        lists.append(np.concatenate([[10], codes]) if signal else codes)
        labels[i, 0] = int(rng.random() < (0.35 if signal else 0.05))
    return bag_of_codes(lists, 411), labels


def test_choose_c_prefers_a_strong_penalty_where_noise_codes_outnumber_the_signal() -> None:
    x, y = _many_noise_codes(600, seed=0)
    x_tune, y_tune = _many_noise_codes(2000, seed=1)
    best, scores = choose_c(x, y, x_tune, y_tune)
    assert list(scores) == list(C_GRID)  # every C scored, in grid order
    assert best == max(scores, key=scores.__getitem__) and best < 1.0
    assert scores[best] > scores[1.0] + 0.02  # the default C=1 over-fits the 400 noise codes
    assert all(0.0 < v <= 1.0 for v in scores.values())


def test_choose_c_breaks_ties_towards_the_stronger_penalty_and_needs_a_grid() -> None:
    x, y, _ = _separable(300, seed=2)
    best, scores = choose_c(x, y, x, y, grid=(0.5, 2.0, 8.0))
    assert all(v == pytest.approx(1.0) for v in scores.values())  # separable: every C ranks perfectly
    assert best == 0.5
    with pytest.raises(ValueError, match="at least one C"):
        choose_c(x, y, x, y, grid=())


def test_a_fixed_baseline_c_is_used_as_given_without_a_search() -> None:
    from pipelines.evaluate import Config, _logistic_c

    # the data are never read when C is fixed: None stands in for them
    c, choice = _logistic_c("logistic_regression", None, None, None, Config(baseline_c=0.25))  # type: ignore[arg-type]
    assert c == 0.25 and choice == {"c": 0.25, "chosen_on": "fixed (baseline_c)"}
