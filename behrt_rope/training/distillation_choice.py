"""Choosing the sparse time path's distillation weight on the tuning split, within the time budget.

Distilling the frozen sparse time path into the deep part (``finetune ... sparse_time_distillation``) helps
where the path is the stronger learner (short, sparse histories: the deep part +0.007 to +0.013 tuning macro
AP, and better held out on every sparse draw measured) and hurts where the deep part is (a clinical cohort at
the default density: -0.003 on its tuning split); which of the two a cohort is, only training tells
(docs/benchmarks.md, "Thirty-sixth round"). With the setting left null, ``finetune`` therefore trains the deep
part once per weight of :data:`DISTILLATION_GRID`, in order: labels alone first, then at 0.8 when

- the first training does not say the deep part is clearly the stronger learner: the lower end of the paired
  interval of its tuning macro AP minus its teacher's is not above 0 (:func:`path_leads`). Where the deep part
  clearly leads, distilling the teacher pulls it toward a worse function (the clinical cohort at the default
  density: the model -0.0055 tuning macro AP in the thirty-sixth round, -0.0035 held out on the demo's cohort),
  so a second training would cost time to find a worse model. Until session 57 the point estimates decided;
  on a recurrence_sparse draw the deep part led by 0.0008 (interval -0.0017 to +0.0031), the second training
  did not run, and a distilled one scored 0.016 better held out (the deep part) and 0.004 (the model)
  (docs/benchmarks.md, "Fifty-third round"). A close call now trains both and :func:`choose_weight` decides;
  and
- what is left of the time budget (``trainer.max_minutes``) is at least as long as the first run took. Where
  one training fills most of the budget (long, dense histories on 2 CPU cores), the first weight stands.

When both trained, :func:`choose_weight` keeps the weight of the learner that led the first comparison on its
point estimates (:func:`preferred_weight`: 0.8 where the teacher did, 0 where the deep part did) unless the other
weight's deep part is *clearly* better on the tuning split (a paired bootstrap over its patients). Comparing the
two runs' point estimates alone chose 0 on two of four fresh sparse draws where 0.8 scored better held out: a few
hundred tuning patients cannot tell apart differences of 0.005 in macro AP, and each run is scored at the checks
chosen on the same split, which favours the noisier run (docs/benchmarks.md, "Thirty-eighth round"). Until
session 61 0.8 was preferred either way, which kept a distilled deep part on clinical cohorts where the deep part
leads its teacher by less than a small split can call clear (docs/benchmarks.md, "Fifty-seventh round").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from behrt_rope.errors import UserError
from behrt_rope.training.clear_gain import CHOICE_LEVEL, choose_clearly_better, interval_record, paired_difference
from behrt_rope.training.tasks import macro_average_precision

DISTILLATION_GRID = (0.0, 0.8)
"""The weights tried, in order, when ``sparse_time_distillation`` is null: labels alone first (the safer
weight where only one training fits the budget)."""
PREFERRED_WEIGHT = 0.8
"""The weight kept when both trained and the teacher led the first training, unless the tuning split shows
another clearly better (:func:`preferred_weight`, :func:`choose_weight`)."""


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


ROOM_MARGIN = 1.1
"""What :func:`chains_seconds` keeps for a second training, in first trainings' lengths: the tuning split's
scoring between the chains and the room check, and an epoch a little slower than the first run's, must fit too."""
MIN_CHAIN_SECONDS = 60.0
"""The least time :func:`chains_seconds` leaves the chains when it keeps room for a second training; with less
to spare, the chains get all that is left, as a second training would not fit beside a useful fit of them."""


def chains_seconds(seconds_left: float | None, first_run_seconds: float, second_training: bool) -> float | None:
    """The time the state path's chains may take after the first training: what is left less room for a second
    training of ``ROOM_MARGIN`` x the first's length, when that spares them at least :data:`MIN_CHAIN_SECONDS`;
    else all that is left (None: no budget). ``second_training``: whether one is still possible (more than one
    distillation weight to train).

    Without this, the chains' sets (several minutes on progression histories) used the time a distilled second
    training needed, and on a host a little slower the deep part lost the distillation: the second training runs
    only when what is left is at least the first training's length (:func:`room_for_another`). The distilled
    deep part gained +0.004 to +0.009 tuning macro AP on the draws where it ran; a second and third set of chains
    about +0.001 (docs/benchmarks.md, "Fifty-second round").

    >>> chains_seconds(600.0, 200.0, True), chains_seconds(600.0, 200.0, False)
    (380.0, 600.0)
    >>> chains_seconds(250.0, 200.0, True), chains_seconds(None, 200.0, True)  # 30 s spare: the chains get all
    (250.0, None)
    """
    if seconds_left is None or not second_training:
        return seconds_left
    spare = seconds_left - ROOM_MARGIN * first_run_seconds
    return spare if spare >= MIN_CHAIN_SECONDS else seconds_left


@dataclass(frozen=True)
class PathLead:
    """The first training's deep part and its teacher (the path alone, or with the chains) on the tuning split:
    macro AP of each and, where measured, the paired :data:`~behrt_rope.training.clear_gain.CHOICE_LEVEL` interval
    of the deep part's minus the teacher's ``(difference, low, high)``."""

    deep_macro_ap: float
    path_macro_ap: float
    deep_minus_path: tuple[float, float, float] | None = None

    @property
    def path_leads(self) -> bool:
        """The point estimates: the teacher scores the better tuning macro AP."""
        return self.path_macro_ap > self.deep_macro_ap

    @property
    def deep_clearly_leads(self) -> bool:
        """The deep part is clearly the stronger learner (the lower end of the paired interval above 0; without an
        interval, the point estimates): distilling the teacher into it is then not worth a second training.

        >>> PathLead(0.3007, 0.2999, (0.0008, -0.0017, 0.0031)).deep_clearly_leads
        False
        >>> PathLead(0.2495, 0.2437, (0.0058, 0.0009, 0.0124)).deep_clearly_leads, PathLead(0.3, 0.2).deep_clearly_leads
        (True, True)
        """
        if self.deep_minus_path is None:
            return self.deep_macro_ap > self.path_macro_ap
        return self.deep_minus_path[1] > 0

    def report(self) -> dict[str, Any]:
        interval = None
        if self.deep_minus_path is not None:
            interval = {**interval_record(self.deep_minus_path), "level": CHOICE_LEVEL}
        return {
            "deep_macro_ap": self.deep_macro_ap,
            "path_macro_ap": self.path_macro_ap,
            "path_leads": self.path_leads,
            "deep_minus_path": interval,
            "deep_clearly_leads": self.deep_clearly_leads,
        }


def path_leads(y: np.ndarray, deep: np.ndarray, path: np.ndarray, patients: np.ndarray | None = None) -> PathLead:
    """Tuning macro AP of the first training's deep part and of its teacher (``(N, L)`` probabilities each, ``y``
    the ``(N, L)`` targets), rounded to 5 digits, and the paired interval of their difference over ``patients``
    (``(N,)``, each sample's patient; whole patients resampled; None: each sample its own).

    >>> y = np.array([[1, 0], [0, 1], [1, 1], [0, 0]] * 10)
    >>> good, poor = np.tile([[0.9, 0.1], [0.2, 0.8], [0.7, 0.6], [0.1, 0.2]], (10, 1)), np.full((40, 2), 0.5)
    >>> path_leads(y, poor, good).path_leads, path_leads(y, good, poor).deep_clearly_leads
    (True, True)
    """
    patients = np.arange(len(y)) if patients is None else patients
    difference = paired_difference(y, deep, path, patients)
    return PathLead(round(macro_average_precision(y, deep), 5), round(macro_average_precision(y, path), 5), difference)


@dataclass(frozen=True)
class WeightChoice:
    """The weight kept, each weight's deep-part tuning macro AP, each other weight's paired difference to the
    ``preferred`` one ``(difference, low, high)`` (a ``clear_gain.CHOICE_LEVEL`` interval, patients resampled),
    and the preferred weight."""

    weight: float
    macro_ap: dict[float, float]
    over_preferred: dict[float, tuple[float, float, float]]
    preferred: float


def preferred_weight(lead: PathLead | None) -> float:
    """The weight :func:`choose_weight` keeps unless another is clearly better: :data:`PREFERRED_WEIGHT` where the
    teacher scored the better tuning macro AP in the first training's comparison (or there was none), labels
    alone (0) where the deep part did, though not clearly.

    On a clinical cohort at the default density the deep part leads its teacher by about 0.005 tuning macro AP, a
    lead a 400-patient tuning split cannot call clear; preferring 0.8 there kept a distilled deep part that scored
    0.003 lower on 3,395 tuning patients (docs/benchmarks.md, "Fifty-seventh round"). Where the teacher leads
    (sparse histories, progression), 0.8 stays preferred.

    >>> preferred_weight(PathLead(0.251, 0.2465, (0.0046, -0.001, 0.010))), preferred_weight(PathLead(0.13, 0.14))
    (0.0, 0.8)
    """
    if lead is None or lead.path_leads:
        return PREFERRED_WEIGHT
    return DISTILLATION_GRID[0]


def choose_weight(
    y: np.ndarray,
    probs: dict[float, np.ndarray],
    patients: np.ndarray,
    n_bootstrap: int = 200,
    seed: int = 0,
    preferred: float = PREFERRED_WEIGHT,
) -> WeightChoice:
    """The weight to keep from the deep parts' tuning probabilities ``probs`` (weight -> ``(N, L)``, in the
    order trained) against targets ``y`` ``(N, L)``, ``patients`` ``(N,)`` the patient of each sample.

    ``preferred`` (:func:`preferred_weight`) stands unless another weight's deep part is clearly better: the lower
    end of the paired bootstrap interval of its macro AP minus the preferred one's (whole patients resampled, the
    same resamples for both) above 0; of several such, the largest difference. Without the preferred weight among
    those trained (no room for it), the first one stands.
    """
    if preferred not in probs:
        macro_ap = {w: round(macro_average_precision(y, p), 5) for w, p in probs.items()}
        return WeightChoice(next(iter(probs)), macro_ap, {}, preferred)
    choice = choose_clearly_better(y, probs, patients, preferred, n_bootstrap, seed)
    return WeightChoice(choice.chosen, choice.macro_ap, choice.over_reference, preferred)
