"""Fitting the sparse time path around fine-tuning: its regression before the deep training, its share after.

``finetune`` calls :func:`fit_path` before training (its C fixed or chosen on the tuning split, then
scikit-learn's L1 fit, loaded into the model's frozen buffers) and :func:`set_path_share` after it (the path's
weight in the model's logit, chosen on the tuning split). See ``behrt_rope/model/sparse_time_path.py`` for the
path itself.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch
from scipy.special import expit
from scipy.special import logit as _logit

from behrt_rope.data.labels import Samples
from behrt_rope.data.sequences import Sequences
from behrt_rope.evaluation.sparse_time import (
    DEFAULT_BINS,
    SELECT_C,
    Bins,
    SparseTimeFit,
    fit_sparse_time,
    sparse_c_setting,
)
from behrt_rope.evaluation.time_features import TimeFeatures, time_features
from behrt_rope.model.heads import BehrtForMultiLabel
from behrt_rope.training.clear_gain import ClearChoice, choose_clearly_better

log = logging.getLogger("behrt_rope.finetune")
SHARE_GRID = (0.25, 0.4, 0.5, 0.6, 0.75)
"""The sparse time path's shares that :func:`set_path_share` chooses from on the tuning split. Until session 60
the best point estimate; since, :data:`EQUAL_SHARE` unless another is clearly better: a 400-patient tuning split
picks 0.25-0.75 by noise (on a clinical draw, choosing on 400 tuning patients and scoring on 3,000 others,
+0.0006 macro AP for the rule over the best point estimate, level on a progression and a recurrence_sparse
draw; docs/benchmarks.md, "Fifty-sixth round")."""
EQUAL_SHARE = 0.5
"""The reference share of :func:`clear_share`: two learners of different form, averaged with equal weights."""


def fit_path(
    model: BehrtForMultiLabel,
    seqs: Sequences,
    samples: Samples,
    label_of_token: np.ndarray,
    y: np.ndarray,
    c: float | None,
    progress: bool = True,
    tuning: tuple[Sequences, Samples, np.ndarray] | None = None,
    seed: int = 0,
    select_c: float | None = SELECT_C,
    bins: Bins = DEFAULT_BINS,
) -> dict[str, Any]:
    """Fit the path's regression on ``samples`` of ``seqs`` (``y`` ``(N, L)`` their targets) and load it; a
    progress bar over the labels unless ``progress`` is false (``trainer.progress_bar``). ``c`` fixes the
    inverse L1 strength; None chooses it from :data:`~behrt_rope.evaluation.sparse_time.C_GRID` on
    ``tuning`` (its sequences, samples and ``(N_tune, L)`` targets; :data:`DEFAULT_C` without tuning
    samples); ``select_c`` is the strength of the fit that chooses the codes each label reads (None: one fit);
    ``bins`` how the fits read the ordered bins (:data:`~behrt_rope.evaluation.sparse_time.BINS`).
    Deterministic, so every DDP rank fits the same. Returns what ``metrics.json`` records."""
    assert model.sparse_time is not None
    started = time.perf_counter()
    features = time_features(seqs, samples, label_of_token)
    c, report, start = _path_c(features, y, c, tuning, label_of_token, seed, select_c, bins)
    fit = fit_sparse_time(features, y, c, progress=progress, start=start, select_c=select_c, bins=bins)
    model.sparse_time.load_fit(
        torch.from_numpy(fit.own_weight), torch.from_numpy(fit.shared_weight), torch.from_numpy(fit.bias)
    )
    nonzero = int((fit.own_weight != 0).sum() + (fit.shared_weight != 0).sum())
    log.info(
        "finetune: sparse time path fitted on %d samples (C=%g, codes chosen at C=%s, %s bins): %.1f non-zero "
        "weights per label, %.1f s",
        len(y),
        c,
        "none" if select_c is None else f"{select_c:g}",
        bins,
        nonzero / max(len(fit.bias), 1),
        time.perf_counter() - started,
    )
    return {"sparse_time_c": report}


def _path_c(
    features: TimeFeatures,
    y: np.ndarray,
    c: float | None,
    tuning: tuple[Sequences, Samples, np.ndarray] | None,
    label_of_token: np.ndarray,
    seed: int,
    select_c: float | None,
    bins: Bins,
) -> tuple[float, dict[str, Any], SparseTimeFit | None]:
    """The path's C and how it was set: ``c`` when given, else the best of ``C_GRID`` on ``tuning`` (with the
    choice's fit of its sampled labels, which the full fit takes over)."""
    y_tune = tuning[2] if tuning is not None else np.zeros((0, y.shape[1]))

    def tune() -> TimeFeatures:
        assert tuning is not None  # called only with tuning rows
        return time_features(tuning[0], tuning[1], label_of_token)

    return sparse_c_setting(c, features, y, tune, y_tune, seed, log, "finetune: sparse time path", select_c, bins)


def set_path_share(
    model: BehrtForMultiLabel,
    share: float | None,
    y: np.ndarray,
    deep: np.ndarray | None = None,
    path: np.ndarray | None = None,
    patients: np.ndarray | None = None,
) -> dict[str, Any]:
    """Set the path's share of the logit: ``share``, or :data:`EQUAL_SHARE` unless another share of
    :data:`SHARE_GRID` is clearly better on the tuning samples (:func:`clear_share`; ``y`` their ``(N, L)``
    targets, ``deep`` and ``path`` the ``(N, L)`` logits of the deep part and of the path there, ``patients``
    ``(N,)`` each sample's patient; deterministic, so every DDP rank sets the same; 0.5 without samples).
    Returns what ``metrics.json`` records."""
    assert model.sparse_time is not None
    if share is None and len(y):
        if deep is None or path is None or patients is None:
            raise ValueError(
                "choosing the sparse time path's share needs the tuning logits of the deep part and path, and the "
                "tuning samples' patients"
            )
        choice = clear_share(deep, path, y, patients)
        log.info(
            "finetune: sparse time path share %.2f (%g unless another is clearly better; macro AP on the tuning "
            "split by share: %s)",
            choice.chosen,
            EQUAL_SHARE,
            choice.macro_ap,
        )
        model.sparse_time.set_share(choice.chosen)
        return {
            "sparse_time_share": choice.chosen,
            "tuning_macro_ap_by_share": choice.macro_ap,
            f"sparse_time_share_over_{EQUAL_SHARE:g}": choice.intervals(),
        }
    model.sparse_time.set_share(EQUAL_SHARE if share is None else share)
    return {"sparse_time_share": float(model.sparse_time.share)}


def clear_share(
    deep: np.ndarray, path: np.ndarray, y: np.ndarray, patients: np.ndarray, grid: tuple[float, ...] = SHARE_GRID
) -> ClearChoice:
    """:data:`EQUAL_SHARE` unless another share of ``grid`` is clearly better on the tuning samples (``y`` their
    ``(N, L)`` targets, ``patients`` ``(N,)`` each one's patient, ``deep`` and ``path`` the ``(N, L)`` logits of the
    two parts; :func:`~behrt_rope.training.clear_gain.choose_clearly_better`)."""
    mixes = {w: expit((1 - w) * deep + w * path) for w in sorted({*grid, EQUAL_SHARE})}  # (N, L) probabilities
    return choose_clearly_better(y, mixes, patients, reference=EQUAL_SHARE)


def logit(probs: np.ndarray) -> np.ndarray:
    """Log-odds of probabilities, clipped to [1e-7, 1 - 1e-7].

    >>> logit(np.array([0.5, 1.0])).round(2).tolist()
    [0.0, 16.12]
    """
    return np.asarray(_logit(np.clip(probs.astype(np.float64), 1e-7, 1 - 1e-7)))
