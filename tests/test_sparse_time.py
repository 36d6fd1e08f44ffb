"""The sparse time regression: binned timing of every label code, fitted with an L1 penalty."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import scipy.sparse as sp
from scipy.linalg import block_diag
from sklearn.metrics import average_precision_score, roc_auc_score

from behrt_rope.evaluation.sparse_time import (
    AGE_EDGES,
    C_GRID,
    DEFAULT_C,
    OWN_COLUMNS,
    PER_CODE_COLUMNS,
    SELECT_C,
    CumulativeBins,
    choose_sparse_c,
    fit_predict_sparse_time,
    fit_sparse_time,
    fit_sparse_time_grid,
    label_design,
    own_design,
    shared_design,
    sparse_c_setting,
)
from behrt_rope.evaluation.time_features import TimeFeatures

NAN = np.nan


def hand_made() -> TimeFeatures:
    """Two samples, two label codes. Per code: ever, n_visits, visits_since, days_since, years_first, in_last."""
    per_code = np.array(
        [
            [[1, 3, 0, 0, 2.5, 1], [0, 0, NAN, NAN, NAN, 0]],  # code 0 at the last visit, first 2.5 y ago
            [[0, 0, NAN, NAN, NAN, 0], [1, 1, 7, 400, 9.0, 0]],  # code 1 once, 7 visits and 400 days ago
        ],
        dtype=np.float32,
    )
    per_sample = np.array([[45.0, 4, NAN, 1], [81.0, 9, 20.0, 0]], dtype=np.float32)  # age, visits, gap, sex
    return TimeFeatures(per_code, per_sample)


def test_own_code_columns_are_bins_of_its_time_course() -> None:
    own = own_design(hand_made(), 0)
    assert own.shape == (2, 20)
    expected = np.zeros(20, dtype=np.float32)
    expected[[0, 2, 8, 15, 19]] = 1.0  # ever; 0 visits since; < 30 days since; first 2-3 years ago; in the last visit
    expected[1] = np.log1p(3.0)
    np.testing.assert_allclose(own[0], expected, rtol=1e-6)
    np.testing.assert_array_equal(own[1], np.zeros(20))  # never recorded: every column 0, NaN-free


def test_shared_columns_give_every_codes_first_record_and_the_sample_bins() -> None:
    shared = shared_design(hand_made()).toarray()
    assert shared.shape == (2, 7 * 2 + 18)
    assert not np.isnan(shared).any()
    timing = shared[:, :14].reshape(2, 2, 7)  # (sample, code, 6 year bins + at the last visit)
    np.testing.assert_array_equal(timing[0, 0], [0, 0, 1, 0, 0, 0, 1])
    np.testing.assert_array_equal(timing[0, 1], np.zeros(7))
    np.testing.assert_array_equal(timing[1, 1], [0, 0, 0, 0, 0, 1, 0])  # 9 years: the 8+ bin
    age = shared[:, 14 : 14 + len(AGE_EDGES) + 1]
    assert age[0].argmax() == 4 and age[1].argmax() == 8  # 45 -> 40-50, 81 -> 80+
    sex = shared[:, 23:26]
    np.testing.assert_array_equal(sex, [[1, 0, 0], [0, 0, 0]])  # female; unknown has no column
    gap = shared[:, 27:]
    np.testing.assert_array_equal(gap[0], np.zeros(5))  # a history's first visit has no previous one
    assert gap[1].argmax() == 1  # 20 days: 14-30


def test_the_designs_are_sparse_arrays_built_without_a_scipy_deprecation() -> None:
    """SciPy is deprecating its sparse matrix API (``block_diag`` of dense blocks only warns from SciPy 1.18,
    the matrix classes later): the designs and the cumulative coding are CSR sparse arrays, with the int32
    indices liblinear takes, built without a DeprecationWarning, and hold the same values."""
    features = hand_made()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        coding = CumulativeBins.for_labels(2)
        shared = shared_design(features)
        cumulative = (shared @ coding.shared).tocsr()
        design = label_design(features, cumulative, 0, coding.own)
    for built in (coding.shared, shared, cumulative, design):
        assert isinstance(built, sp.sparray) and built.format == "csr" and built.indices.dtype == np.int32
    assert coding.shared.dtype == np.float32 and coding.shared.shape == (7 * 2 + 18, 7 * 2 + 18)
    years_then_last = block_diag(np.tril(np.ones((6, 6))), np.eye(1))  # each code's 6 year bins, then its flag
    np.testing.assert_array_equal(coding.shared.toarray()[:14, :14], block_diag(years_then_last, years_then_last))
    assert design.shape == (2, OWN_COLUMNS + 7 * 2 + 18)
    want = np.hstack([own_design(features, 0) @ coding.own, shared.toarray() @ coding.shared.toarray()])
    np.testing.assert_allclose(design.toarray(), want, rtol=1e-6)


def _timing_cohort(n: int, rng: np.random.Generator) -> tuple[TimeFeatures, np.ndarray, np.ndarray]:
    """Label 0 is likely only 2-3 years after code 1 was first recorded; label 2 never occurs. Returns the
    features, the targets and label 0's true probability."""
    per_code = np.full((n, 3, 6), NAN, dtype=np.float32)
    per_code[:, :, [0, 1, 5]] = 0.0
    ever = rng.random(n) < 0.6
    years = rng.uniform(0.0, 10.0, n)
    per_code[ever, 1, 0], per_code[ever, 1, 1], per_code[ever, 1, 4] = 1.0, 1.0, years[ever]
    per_code[ever, 1, 2], per_code[ever, 1, 3] = 3.0, 365.0 * years[ever] / 2
    per_sample = np.column_stack([rng.uniform(20, 80, n), rng.integers(1, 20, n), rng.uniform(10, 300, n), np.ones(n)])
    window = ever & (years >= 2.0) & (years < 3.0)
    y = np.zeros((n, 3), dtype=np.int64)
    truth = np.where(window, 0.6, 0.05)
    y[:, 0] = rng.random(n) < truth
    y[:, 1] = rng.random(n) < 0.2
    return TimeFeatures(per_code, per_sample.astype(np.float32)), y, truth


def test_learns_another_codes_timing_that_its_presence_does_not_show() -> None:
    rng = np.random.default_rng(0)
    train, y_train, _ = _timing_cohort(3000, rng)
    test, y_test, truth = _timing_cohort(2000, rng)
    probs = fit_predict_sparse_time(train, y_train, test, n_jobs=1)
    assert probs.shape == (2000, 3) and ((probs >= 0) & (probs <= 1)).all()
    best = roc_auc_score(y_test[:, 0], truth)
    presence = roc_auc_score(y_test[:, 0], test.per_code[:, 1, 0])
    auroc = roc_auc_score(y_test[:, 0], probs[:, 0])
    assert auroc > best - 0.03 and auroc > presence + 0.08  # seeded: 0.697 against 0.711 and 0.589
    assert probs[:, 2] == pytest.approx(0.0, abs=2e-6)  # never positive in training: its rate, clipped to 1e-6


def test_rejects_targets_that_do_not_match_the_samples() -> None:
    with pytest.raises(ValueError, match="Y_train must be"):
        fit_predict_sparse_time(hand_made(), np.zeros((3, 2)), hand_made())


def test_the_fit_is_the_same_at_every_run_and_for_any_number_of_workers() -> None:
    """liblinear draws from one process-wide generator: fitted side by side in threads the labels' weights
    changed from run to run (by ~1e-4 here); fitted in processes they are exactly reproducible."""
    rng = np.random.default_rng(1)
    parts = [_timing_cohort(4000, rng) for _ in range(4)]
    features = TimeFeatures(
        np.concatenate([p[0].per_code for p in parts], axis=1), np.concatenate([p[0].per_sample for p in parts][:1])
    )
    y = np.concatenate([p[1] for p in parts], axis=1)  # 12 labels
    fits = [fit_sparse_time(features, y, c=1.0, n_jobs=n) for n in (2, 2, 1)]
    for other in fits[1:]:
        for name in ("own_weight", "shared_weight", "bias"):
            np.testing.assert_array_equal(getattr(fits[0], name), getattr(other, name))
    assert (fits[0].shared_weight != 0).sum() > 12


def test_a_fit_restricted_to_some_labels_equals_the_full_fit_on_them_and_gives_the_rest_their_rate() -> None:
    rng = np.random.default_rng(2)
    features, y, _ = _timing_cohort(2000, rng)
    full = fit_sparse_time(features, y, c=0.3, n_jobs=1)
    part = fit_sparse_time(features, y, c=0.3, n_jobs=1, labels=np.array([0]))
    np.testing.assert_array_equal(part.own_weight[0], full.own_weight[0])
    np.testing.assert_array_equal(part.shared_weight[0], full.shared_weight[0])
    assert not part.own_weight[1].any() and not part.shared_weight[1].any()  # label 1 not fitted ...
    assert part.bias[1] == pytest.approx(np.log(y[:, 1].mean() / (1 - y[:, 1].mean())), abs=1e-5)  # ... its rate


def test_choose_sparse_c_finds_a_weaker_penalty_where_positives_are_few() -> None:
    """With rare labels an L1 penalty too strong for the data zeroes the timing signal: the choice, on the
    tuning rows, moves away from it; the scores it reports are those of each C's fit on the sampled labels."""
    rng = np.random.default_rng(3)
    train, y_train, _ = _timing_cohort(600, rng)  # label 0: about 60 positives
    tune, y_tune, _ = _timing_cohort(3000, rng)
    c, scores, n_labels, start = choose_sparse_c(
        train, y_train, tune, y_tune, grid=(0.002, 0.3), n_jobs=1, select_c=None
    )
    assert n_labels == 2  # label 2 has no positive: never sampled
    assert start.c == 0.3 and start.fitted is not None and start.fitted.tolist() == [True, True, False]
    assert list(scores) == [0.002, 0.3] and c == 0.3
    assert scores[0.3] > scores[0.002] + 0.05  # seeded
    fit = fit_sparse_time(train, y_train, 0.3, n_jobs=1, select_c=None)
    expected = np.mean([average_precision_score(y_tune[:, j], fit.logits(tune)[:, j]) for j in (0, 1)])
    assert scores[0.3] == pytest.approx(expected, abs=1e-9)


def test_choose_sparse_c_keeps_the_first_c_when_nothing_can_be_scored_and_needs_a_grid() -> None:
    rng = np.random.default_rng(4)
    train, y_train, _ = _timing_cohort(300, rng)
    c, scores, n_labels, _ = choose_sparse_c(train, y_train, train, np.zeros_like(y_train), n_jobs=1)
    assert (c, n_labels) == (C_GRID[0], 0) and set(scores.values()) == {0.0}
    assert C_GRID[0] == DEFAULT_C  # ties keep the default refit strength
    with pytest.raises(ValueError, match="at least one C"):
        choose_sparse_c(train, y_train, train, y_train, grid=())


def test_sparse_c_setting_builds_the_tuning_features_only_to_choose() -> None:
    rng = np.random.default_rng(5)
    train, y_train, _ = _timing_cohort(300, rng)

    def never() -> TimeFeatures:
        raise AssertionError("the tuning features were built without a choice to make")

    fixed = sparse_c_setting(0.5, train, y_train, never, y_train)
    rule = {"select_c": SELECT_C, "bins": "cumulative"}
    assert fixed == (0.5, {"c": 0.5, "chosen_on": "fixed (sparse_time_c)", **rule}, None)
    no_rows = sparse_c_setting(None, train, y_train, never, np.zeros((0, 3)), select_c=None, bins="indicator")
    default = {"c": DEFAULT_C, "chosen_on": "default (no tuning samples)", "select_c": None, "bins": "indicator"}
    assert no_rows == (DEFAULT_C, default, None)
    c, report, start = sparse_c_setting(None, train, y_train, lambda: train, y_train)
    assert start is not None and (start.c, start.select_c, start.bins) == (c, SELECT_C, "cumulative")
    assert report["chosen_on"] == "tuning split" and report["c"] == c and report["tuning_labels"] == 2
    assert (report["select_c"], report["bins"]) == (SELECT_C, "cumulative")
    with pytest.raises(ValueError, match="bins must be one of cumulative, indicator, got 'ordinal'"):
        sparse_c_setting(0.5, train, y_train, never, y_train, bins="ordinal")
    assert report["tuning_macro_ap"][f"{c:g}"] == max(report["tuning_macro_ap"].values())


def test_the_full_fit_takes_over_the_choice_s_labels_and_equals_a_fit_from_scratch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The C choice has already fitted its sampled labels at the chosen C; the full fit runs only the rest,
    and its weights are exactly those of a fit from scratch. A fit at another C is not taken over."""
    import behrt_rope.evaluation.sparse_time as sparse_time

    rng = np.random.default_rng(6)
    features, y, _ = _timing_cohort(1500, rng)  # labels 0 and 1 can be fitted, 2 has no positive
    scratch = fit_sparse_time(features, y, c=0.3, n_jobs=1)
    start = fit_sparse_time(features, y, c=0.3, n_jobs=1, labels=np.array([0, 2]))
    runs: list[int] = []
    fit_label = sparse_time._fit_label

    def counted(
        train: TimeFeatures,
        shared: object,
        j: int,
        y_j: np.ndarray,
        cs: list[float],
        select_c: object,
        coding: object,
        tol: float,
    ) -> object:
        runs.append(j)
        return fit_label(train, shared, j, y_j, cs, select_c, coding, tol)

    monkeypatch.setattr(sparse_time, "_fit_label", counted)
    taken_over = fit_sparse_time(features, y, c=0.3, n_jobs=1, start=start)
    assert runs == [1]  # label 0 taken over; label 2 (no positive) is never run
    for name in ("own_weight", "shared_weight", "bias", "fitted"):
        np.testing.assert_array_equal(getattr(taken_over, name), getattr(scratch, name))
    runs.clear()
    fit_sparse_time(features, y, c=0.1, n_jobs=1, start=start)
    assert runs == [0, 1]
    runs.clear()
    fit_sparse_time(features, y, c=0.3, n_jobs=1, start=start, select_c=None)  # same C, codes chosen otherwise
    assert runs == [0, 1]
    runs.clear()
    fit_sparse_time(features, y, c=0.3, n_jobs=1, start=start, bins="indicator")  # same C, bins read otherwise
    assert runs == [0, 1]


def test_a_grid_of_cs_chooses_each_label_s_codes_once_and_equals_a_fit_at_each_c(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The codes a label reads are chosen before the refit and do not depend on its C: a grid of Cs (the C
    choice) runs the selecting fit once per label, and each C's fit is exactly ``fit_sparse_time`` at it."""
    import behrt_rope.evaluation.sparse_time as sparse_time

    rng = np.random.default_rng(9)
    features, y = _noisy_cohort(2000, 6, rng)
    grid = fit_sparse_time_grid(features, y, (0.3, 1.0), n_jobs=1)
    assert list(grid) == [0.3, 1.0]
    for c, fit in grid.items():
        alone = fit_sparse_time(features, y, c=c, n_jobs=1)
        for name in ("own_weight", "shared_weight", "bias", "fitted"):
            np.testing.assert_array_equal(getattr(fit, name), getattr(alone, name))
        assert fit.c == c and fit.select_c == SELECT_C
    assert not np.array_equal(grid[0.3].shared_weight, grid[1.0].shared_weight)
    strengths: list[float] = []
    real = sparse_time.l1_logistic_regression
    monkeypatch.setattr(sparse_time, "l1_logistic_regression", lambda c, tol: strengths.append(c) or real(c, tol))
    fit_sparse_time_grid(features, y, (0.3, 1.0), n_jobs=1, labels=np.array([0, 1]))
    assert strengths == [SELECT_C, 0.3, 1.0] * 2  # per label: one selection, then one refit per C


def _noisy_cohort(n: int, codes: int, rng: np.random.Generator) -> tuple[TimeFeatures, np.ndarray]:
    """Label 0 follows code 1's years since first record (likely 2-3 years after it); every label code is
    recorded at random with random timing, so most of the ``codes`` are noise to label 0."""
    per_code = np.full((n, codes, 6), NAN, dtype=np.float32)
    per_code[:, :, [0, 1, 5]] = 0.0
    ever = rng.random((n, codes)) < 0.4
    years = rng.uniform(0.0, 10.0, (n, codes))
    rows, cols = np.nonzero(ever)
    per_code[rows, cols, 0], per_code[rows, cols, 1], per_code[rows, cols, 4] = 1.0, 1.0, years[rows, cols]
    per_code[rows, cols, 2], per_code[rows, cols, 3] = 3.0, 180.0
    per_code[rows, cols, 5] = rng.random(len(rows)) < 0.3
    per_sample = np.column_stack([rng.uniform(20, 80, n), rng.integers(1, 20, n), rng.uniform(10, 300, n), np.ones(n)])
    window = ever[:, 1] & (years[:, 1] >= 2.0) & (years[:, 1] < 3.0)
    y = (rng.random((n, codes)) < 0.1).astype(np.int64)
    y[:, 0] = rng.random(n) < np.where(window, 0.5, 0.05)
    return TimeFeatures(per_code, per_sample.astype(np.float32)), y


def _codes_read(fit: object, label: int, codes: int) -> set[int]:
    """The label codes whose shared timing columns carry a weight in ``label``'s regression."""
    timing = fit.shared_weight[label, : PER_CODE_COLUMNS * codes].reshape(codes, PER_CODE_COLUMNS)  # type: ignore[attr-defined]
    return set(np.flatnonzero(np.any(timing != 0, axis=1)).tolist())


def test_the_relaxed_fit_reads_only_the_codes_its_selection_chose_and_shrinks_them_less() -> None:
    """The first fit (strong penalty) chooses the codes; the refit (weak penalty) reads exactly those, so it
    keeps the noise codes a single fit at the weak penalty lets in out, and gives the true code's window a
    larger weight than a single fit at the strong penalty."""
    rng = np.random.default_rng(8)
    codes = 30
    features, y = _noisy_cohort(4000, codes, rng)
    one_label = {"n_jobs": 1, "labels": np.array([0]), "bins": "indicator"}  # a weight per bin, shrunk alone
    relaxed = fit_sparse_time(features, y, c=0.3, select_c=0.02, **one_label)
    selection = fit_sparse_time(features, y, c=0.02, select_c=None, **one_label)
    weak = fit_sparse_time(features, y, c=0.3, select_c=None, **one_label)
    chosen = _codes_read(selection, 0, codes)
    assert 1 in chosen and _codes_read(relaxed, 0, codes) == chosen  # exactly the chosen codes, all 7 columns free
    assert len(_codes_read(weak, 0, codes) - {1}) > len(chosen - {1})  # seeded: the weak single fit reads more noise
    window = 2  # code 1's 2-3 year bin among its 7 shared columns
    strong_weight = selection.shared_weight[0, PER_CODE_COLUMNS + window]
    assert relaxed.shared_weight[0, PER_CODE_COLUMNS + window] > strong_weight > 0
    assert relaxed.select_c == 0.02 and selection.select_c is None


def test_cumulative_bins_span_the_same_model_and_map_back_to_a_weight_per_bin() -> None:
    """Any weights on the cumulative design give exactly the logits of their mapped-back weights on the
    indicator design, so the model's per-bin buffers hold a cumulative fit unchanged."""
    rng = np.random.default_rng(11)
    codes = 4
    features, _ = _noisy_cohort(300, codes, rng)
    features.per_code[:, 0, 2:4] = rng.integers(0, 8, 300)[:, None]  # the own code's visits and days since
    coding = CumulativeBins.for_labels(codes)
    indicator = shared_design(features)
    cumulative = (indicator @ coding.shared).tocsr()
    weights = rng.normal(size=OWN_COLUMNS + indicator.shape[1])
    for j in range(codes):
        got = label_design(features, cumulative, j, coding.own) @ weights
        want = label_design(features, indicator, j) @ coding.to_indicator(weights)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # cumulative column k of a code's years-since-first bins: recorded at least that long ago
    years = features.per_code[:, 1, 4]
    at_least_two = cumulative[:, PER_CODE_COLUMNS + 2].toarray().ravel()
    np.testing.assert_array_equal(at_least_two, (years >= 2.0) & ~np.isnan(years))


def test_cumulative_bins_find_an_effect_that_holds_over_the_years_at_a_penalty_that_hides_it_bin_by_bin() -> None:
    """Label 0 is three times as likely once code 1 is recorded, however long ago (a step at its first bin);
    among 30 codes recorded at random. At the same strong L1 penalty, cumulative bins pay for that effect once
    and read code 1 alone, the same weight in each of its six year bins; a weight per bin pays six times, and
    the fit all but drops it."""
    rng = np.random.default_rng(8)
    codes = 30
    features, y = _noisy_cohort(4000, codes, rng)
    ever = ~np.isnan(features.per_code[:, 1, 4])
    y[:, 0] = rng.random(len(y)) < np.where(ever, 0.3, 0.1)  # log-odds ratio 1.35
    fits = {
        bins: fit_sparse_time(features, y, c=0.02, n_jobs=1, labels=np.array([0]), select_c=None, bins=bins)
        for bins in ("cumulative", "indicator")
    }
    years = slice(PER_CODE_COLUMNS, 2 * PER_CODE_COLUMNS - 1)  # code 1's six years-since-first bins
    cumulative, indicator = (fits[b].shared_weight[0, years] for b in ("cumulative", "indicator"))
    assert _codes_read(fits["cumulative"], 0, codes) == {1}
    np.testing.assert_allclose(cumulative, cumulative[0])
    assert cumulative[0] > 0.5  # seeded: 0.80
    assert indicator.mean() < 0.1 and (indicator == 0).sum() >= 4  # seeded: one bin at 0.05
    assert fits["cumulative"].bins == "cumulative" and fits["indicator"].bins == "indicator"
