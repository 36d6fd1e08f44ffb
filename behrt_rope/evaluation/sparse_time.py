"""The sparse time regression: an L1 logistic regression on binned time features of every label code.

The gradient-boosted reference reads, per label, that label's own time features and only *whether* each
other code was ever recorded. Many effects in health records are about the timing of *another* code (a
complication that appears some years after its parent condition was first recorded), and they are sparse:
of all code pairs, few matter. This reference reads the timing of every label code as indicator bins, so a
linear model can learn each shape, and an L1 penalty picks the few pairs that matter among them:

* per label ``j``, its own code: ever recorded, log(1 + visits with it), visits since last recorded
  (0, 1, ..., 5+), days since (bins at 30, 90, 365 and 1,095 days), years since first recorded (bins at 1, 2,
  3, 5 and 8 years), recorded at the last visit (20 columns);
* shared by all labels, every label code: years since first recorded in the same bins (0 when never) and
  recorded at the last visit (7 per code);
* per sample: age in 10-year bins, sex, log(1 + visits so far), days since the previous visit in bins (18).

Each label is fitted as a *relaxed lasso* (Meinshausen 2007): a first L1 fit at a strong penalty
(``select_c``) only chooses which other codes' timing the label reads; a second L1 fit at a weaker one
(``c``) reads the label's own columns, all 7 columns of each code the first fit gave any weight, and the
per-sample columns. One L1 fit at one strength must trade the two against each other: strong enough to keep
the chance pairs out (of ``L`` codes, few matter to a label), it shrinks the pairs and the own-code shape
that do matter. ``select_c=None`` fits once, at ``c``, on everything.

Both fits read the ordered bins *cumulatively* (``bins="cumulative"``, :class:`CumulativeBins`): the column
of bin ``k`` is 1 where the value falls in bin ``k`` or a later one, so a weight is the step from one bin to
the next and the L1 penalty is on the steps (a fused lasso along each time axis). A code whose effect holds
the same over the years since it was first recorded then costs one weight, not six equal ones, which helps the
selection tell the codes that matter from chance pairs. The two codings span the same model; the fitted
weights are mapped back to one weight per bin (``bins="indicator"``, each bin its own column), the layout the
model's buffers keep.

Built from :class:`~behrt_rope.evaluation.time_features.TimeFeatures`, the gradient-boosted reference's
own inputs; nothing is specific to a cohort. On the recurrence benchmark cohort it closed 82% of the
logistic-regression-to-oracle gap at the held-out cuts, where the transformer closed 66% and gradient
boosting 63% (docs/benchmarks.md, "Ninth round").
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, cast, get_args

import numpy as np
import scipy.sparse as sp
import sklearn
from joblib import Parallel, delayed
from scipy.linalg import block_diag
from scipy.special import expit, logit
from sklearn.linear_model import LogisticRegression
from tqdm.auto import tqdm

from behrt_rope.evaluation.baseline import index_arrays, tuning_label_sample
from behrt_rope.evaluation.time_features import TimeFeatures
from behrt_rope.model.sparse_time_path import (
    AGE_EDGES,
    DAYS_EDGES,
    GAP_EDGES,
    OWN_COLUMNS,
    PER_CODE_COLUMNS,
    SEX_IDS,
    VISITS_EDGES,
    YEARS_EDGES,
    shared_columns,
)
from behrt_rope.training.tasks import macro_average_precision

log = logging.getLogger("behrt_rope.evaluation")

DEFAULT_C = 0.3
"""Inverse L1 strength of the refit where none is chosen on the data (no tuning split)."""
SELECT_C = 0.05
"""Inverse L1 strength of the first fit, which only chooses the other codes a label reads (None: no such fit).
Selecting at 0.05 and refitting at 0.3 raised the model's tuning macro AP on all seven tuning cohorts tried
(+0.0008 to +0.0047) against one fit at 0.1 (docs/benchmarks.md, "Thirty-first round"). On cumulative bins,
0.02 scored as 0.05 on ten tuning cohorts in half the time, but lost a narrow timing window in 3,000 samples
that 0.05 finds (``tests/test_sparse_time.py``): 0.05 stays ("Thirty-second round")."""
C_GRID = (DEFAULT_C, 1.0)
"""The inverse L1 strengths of the refit that :func:`choose_sparse_c` picks from on the tuning split,
:data:`DEFAULT_C` first (ties go to it). With the codes chosen at :data:`SELECT_C`, refits at 0.3 and 1 scored
within 0.0005 of each other on the tuning splits of seven cohorts of 64 to 295 codes, each ahead on some
(docs/benchmarks.md, "Thirty-first round"). One fit on every column (``select_c=None``) had 0.1 best on 64 and
92 codes and 0.3 on 295 and 779 ("Twenty-ninth round")."""
Bins = Literal["cumulative", "indicator"]
BINS: tuple[str, ...] = get_args(Bins)
"""How the fits read the ordered bins (the module docstring): ``cumulative`` (the default) or ``indicator`` (the
default until session 34). Against it, at the same strengths (codes chosen at 0.05, refit at 0.3), cumulative
bins moved the model's tuning macro AP by -0.0012 to +0.0032 on ten tuning cohorts, +0.0012 on average: gains
on short, sparse histories and large vocabularies, a small loss on the two dense ones, where the fit takes 2.6
to 4 times as long (docs/benchmarks.md, "Thirty-second round")."""
DEFAULT_BINS: Bins = "cumulative"
TOL = 1e-3
"""liblinear's stopping tolerance for both fits (scikit-learn's default is 1e-4). The refits of the cumulative
bins converge slowly at 1e-4 (7 s a label at C=1 on the demo cohort). At 1e-3, on six cohorts, the fit with its
C chosen (``evaluate``'s reference) chose the same C, its tuning macro AP moved by 0.0002 at most, and it took
1.4 to 4.5 times less time (the demo cohort: 130 s instead of 498 s; docs/benchmarks.md, "Thirty-fourth
round")."""
TUNING_LABELS = 60
"""Most label codes :func:`choose_sparse_c` scores each C on (a seeded sample; all when there are fewer)."""


def bins(values: np.ndarray, edges: tuple[float, ...]) -> np.ndarray:
    """One-hot bin of each value, ``values.shape + (len(edges) + 1,)`` float32; NaN (never recorded) -> zeros.

    >>> bins(np.array([0.2, 3.0, np.nan]), (1.0, 2.0)).tolist()
    [[1.0, 0.0, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]
    """
    values = np.asarray(values, dtype=np.float64)
    out = np.eye(len(edges) + 1, dtype=np.float32)[np.digitize(np.nan_to_num(values, nan=0.0), edges)]
    return np.where(np.isnan(values)[..., None], np.float32(0.0), out)


def shared_design(features: TimeFeatures) -> sp.csr_array:
    """``(N, 7 L + 18)`` the columns every label reads: each label code's years-since-first bins and
    last-visit flag (7 per code, built sparse: most codes are absent from most histories), then the per-sample
    bins."""
    per_code = features.per_code  # (N, L, 6): ever, n_visits, visits_since, days_since, years_since_first, in_last
    n, n_codes = per_code.shape[:2]
    width = PER_CODE_COLUMNS  # the layout refit_columns and the model's path read
    rows, codes = np.nonzero(~np.isnan(per_code[:, :, 4]))  # recorded codes
    year_bin = np.digitize(per_code[rows, codes, 4], YEARS_EDGES)
    last_rows, last_codes = np.nonzero(per_code[:, :, 5] > 0)
    shape = (n, n_codes * width)
    timing = sp.csr_array(
        (
            np.ones(len(rows) + len(last_rows), dtype=np.float32),
            index_arrays(
                np.concatenate([rows, last_rows]),
                np.concatenate([codes * width + year_bin, last_codes * width + width - 1]),
                shape,
            ),
        ),
        shape=shape,
    )
    age, visits, gap, sex = (features.per_sample[:, i] for i in range(4))
    sample = [
        bins(age, AGE_EDGES),  # (N, 9)
        (sex[:, None] == np.array(SEX_IDS)).astype(np.float32),  # (N, 3): female, male, other (0 is unknown)
        np.log1p(visits)[:, None],  # (N, 1)
        bins(gap, GAP_EDGES),  # (N, 5); no bin at a history's first visit
    ]
    return sp.hstack([timing, sp.csr_array(np.concatenate(sample, axis=1))], format="csr")


def own_design(features: TimeFeatures, j: int) -> np.ndarray:
    """``(N, 20)`` label ``j``'s own code in bins (see the module docstring)."""
    own = features.per_code[:, j]  # (N, 6)
    return np.concatenate(
        [
            own[:, 0:1],
            np.log1p(own[:, 1:2]),
            bins(own[:, 2], VISITS_EDGES),
            bins(own[:, 3], DAYS_EDGES),
            bins(own[:, 4], YEARS_EDGES),
            own[:, 5:6],
        ],
        axis=1,
    )


def label_design(
    features: TimeFeatures, shared: sp.csr_array, j: int, own_map: np.ndarray | None = None
) -> sp.csr_array:
    """``(N, 20 + 7 L + 18)`` label ``j``'s model input: its own columns (times ``own_map`` ``(20, 20)``
    when given: :attr:`CumulativeBins.own`), then ``shared`` (:func:`shared_design`, coded the same way)."""
    own = own_design(features, j)
    return sp.hstack([sp.csr_array(own if own_map is None else own @ own_map), shared], format="csr")


def _steps(size: int, first: bool) -> np.ndarray:
    """``(size, size)`` the map from a group's indicator bins to its cumulative ones: column ``k`` adds the
    bins ``k`` and later; without ``first``, column 0 (every bin: what ``ever`` or the intercept already is)
    is left empty.

    >>> _steps(3, first=False).tolist()
    [[0.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 1.0, 1.0]]
    """
    steps = np.tril(np.ones((size, size), dtype=np.float32))
    if not first:
        steps[:, 0] = 0.0
    return steps


@dataclass(frozen=True)
class CumulativeBins:
    """The cumulative coding of :func:`label_design`'s ordered bins (the module docstring): the design times
    these block-diagonal maps is the cumulative design, and the maps times its weights are the indicator
    weights, which give the same logits on the indicator design.

    Grouped bins: the own code's visits, days and years since (``ever`` is their first bin), each other code's
    years since first recorded (never recorded: no bin), age (always one bin: the intercept is the first) and
    days since the previous visit (none at a history's first visit). Other columns pass through.
    """

    own: np.ndarray
    """``(20, 20)`` for :func:`own_design`'s columns."""
    shared: sp.csr_array
    """``(7 L + 18, 7 L + 18)`` for :func:`shared_design`'s columns."""

    @classmethod
    def for_labels(cls, n_labels: int) -> CumulativeBins:
        """The maps for ``n_labels`` label codes.

        >>> coding = CumulativeBins.for_labels(2)
        >>> coding.own.shape, coding.shared.shape
        ((20, 20), (32, 32))
        """
        visits, days, years = len(VISITS_EDGES) + 1, len(DAYS_EDGES) + 1, len(YEARS_EDGES) + 1
        own = block_diag(np.eye(2), _steps(visits, False), _steps(days, False), _steps(years, False), np.eye(1))
        per_code = [sp.coo_array(block_diag(_steps(years, True), np.eye(1)))] * n_labels
        sample = [_steps(len(AGE_EDGES) + 1, False), np.eye(len(SEX_IDS)), np.eye(1), _steps(len(GAP_EDGES) + 1, True)]
        # Sparse blocks, so a sparse array comes out (SciPy 1.18 deprecates block_diag of dense blocks only).
        shared = sp.block_diag([*per_code, *map(sp.coo_array, sample)], format="csr", dtype=np.float32)
        return cls(own.astype(np.float32), shared)

    def to_indicator(self, coef: np.ndarray) -> np.ndarray:
        """``(20 + 7 L + 18,)`` indicator weights of the cumulative weights ``coef`` (same shape)."""
        own = OWN_COLUMNS
        return np.concatenate([self.own @ coef[:own], self.shared @ coef[own:]])


def l1_logistic_regression(c: float, tol: float = TOL) -> LogisticRegression:
    """An L1-penalised logistic regression (liblinear, stopping at ``tol``); scikit-learn 1.8 replaced
    ``penalty="l1"`` by ``l1_ratio=1``."""
    if tuple(int(part) for part in sklearn.__version__.split(".")[:2]) >= (1, 8):
        return LogisticRegression(C=c, l1_ratio=1.0, solver="liblinear", tol=tol, max_iter=2000, random_state=0)
    return LogisticRegression(C=c, penalty="l1", solver="liblinear", tol=tol, max_iter=2000, random_state=0)


@dataclass
class SparseTimeFit:
    """The fitted regression of every label, on the logit scale (the layout of
    :class:`~behrt_rope.model.sparse_time_path.SparseTimePath`'s buffers)."""

    own_weight: np.ndarray
    """``(L, 20)`` weights of each label's own columns (:func:`own_design`)."""
    shared_weight: np.ndarray
    """``(L, 7 L + 18)`` weights of the shared columns (:func:`shared_design`); 0 for every code the selection
    left out."""
    bias: np.ndarray
    """``(L,)`` intercepts; a label not fitted has the logit of its training rate and no weights."""
    c: float = DEFAULT_C
    """The inverse L1 strength the regressions were (re)fitted at."""
    fitted: np.ndarray | None = None
    """``(L,)`` bool: the labels whose regression was run (the others have their rate); None: none."""
    select_c: float | None = SELECT_C
    """The inverse L1 strength of the fit that chose the codes each label reads (None: no such fit)."""
    bins: Bins = DEFAULT_BINS
    """How the fits read the ordered bins (:data:`BINS`); the weights above are per bin either way."""

    def reusable_labels(self, c: float, select_c: float | None, n_labels: int, bins: Bins = DEFAULT_BINS) -> np.ndarray:
        """Column indices of the labels fitted at ``c`` (chosen at ``select_c``, reading ``bins``) that a fit of
        ``n_labels`` labels can take over."""
        same = (self.c, self.select_c, self.bins) == (c, select_c, bins)
        if self.fitted is None or not same or len(self.fitted) != n_labels:
            return np.zeros(0, dtype=np.int64)
        return np.flatnonzero(self.fitted)

    def set_label(self, j: int, coef: np.ndarray, intercept: float) -> None:
        """Label ``j``'s fitted ``(20 + 7 L + 18,)`` indicator weights (:func:`label_design`'s columns) and
        intercept, marked fitted."""
        assert self.fitted is not None
        self.own_weight[j], self.shared_weight[j] = coef[:OWN_COLUMNS], coef[OWN_COLUMNS:]
        self.bias[j], self.fitted[j] = intercept, True

    def take_labels(self, other: SparseTimeFit, labels: np.ndarray) -> None:
        """Take ``other``'s weights and intercepts of ``labels`` (column indices) as they are, marked fitted."""
        assert self.fitted is not None
        self.own_weight[labels], self.shared_weight[labels] = other.own_weight[labels], other.shared_weight[labels]
        self.bias[labels], self.fitted[labels] = other.bias[labels], True

    def logits(self, features: TimeFeatures) -> np.ndarray:
        """``(N, L)`` decision values on ``features``."""
        out = np.asarray(shared_design(features) @ self.shared_weight.T + self.bias)  # (N, L)
        for j in range(len(self.bias)):
            out[:, j] += own_design(features, j) @ self.own_weight[j]
        return out


def fit_sparse_time(
    train: TimeFeatures,
    Y_train: np.ndarray,
    c: float = DEFAULT_C,
    progress: bool = False,
    n_jobs: int | None = -1,
    labels: np.ndarray | None = None,
    start: SparseTimeFit | None = None,
    select_c: float | None = SELECT_C,
    bins: Bins = DEFAULT_BINS,
) -> SparseTimeFit:
    """One relaxed L1 logistic regression per label on its own and the shared columns (the module docstring;
    ``select_c`` None: one L1 fit at ``c``; ``bins`` of :data:`BINS`). A label constant in training (or with
    fewer than two positives) gets the logit of its training rate (clipped to [1e-6, 1 - 1e-6]), as the other
    references give it that rate; with ``labels`` (column indices), so does every label not among them.
    Labels are fitted in parallel processes (``n_jobs``, -1: all cores); the result does not depend on
    ``n_jobs`` and is the same at every run. ``start``, an earlier fit on the same rows (the C choice's),
    gives the labels it fitted by the same rule as they are: each label's fit depends on nothing else, so the
    result equals a fit from scratch."""
    return fit_sparse_time_grid(train, Y_train, (c,), progress, n_jobs, labels, start, select_c, bins)[float(c)]


def fit_sparse_time_grid(
    train: TimeFeatures,
    Y_train: np.ndarray,
    grid: tuple[float, ...],
    progress: bool = False,
    n_jobs: int | None = -1,
    labels: np.ndarray | None = None,
    start: SparseTimeFit | None = None,
    select_c: float | None = SELECT_C,
    bins: Bins = DEFAULT_BINS,
    tol: float = TOL,
) -> dict[float, SparseTimeFit]:
    """:func:`fit_sparse_time` at each (refit) C of ``grid``, keyed by C: each label's codes are chosen once,
    at ``select_c``, for all of them (the choice does not depend on the refit's C). Each fit equals
    :func:`fit_sparse_time` at its C: liblinear reseeds at every fit. ``start`` gives the labels it can give
    every C of the grid (with one C, as :func:`fit_sparse_time`). ``tol``: liblinear's (:data:`TOL`; its own
    fits only: ``start`` does not record one)."""
    Y = np.asarray(Y_train)
    if Y.ndim != 2 or Y.shape[0] != len(train):
        raise ValueError(f"Y_train must be (N_train, L) with N_train = {len(train)}, got {Y.shape}")
    n_labels, cs = Y.shape[1], [float(c) for c in dict.fromkeys(grid)]
    rate = logit(np.clip(Y.mean(axis=0) if Y.shape[0] else np.zeros(n_labels), 1e-6, 1 - 1e-6)).astype(np.float32)
    fits = {c: _rate_fit(rate, c, select_c, _checked_bins(bins)) for c in cs}
    varying = np.flatnonzero((Y.min(axis=0) < Y.max(axis=0)) & (Y.sum(axis=0) >= 2)) if len(Y) else np.zeros(0, int)
    if labels is not None:
        varying = np.intersect1d(varying, np.asarray(labels, dtype=np.int64))
    if start is not None:
        done = varying
        for c in cs:
            done = np.intersect1d(done, start.reusable_labels(c, select_c, n_labels, bins))
        for fit in fits.values():
            fit.take_labels(start, done)
        varying = np.setdiff1d(varying, done)
    if not len(varying):
        return fits
    coding = CumulativeBins.for_labels(n_labels) if bins == "cumulative" else None
    shared = shared_design(train) if coding is None else (shared_design(train) @ coding.shared).tocsr()
    todo = tqdm(varying, desc="sparse time regression", unit="label", disable=not progress, leave=False)
    # Processes, not threads: liblinear draws its coordinate order from one process-wide generator, so fits
    # running side by side in threads interleave their draws and the weights change from run to run.
    # joblib memory-maps the large arrays once for all the workers.
    tasks = (delayed(_fit_label)(train, shared, j, Y[:, j], cs, select_c, coding, tol) for j in todo)
    for j, per_c in zip(varying, Parallel(n_jobs=n_jobs, backend="loky")(tasks)):
        for fit, (coef, intercept) in zip(fits.values(), per_c):
            fit.set_label(int(j), coef, intercept)
    return fits


def _rate_fit(rate: np.ndarray, c: float, select_c: float | None, bins: Bins) -> SparseTimeFit:
    """A fit of ``len(rate)`` labels that gives each the logit ``rate`` and no weights (none fitted yet)."""
    n_labels = len(rate)
    return SparseTimeFit(
        np.zeros((n_labels, OWN_COLUMNS), np.float32),
        np.zeros((n_labels, shared_columns(n_labels)), np.float32),
        rate.copy(),
        c,
        np.zeros(n_labels, dtype=bool),
        select_c,
        bins,
    )


def _fit_label(
    train: TimeFeatures,
    shared: sp.csr_array,
    j: int,
    y: np.ndarray,
    cs: list[float],
    select_c: float | None,
    coding: CumulativeBins | None = None,
    tol: float = TOL,
) -> list[tuple[np.ndarray, float]]:
    """Label ``j``'s relaxed L1 regressions on its design (``y`` ``(N,)`` 0/1; ``shared`` already coded with
    ``coding`` when given), one per refit C of ``cs`` after one selection: ``(coefficients, intercept)`` per
    indicator column of :func:`label_design`, 0 on those the selection left out."""
    design, y = label_design(train, shared, j, None if coding is None else coding.own), y.astype(int)
    width = design.shape[1]
    columns: np.ndarray | slice = slice(None)
    if select_c is not None:
        columns = refit_columns(l1_logistic_regression(select_c, tol).fit(design, y).coef_[0], train.per_code.shape[1])
        design = design[:, columns]
    out = []
    for c in cs:
        model = l1_logistic_regression(c, tol).fit(design, y)
        coef = np.zeros(width)
        coef[columns] = model.coef_[0]
        out.append(((coef if coding is None else coding.to_indicator(coef)), float(model.intercept_[0])))
    return out


def _checked_bins(bins: str) -> Bins:
    """``bins`` when it is one of :data:`BINS`, else a clear error."""
    if bins not in BINS:
        raise ValueError(f"sparse time bins must be one of {', '.join(BINS)}, got {bins!r}")
    return cast(Bins, bins)


def refit_columns(selection: np.ndarray, n_labels: int) -> np.ndarray:
    """Columns of :func:`label_design` (``OWN_COLUMNS + 7 n_labels + 18`` of them) that the refit reads, given
    the selecting fit's coefficients ``selection`` over all of them: the own columns, all 7 columns of every
    label code with a non-zero weight in any of its 7, and the per-sample columns.

    >>> selection = np.zeros(OWN_COLUMNS + 7 * 3 + 18)
    >>> selection[OWN_COLUMNS + 7 + 2] = 0.4  # code 1, one of its year bins
    >>> columns = refit_columns(selection, 3)
    >>> len(columns) - OWN_COLUMNS - 18, columns[OWN_COLUMNS : OWN_COLUMNS + 7].tolist()
    (7, [27, 28, 29, 30, 31, 32, 33])
    """
    timing = selection[OWN_COLUMNS : OWN_COLUMNS + PER_CODE_COLUMNS * n_labels].reshape(n_labels, PER_CODE_COLUMNS)
    codes = np.flatnonzero(np.any(timing != 0, axis=1))
    chosen = OWN_COLUMNS + (codes[:, None] * PER_CODE_COLUMNS + np.arange(PER_CODE_COLUMNS)).ravel()
    rest = np.arange(OWN_COLUMNS + PER_CODE_COLUMNS * n_labels, len(selection))
    return np.concatenate([np.arange(OWN_COLUMNS), chosen, rest]).astype(np.int64)


def choose_sparse_c(
    train: TimeFeatures,
    Y_train: np.ndarray,
    tune: TimeFeatures,
    Y_tune: np.ndarray,
    grid: tuple[float, ...] = C_GRID,
    max_labels: int = TUNING_LABELS,
    seed: int = 0,
    n_jobs: int | None = -1,
    select_c: float | None = SELECT_C,
    bins: Bins = DEFAULT_BINS,
) -> tuple[float, dict[float, float], int, SparseTimeFit]:
    """The (refit) C of ``grid`` whose regressions (codes chosen at ``select_c``) have the best macro AP on the
    tuning rows (``tune``, ``Y_tune`` (N_tune, L)), scored on a seeded sample of at most ``max_labels`` label
    codes with a positive in both splits (:func:`~behrt_rope.evaluation.baseline.tuning_label_sample`); that
    macro AP for every C; the number of label codes scored; and the chosen C's fit of those codes (``start`` for
    the full :func:`fit_sparse_time`). Ties go to the earlier C (:data:`C_GRID` lists :data:`DEFAULT_C` first)."""
    if not grid:
        raise ValueError("choose_sparse_c needs at least one C")
    Y_tune = np.asarray(Y_tune)
    labels = tuning_label_sample(Y_train, Y_tune, max_labels, seed)
    fits = fit_sparse_time_grid(train, Y_train, grid, n_jobs=n_jobs, labels=labels, select_c=select_c, bins=bins)
    scores = {c: macro_average_precision(Y_tune[:, labels], fit.logits(tune)[:, labels]) for c, fit in fits.items()}
    order = list(fits)
    chosen = max(order, key=lambda c: (scores[c], -order.index(c)))
    return chosen, scores, len(labels), fits[chosen]


def sparse_c_setting(
    c: float | None,
    train: TimeFeatures,
    Y_train: np.ndarray,
    tune: Callable[[], TimeFeatures],
    Y_tune: np.ndarray,
    seed: int = 0,
    logger: logging.Logger = log,
    what: str = "sparse time regression",
    select_c: float | None = SELECT_C,
    bins: Bins = DEFAULT_BINS,
) -> tuple[float, dict[str, Any], SparseTimeFit | None]:
    """The C to fit with, how it was set (what ``metrics.json`` ``sparse_time_c`` records) and the choice's
    fit of its sampled labels at that C (``start`` for :func:`fit_sparse_time`; None without a choice):
    ``c`` when given; else :data:`DEFAULT_C` when there is no tuning row (``Y_tune`` (N_tune, L)), with a
    warning; else the choice of :func:`choose_sparse_c` on the tuning features that ``tune()`` builds (only
    then), logged on ``logger`` as ``what`` (the caller's stage and name for the regression). The codes each
    label reads are chosen at ``select_c``, and the bins read as ``bins``, in every case (the report records
    both)."""
    rule = {"select_c": select_c, "bins": _checked_bins(bins)}
    if c is not None:
        return c, {"c": c, "chosen_on": "fixed (sparse_time_c)", **rule}, None
    if not len(Y_tune):
        logger.warning("%s: no tuning samples to choose the C; using C=%g", what, DEFAULT_C)
        return DEFAULT_C, {"c": DEFAULT_C, "chosen_on": "default (no tuning samples)", **rule}, None
    chosen, scores, n_labels, start = choose_sparse_c(
        train, Y_train, tune(), Y_tune, seed=seed, select_c=select_c, bins=bins
    )
    by_c = {f"{k:g}": round(v, 5) for k, v in scores.items()}
    logger.info(
        "%s C=%g, chosen on %d tuning samples and %d label codes (macro AP by C: %s)",
        what,
        chosen,
        len(Y_tune),
        n_labels,
        by_c,
    )
    report = {
        "c": chosen,
        "chosen_on": "tuning split",
        **rule,
        "tuning_labels": n_labels,
        "tuning_macro_ap": by_c,
    }
    return chosen, report, start


def fit_predict_sparse_time(
    train: TimeFeatures,
    Y_train: np.ndarray,
    evaluate: TimeFeatures,
    c: float = DEFAULT_C,
    progress: bool = False,
    n_jobs: int | None = -1,
    start: SparseTimeFit | None = None,
    select_c: float | None = SELECT_C,
    bins: Bins = DEFAULT_BINS,
) -> np.ndarray:
    """:func:`fit_sparse_time` on ``train`` (taking over ``start``'s labels), then ``(N_eval, L)``
    probabilities on ``evaluate``."""
    fit = fit_sparse_time(train, Y_train, c, progress, n_jobs, start=start, select_c=select_c, bins=bins)
    return np.asarray(expit(fit.logits(evaluate))) if len(evaluate) else np.zeros((0, len(fit.bias)))
