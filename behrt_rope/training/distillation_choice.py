"""Choosing the sparse time path's distillation weight on the tuning split, within the time budget.

Distilling the frozen sparse time path into the deep part (``finetune ... sparse_time_distillation``) helps
where the path is the stronger learner (short, sparse histories: the deep part +0.007 to +0.013 tuning macro
AP) and hurts where the deep part is (a clinical cohort at the default density: -0.003); which of the two a
cohort is, only training tells (docs/benchmarks.md, "Thirty-sixth round"). With the setting left null,
``finetune`` therefore trains the deep part once per weight of :data:`DISTILLATION_GRID`, in order, and keeps
the run whose deep part alone scores the best tuning macro AP: the deep part, since the whole model's tuning
macro AP is level between the weights wherever distillation helps the deep part. A further run starts only
when what is left of the time budget (``trainer.max_minutes``) is at least as long as the first run took:
where one training fills most of the budget (long, dense histories on 2 CPU cores, the cohorts where the
deep part already leads), the first weight stands.
"""

from __future__ import annotations

import numpy as np
import torch

from behrt_rope.data.labels import Samples
from behrt_rope.data.sequences import Sequences
from behrt_rope.errors import UserError
from behrt_rope.model.heads import BehrtForMultiLabel
from behrt_rope.training.inference import score_parts
from behrt_rope.training.tasks import macro_average_precision

DISTILLATION_GRID = (0.0, 0.8)
"""The weights tried, in order, when ``sparse_time_distillation`` is null: labels alone first."""


def candidate_weights(setting: float | None, has_path: bool, has_tuning: bool = True) -> tuple[float, ...]:
    """The distillation weights to train: the grid when ``setting`` is None, the model has the sparse time
    path (without it there is nothing to distil) and there are tuning samples to choose on (without them,
    labels alone); else the one weight set (0 without the path).

    >>> candidate_weights(None, True), candidate_weights(None, False), candidate_weights(None, True, False)
    ((0.0, 0.8), (0.0,), (0.0,))
    >>> candidate_weights(0.5, True), candidate_weights(0.5, False)
    ((0.5,), (0.0,))
    """
    if setting is None:
        return DISTILLATION_GRID if has_path and has_tuning else (0.0,)
    if not 0.0 <= setting <= 1.0:
        raise UserError(f"sparse_time_distillation must lie in [0, 1] or be null, got {setting}")
    return (setting,) if has_path else (0.0,)


def room_for_another(seconds_left: float | None, first_run_seconds: float) -> bool:
    """Whether another run fits: no budget (None), or at least the first run's training time left of it.

    >>> room_for_another(None, 600.0), room_for_another(300.0, 120.0), room_for_another(300.0, 400.0)
    (True, True, False)
    """
    return seconds_left is None or seconds_left >= first_run_seconds


def deep_tuning_ap(
    model: BehrtForMultiLabel, seqs: Sequences, samples: Samples, y: np.ndarray, device: torch.device | None = None
) -> float:
    """Macro AP of the deep part alone (the path left out) on the tuning ``samples`` of ``seqs`` (``y``
    ``(N, L)`` their targets); 0.0 without tuning samples."""
    if not len(y):
        return 0.0
    probs = score_parts(model, seqs, samples.rows, samples.cuts, device=device, parts=("deep",))["deep"]
    return macro_average_precision(y, probs)


def best_weight(scores: dict[float, float]) -> float:
    """The weight with the best score; a tie goes to the earlier weight (labels alone before distillation).

    >>> best_weight({0.0: 0.25, 0.8: 0.26}), best_weight({0.0: 0.25, 0.8: 0.25})
    (0.8, 0.0)
    """
    weights = list(scores)
    return max(weights, key=lambda w: (scores[w], -weights.index(w)))
