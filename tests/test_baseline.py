"""The reference models: the bag-of-codes logistic regression and the choice of both references' settings."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import scipy.sparse as sp
from sklearn.metrics import roc_auc_score

from behrt_rope import schema
from behrt_rope.errors import UserError
from behrt_rope.evaluation.baseline import (
    C_GRID,
    GBM_GRID,
    _with_extra,
    age_features,
    bag_of_codes,
    choose_c,
    choose_gbm,
    fit_predict_baseline,
)
from behrt_rope.evaluation.time_features import TimeFeatures


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


def test_the_regression_s_inputs_are_sparse_arrays_built_without_a_scipy_deprecation() -> None:
    """SciPy is deprecating its sparse matrix API: the bag of codes and the regression's input with its dense
    columns are CSR sparse arrays, with the int32 indices liblinear takes, built without a DeprecationWarning."""
    lists = [np.array([5, 6, 6]), np.array([], dtype=int), np.array([7])]
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        bag = bag_of_codes(lists, 9, binary=False)
        both = _with_extra(bag, np.array([[1.0], [2.0], [3.0]]), None)
        dense = _with_extra(bag.toarray(), None, None)
    for built in (bag, both, dense):
        assert isinstance(built, sp.sparray) and built.format == "csr" and built.indices.dtype == np.int32
    assert both.shape == (3, 10) and dense.shape == (3, 9)
    np.testing.assert_array_equal(both.toarray()[:, 5:], [[1, 2, 0, 0, 1], [0, 0, 0, 0, 2], [0, 0, 1, 0, 3]])
    np.testing.assert_array_equal(dense.toarray(), bag.toarray())


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


def _noisy_time_features(n: int, labels: int, seed: int) -> tuple[TimeFeatures, np.ndarray]:
    """Time features where each label depends only on its own code being on file (2% -> 10%), beside one
    'ever' column per other label code that is pure noise: a flexible tree model learns the noise."""
    rng = np.random.default_rng(seed)
    ever = (rng.random((n, labels)) < 0.2).astype(np.float32)
    since = rng.integers(0, 5, (n, labels)).astype(np.float32)
    per_code = np.stack(
        [
            ever,
            ever * (1 + rng.poisson(1.0, (n, labels))),
            np.where(ever > 0, since, np.nan),
            np.where(ever > 0, since * 90, np.nan),
            np.where(ever > 0, rng.random((n, labels)) * 5, np.nan),
            ever * (rng.random((n, labels)) < 0.5),
        ],
        axis=-1,
    ).astype(np.float32)
    per_sample = np.column_stack(
        [rng.uniform(20, 80, n), rng.integers(1, 20, n), rng.uniform(0, 400, n), rng.integers(0, 3, n)]
    ).astype(np.float32)
    return TimeFeatures(per_code, per_sample), (rng.random((n, labels)) < 0.02 + 0.08 * ever).astype(int)


def test_choose_gbm_prefers_strong_regularisation_where_noise_columns_outnumber_the_signal() -> None:
    train, y_train = _noisy_time_features(1500, 40, seed=0)
    tune, y_tune = _noisy_time_features(4000, 40, seed=1)
    y_tune[:, 3] = 0  # a label without a tuning positive cannot be scored, so it is never sampled
    best, scores, n_labels = choose_gbm(train, y_train, tune, y_tune, max_labels=10)
    assert list(scores) == list(GBM_GRID) and n_labels == 10
    assert best == max(scores, key=scores.__getitem__) and best != "flexible"
    assert scores[best] > scores["flexible"] + 0.005  # the previous fixed setting learns the noise columns
    assert all(0.0 < v <= 1.0 for v in scores.values())
    _, _, all_scorable = choose_gbm(train, y_train, tune, y_tune, grid={"flexible": {}}, max_labels=100)
    assert all_scorable == 39


def test_choose_gbm_breaks_ties_towards_the_first_setting_and_needs_a_grid() -> None:
    train, y_train = _noisy_time_features(600, 4, seed=2)
    same = {"first": {}, "second": {}}  # identical settings score identically
    best, scores, _ = choose_gbm(train, y_train, train, y_train, grid=same)
    assert scores["first"] == scores["second"] and best == "first"
    with pytest.raises(ValueError, match="at least one setting"):
        choose_gbm(train, y_train, train, y_train, grid={})


def test_a_fixed_gradient_boosting_setting_is_used_without_a_search_and_a_wrong_name_is_refused() -> None:
    from pipelines.evaluate import Config, _gbm_setting

    # the data are never read when the setting is fixed: None stands in for them
    name, choice = _gbm_setting(None, None, None, Config(gradient_boosting_setting="moderate"))  # type: ignore[arg-type]
    assert name == "moderate" and choice["chosen_on"] == "fixed (gradient_boosting_setting)"
    assert choice["params"] == GBM_GRID["moderate"]
    with pytest.raises(UserError, match="one of strong, moderate, flexible, got 'huge'"):
        _gbm_setting(None, None, None, Config(gradient_boosting_setting="huge"))  # type: ignore[arg-type]
