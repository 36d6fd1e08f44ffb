"""The reference models every report compares against.

* Bag-of-codes logistic regression: each sample's input history becomes a sparse row of code indicators (or
  counts) over the token vocabulary, optionally with a few dense columns (age at prediction time, ...), and
  one L2-regularised logistic regression per label code turns it into a probability. It ignores order and
  timing.
* Gradient boosting on time features (``behrt_rope.evaluation.time_features``): per label code, how often,
  how recently and for how long it has been recorded, plus age and visit timing; one histogram
  gradient-boosted tree model per label. This is the strong cheap baseline: the transformer earns its cost
  only by beating it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias

import numpy as np
import scipy.sparse as sp
from joblib import Parallel, delayed
from sklearn.ensemble import HistGradientBoostingClassifier
from sklearn.linear_model import LogisticRegression
from sklearn.preprocessing import StandardScaler
from threadpoolctl import threadpool_limits
from tqdm.auto import tqdm

from behrt_rope import schema
from behrt_rope.evaluation.time_features import TimeFeatures
from behrt_rope.training.tasks import macro_average_precision

FeatureMatrix: TypeAlias = sp.sparray | sp.spmatrix | np.ndarray
"""What the logistic regression reads: a sparse array (:func:`bag_of_codes`), a sparse matrix or a dense array."""

C_GRID = (0.01, 0.03, 0.1, 0.3, 1.0)
"""The logistic regression's inverse L2 strengths that :func:`choose_c` picks from on the tuning split. A
fixed C=1 fits 64 or 92 codes as well as any, and over-fits hundreds of them: on a 1,000-code cohort it
halved the regression's macro AP (docs/benchmarks.md, "Twenty-seventh round")."""


def flatten_token_lists(token_ids: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(flat ids (M,), offsets (N + 1,)) of N variable-length id arrays: sample i is
    ``flat[offsets[i]:offsets[i + 1]]`` (the layout of an Arrow list column's values and offsets)."""
    lengths = np.fromiter((len(ids) for ids in token_ids), dtype=np.int64, count=len(token_ids))
    offsets = np.zeros(len(token_ids) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if not len(token_ids):
        return np.zeros(0, dtype=np.int64), offsets
    return np.concatenate([np.asarray(ids, dtype=np.int64) for ids in token_ids]), offsets


def bag_of_codes(
    token_ids: Sequence[np.ndarray] | np.ndarray,
    vocab_size: int,
    offsets: np.ndarray | None = None,
    *,
    binary: bool = True,
    min_id: int = schema.N_SPECIAL,
) -> sp.csr_array:
    """(N, vocab_size) CSR array: row i counts (``binary``: flags) the token ids of sample i.

    Input either as a list of N int arrays, or as flat ids (M,) with ``offsets`` (N + 1,) (e.g. a pyarrow
    ``ListArray``'s ``.values`` and ``.offsets``). Ids below ``min_id`` (special tokens: [PAD], [CLS],
    [SEP], [MASK], [UNK]) are dropped, so their columns stay empty; ids outside [0, vocab_size) raise.

    >>> bag_of_codes([np.array([1, 5, 5, 6]), np.array([], dtype=int)], 8).toarray().tolist()
    [[0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]]
    """
    if offsets is None:
        flat, offsets = flatten_token_lists(list(token_ids))
    else:
        flat, offsets = np.asarray(token_ids, dtype=np.int64), np.asarray(offsets, dtype=np.int64)
    flat = flat[offsets[0] : offsets[-1]]
    if flat.size and (flat.min() < 0 or flat.max() >= vocab_size):
        raise ValueError(f"token ids must lie in [0, {vocab_size})")
    rows = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
    keep = flat >= min_id
    data = np.ones(int(keep.sum()))
    shape = (len(offsets) - 1, vocab_size)
    matrix = sp.csr_array((data, index_arrays(rows[keep], flat[keep], shape)), shape=shape)  # duplicates are summed
    matrix.sum_duplicates()
    if binary:
        matrix.data[:] = 1.0
    return matrix


def index_arrays(rows: np.ndarray, columns: np.ndarray, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """``rows`` and ``columns`` as int32 when ``shape`` fits it: a sparse array keeps the index dtype it is built
    from (a sparse matrix chose int32 itself), and liblinear refuses int64 indices.

    >>> [a.dtype.name for a in index_arrays(np.array([0, 1]), np.array([2, 0]), (2, 3))]
    ['int32', 'int32']
    """
    dtype = np.int32 if max(shape) <= np.iinfo(np.int32).max else np.int64
    return np.asarray(rows, dtype=dtype), np.asarray(columns, dtype=dtype)


def age_features(age_years: np.ndarray) -> np.ndarray:
    """(N, 2) dense columns for the age hook: age / 100 and its square (the baseline standardises them)."""
    age = np.asarray(age_years, dtype=float).reshape(-1, 1) / 100.0
    return np.hstack([age, age**2])


def sex_features(sex_ids: np.ndarray) -> np.ndarray:
    """(N, 3) one-hot columns female / male / other of sex ids (``schema.SEX_VALUES`` positions); unknown is
    all zeros.

    >>> sex_features(np.array([0, 1, 2, 3])).tolist()
    [[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]
    """
    ids = np.asarray(sex_ids, dtype=np.int64)
    return (ids[:, None] == np.arange(1, 4)[None, :]).astype(float)


def _with_extra(X: FeatureMatrix, extra: np.ndarray | None, scaler: StandardScaler | None) -> sp.csr_array:
    """``(N, F + E)`` CSR array of ``X`` ``(N, F)`` and the ``extra`` columns ``(N, E)`` (standardised by
    ``scaler`` when given)."""
    if extra is None:
        return sp.csr_array(X)
    dense = scaler.transform(np.asarray(extra, dtype=float)) if scaler else np.asarray(extra, dtype=float)
    return sp.hstack([sp.csr_array(X), sp.csr_array(dense)], format="csr")


def _fit_one(X: sp.csr_array, y: np.ndarray, X_eval: sp.csr_array, C: float, seed: int) -> np.ndarray:
    model = LogisticRegression(C=C, solver="liblinear", random_state=seed, max_iter=200)
    model.fit(X, y)
    return model.predict_proba(X_eval)[:, 1]


def fit_predict_baseline(
    X_train: FeatureMatrix,
    Y_train: np.ndarray,
    X_eval: FeatureMatrix,
    C: float = 1.0,
    seed: int = 0,
    *,
    extra_train: np.ndarray | None = None,
    extra_eval: np.ndarray | None = None,
    n_jobs: int | None = -1,
) -> np.ndarray:
    """Fit one logistic regression per label on (N_train, F) features and (N_train, L) 0/1 labels;
    return (N_eval, L) probabilities.

    L2 penalty with inverse strength ``C`` (liblinear solver, no class weights, so probabilities stay
    calibrated to the training prevalence). A label constant in training (all 0 or all 1) gets no model:
    its prediction is the training rate (0.0 or 1.0). ``extra_train``/``extra_eval`` are optional dense
    columns (N, E), e.g. ``age_features``, standardised on the training rows and appended to the
    features. Labels are fitted in parallel over ``n_jobs`` processes (-1: all cores).
    """
    Y = np.asarray(Y_train)
    if Y.ndim != 2 or Y.shape[0] != X_train.shape[0]:
        raise ValueError(f"Y_train must be (N_train, L) with N_train = {X_train.shape[0]}, got {Y.shape}")
    if (extra_train is None) != (extra_eval is None):
        raise ValueError("give extra columns for both train and eval, or for neither")
    scaler = None if extra_train is None else StandardScaler().fit(np.asarray(extra_train, dtype=float))
    Xt = _with_extra(X_train, extra_train, scaler)
    Xe = _with_extra(X_eval, extra_eval, scaler)
    rate = Y.mean(axis=0) if Y.shape[0] else np.zeros(Y.shape[1])
    out = np.tile(rate, (Xe.shape[0], 1)).astype(float)
    varying = np.flatnonzero((rate > 0) & (rate < 1))
    if len(varying) and Xe.shape[0]:
        columns = Parallel(n_jobs=n_jobs, prefer="threads")(  # liblinear releases the GIL
            delayed(_fit_one)(Xt, Y[:, j].astype(int), Xe, C, seed) for j in varying
        )
        out[:, varying] = np.column_stack(columns)
    return out


def choose_c(
    X_train: FeatureMatrix,
    Y_train: np.ndarray,
    X_tune: FeatureMatrix,
    Y_tune: np.ndarray,
    grid: Sequence[float] = C_GRID,
    seed: int = 0,
    *,
    extra_train: np.ndarray | None = None,
    extra_tune: np.ndarray | None = None,
) -> tuple[float, dict[float, float]]:
    """The C of ``grid`` whose regression (:func:`fit_predict_baseline` on the train rows) has the best macro
    AP on the tuning rows ``X_tune``/``Y_tune`` (N_tune, L), and that macro AP for every C. Ties go to the
    smaller C (the stronger penalty)."""
    if not len(grid):
        raise ValueError("choose_c needs at least one C")
    scores = {
        float(c): macro_average_precision(
            np.asarray(Y_tune),
            fit_predict_baseline(
                X_train, Y_train, X_tune, C=c, seed=seed, extra_train=extra_train, extra_eval=extra_tune
            ),
        )
        for c in grid
    }
    return max(scores, key=lambda c: (scores[c], -c)), scores


def _fit_gbm_one(X: np.ndarray, y: np.ndarray, X_eval: np.ndarray, params: Mapping[str, Any], seed: int) -> np.ndarray:
    informative = _informative_columns(X)
    model = HistGradientBoostingClassifier(**params, random_state=seed)
    model.fit(X[:, informative], y)
    return np.asarray(model.predict_proba(X_eval[:, informative])[:, 1])


GBM_PARAMS: dict[str, Any] = {
    "learning_rate": 0.2,
    "max_iter": 100,
    "max_leaf_nodes": 15,
    "min_samples_leaf": 40,
    "l2_regularization": 1.0,
    "max_bins": 32,
    "early_stopping": True,
    "validation_fraction": 0.15,
    "n_iter_no_change": 10,
    "scoring": "loss",
}
"""Settings every gradient-boosted reference shares, and the ``flexible`` entry of :data:`GBM_GRID`: shallow
trees, early stopping on a held-back 15% of the train rows by log-loss (the number of trees is tuned per label
on train data only). On a 44,000-sample, 92-label synthetic training set this fits all labels in about 75
CPU-seconds."""

GBM_GRID: dict[str, dict[str, Any]] = {
    "strong": {
        "learning_rate": 0.1,
        "max_iter": 200,
        "max_leaf_nodes": 5,
        "min_samples_leaf": 200,
        "l2_regularization": 10.0,
    },
    "moderate": {"learning_rate": 0.1, "max_iter": 200, "max_leaf_nodes": 7, "min_samples_leaf": 80},
    "flexible": {},
}
"""The regularisation settings (overrides of :data:`GBM_PARAMS`) that :func:`choose_gbm` picks from on the
tuning split, strongest first. Each label's model sees its own six time features and one column per other
label code, so with hundreds of codes most columns are noise, as with the logistic regression's C: on a
300-code cohort ``flexible`` scored 0.177 tuning macro AP and ``moderate`` 0.193, on the 92-code demo both
0.246 (docs/benchmarks.md, "Twenty-eighth round")."""

GBM_TUNING_LABELS = 40
"""Most label codes :func:`choose_gbm` scores each setting on (a seeded sample; all when there are fewer), so
that the choice costs a few label fits per setting rather than a whole reference per setting."""


def tuning_label_sample(Y_train: np.ndarray, Y_tune: np.ndarray, max_labels: int, seed: int = 0) -> np.ndarray:
    """Sorted column indices of a seeded sample of at most ``max_labels`` label codes that a reference can be
    fitted and scored on: 2+ positives among the train rows ``Y_train`` (N_train, L) and 1+ among the tuning
    rows ``Y_tune`` (N_tune, L). All such codes when there are no more than ``max_labels``.

    >>> tuning_label_sample(np.array([[1, 1, 0], [1, 0, 1]]), np.array([[1, 1, 1]]), 5).tolist()
    [0]
    """
    candidates = np.flatnonzero((np.asarray(Y_train).sum(axis=0) >= 2) & (np.asarray(Y_tune).sum(axis=0) >= 1))
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(candidates, size=min(max_labels, len(candidates)), replace=False))


def choose_gbm(
    train: TimeFeatures,
    Y_train: np.ndarray,
    tune: TimeFeatures,
    Y_tune: np.ndarray,
    grid: Mapping[str, Mapping[str, Any]] = GBM_GRID,
    max_labels: int = GBM_TUNING_LABELS,
    seed: int = 0,
    progress: bool = False,
) -> tuple[str, dict[str, float], int]:
    """The name of the ``grid`` setting whose models have the best macro AP on the tuning rows (``tune``,
    ``Y_tune`` (N_tune, L)), scored on a seeded sample of at most ``max_labels`` label codes that have a
    positive in both splits; that macro AP for every setting; and the number of label codes scored. Ties go to
    the earlier setting (``GBM_GRID`` lists the strongest regularisation first)."""
    if not grid:
        raise ValueError("choose_gbm needs at least one setting")
    Y_train, Y_tune = np.asarray(Y_train), np.asarray(Y_tune)
    labels = tuning_label_sample(Y_train, Y_tune, max_labels, seed)
    scores = {
        name: macro_average_precision(
            Y_tune[:, labels],
            fit_predict_gbm(train, Y_train, tune, seed=seed, params=params, progress=progress, labels=labels)[
                :, labels
            ],
        )
        for name, params in grid.items()
    }
    names = list(grid)
    return max(names, key=lambda n: (scores[n], -names.index(n))), scores, len(labels)


def fit_predict_gbm(
    train: TimeFeatures,
    Y_train: np.ndarray,
    evaluate: TimeFeatures,
    seed: int = 0,
    params: Mapping[str, Any] | None = None,
    progress: bool = False,
    n_jobs: int | None = -1,
    labels: Sequence[int] | np.ndarray | None = None,
) -> np.ndarray:
    """One sklearn ``HistGradientBoostingClassifier`` per label on that label's time features
    (``TimeFeatures.for_label``; NaN means "never recorded") and (N_train, L) 0/1 labels; returns
    (N_eval, L) probabilities. ``params`` override :data:`GBM_PARAMS`; with ``labels`` (column indices), only
    those labels get a model and the others their training rate.

    A label constant in training gets its training rate, as in :func:`fit_predict_baseline`. Labels are
    fitted in parallel threads (``n_jobs``, -1: all cores), each tree model on one OpenMP thread: sklearn's
    own OpenMP threads spin while they wait, and beside other busy processes that made a fit 50x slower.
    """
    Y = np.asarray(Y_train)
    if Y.ndim != 2 or Y.shape[0] != len(train):
        raise ValueError(f"Y_train must be (N_train, L) with N_train = {len(train)}, got {Y.shape}")
    settings = {**GBM_PARAMS, **(params or {})}
    rate = Y.mean(axis=0) if Y.shape[0] else np.zeros(Y.shape[1])
    out = np.tile(rate, (len(evaluate), 1)).astype(float)
    varying = np.flatnonzero((rate > 0) & (rate < 1) & (Y.sum(axis=0) >= 2))
    if labels is not None:
        varying = np.intersect1d(varying, np.asarray(labels, dtype=np.int64))
    if not len(evaluate) or not len(varying):
        return out
    labels = tqdm(varying, desc="gradient boosting", unit="label", disable=not progress, leave=False)
    with threadpool_limits(limits=1, user_api="openmp"):
        columns = Parallel(n_jobs=n_jobs, prefer="threads")(
            delayed(_fit_gbm_one)(train.for_label(j), Y[:, j].astype(int), evaluate.for_label(j), settings, seed)
            for j in labels
        )
    out[:, varying] = np.column_stack(columns)
    return out


def _informative_columns(X: np.ndarray) -> np.ndarray:
    """Indices of the columns of ``X`` (N, F) with at least two distinct non-NaN values.

    A column that is all NaN in training (e.g. "days since a code was last recorded" for a code that only
    ever ends a history) carries nothing, and sklearn's binning rejects it.

    >>> _informative_columns(np.array([[1.0, np.nan, 3.0], [2.0, np.nan, 3.0]])).tolist()
    [0]
    """
    low, high = (
        np.nanmin(np.where(np.isnan(X), np.inf, X), axis=0),
        np.nanmax(np.where(np.isnan(X), -np.inf, X), axis=0),
    )
    return np.flatnonzero(high > low)
