"""Choosing a setting on the tuning split only when it is *clearly* better than a reference setting.

A few hundred tuning patients cannot tell apart differences of a few thousandths of macro AP, and a choice by
point estimates alone picks noise as often as signal (docs/benchmarks.md, "Thirty-eighth round"; on a clinical
draw the state path's share went to 0.65 on a +0.0008 point gain from chains trained one epoch, shrinking the
model's logits toward the base rates). :func:`choose_clearly_better` keeps the reference unless another
candidate's paired bootstrap interval over the tuning patients lies above it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from behrt_rope.evaluation.metrics import macro_ap_and_replicates, percentile_interval
from behrt_rope.training.tasks import macro_average_precision

CHOICE_LEVEL = 0.90
"""The paired interval's level: a candidate replaces the reference only when its lower end (the 5th percentile,
a one-sided 95% bound) is above 0."""


@dataclass(frozen=True)
class ClearChoice:
    """The candidate kept, each candidate's tuning macro AP (5 digits) and each other candidate's paired
    difference to the reference ``(difference, low, high)`` (a :data:`CHOICE_LEVEL` interval)."""

    chosen: float
    macro_ap: dict[float, float]
    over_reference: dict[float, tuple[float, float, float]]

    def among(self, candidates: tuple[float, ...]) -> float:
        """The choice :func:`choose_clearly_better` makes from ``candidates`` alone (a subset of these, the reference
        among them): the same paired intervals, so no candidate is scored again."""
        reference = next(w for w in self.macro_ap if w not in self.over_reference)
        clear = [w for w in candidates if w in self.over_reference and self.over_reference[w][1] > 0]
        return max(clear, key=lambda w: self.over_reference[w][0]) if clear else reference

    def intervals(self) -> dict[str, Any]:
        """The paired differences to the reference as ``metrics.json`` records them: the level, then per other
        candidate ``{"difference", "low", "high"}``."""
        return {"level": CHOICE_LEVEL, **{f"{w:g}": interval_record(v) for w, v in self.over_reference.items()}}


def interval_record(difference: tuple[float, float, float]) -> dict[str, float]:
    """A paired ``(difference, low, high)`` as ``metrics.json`` records it.

    >>> interval_record((0.002, -0.001, 0.005))
    {'difference': 0.002, 'low': -0.001, 'high': 0.005}
    """
    return dict(zip(("difference", "low", "high"), difference, strict=True))


@dataclass(frozen=True)
class ScoredCandidates:
    """Candidates' tuning macro AP (``exact``, setting -> value) and their ``(B,)`` paired bootstrap replicates
    (the same resamples of whole patients for all): scored once, then chosen among against any reference."""

    exact: dict[float, float]
    replicates: dict[float, np.ndarray]

    @classmethod
    def score(
        cls, y: np.ndarray, probs: dict[float, np.ndarray], patients: np.ndarray, n_bootstrap: int = 200, seed: int = 0
    ) -> ScoredCandidates:
        """Score candidates' probabilities ``probs`` (setting -> ``(N, L)``) against targets ``y`` ``(N, L)``,
        ``patients`` ``(N,)`` the patient of each sample."""
        exact = {w: macro_average_precision(y, p) for w, p in probs.items()}
        replicates = {w: macro_ap_and_replicates(y, p, n_bootstrap, seed, patients)[1] for w, p in probs.items()}
        return cls(exact, replicates)

    def choose(self, reference: float) -> ClearChoice:
        """The candidate whose macro AP minus ``reference``'s has the lower end of its paired interval above 0,
        the largest difference of several such; else ``reference``."""
        over = {
            w: _difference(self.exact[w] - self.exact[reference], self.replicates[w] - self.replicates[reference])
            for w in self.exact
            if w != reference
        }
        clearly_better = [w for w, (_, low, _) in over.items() if low > 0]
        chosen = max(clearly_better, key=lambda w: over[w][0]) if clearly_better else reference
        return ClearChoice(chosen, {w: round(ap, 5) for w, ap in self.exact.items()}, over)


def choose_clearly_better(
    y: np.ndarray,
    probs: dict[float, np.ndarray],
    patients: np.ndarray,
    reference: float,
    n_bootstrap: int = 200,
    seed: int = 0,
) -> ClearChoice:
    """From candidates' tuning probabilities ``probs`` (setting -> ``(N, L)``; ``reference`` among them) against
    targets ``y`` ``(N, L)``, ``patients`` ``(N,)`` the patient of each sample: the candidate whose macro AP minus
    the reference's has the lower end of its paired bootstrap interval (whole patients resampled, the same
    resamples for all) above 0, the largest difference of several such; else the reference
    (:class:`ScoredCandidates`, for several references over the same candidates).

    >>> y = np.array([[1, 0], [0, 1], [1, 1], [0, 0]] * 20)
    >>> good = np.tile([[0.9, 0.1], [0.2, 0.8], [0.7, 0.6], [0.1, 0.2]], (20, 1))
    >>> poor = good[:, ::-1].copy()
    >>> choose_clearly_better(y, {0.0: poor, 0.5: good}, np.arange(80), reference=0.0).chosen
    0.5
    >>> choose_clearly_better(y, {0.0: good, 0.5: poor}, np.arange(80), reference=0.0).chosen
    0.0
    """
    return ScoredCandidates.score(y, probs, patients, n_bootstrap, seed).choose(reference)


def paired_difference(
    y: np.ndarray, a: np.ndarray, b: np.ndarray, patients: np.ndarray, n_bootstrap: int = 200, seed: int = 0
) -> tuple[float, float, float]:
    """Tuning macro AP of ``a`` minus ``b`` (``(N, L)`` probabilities against targets ``y``) with its paired
    :data:`CHOICE_LEVEL` bootstrap interval over ``patients`` (``(N,)``; the same resamples for both):
    ``(difference, low, high)``, rounded to 5 digits."""
    point = macro_average_precision(y, a) - macro_average_precision(y, b)
    reps_a = macro_ap_and_replicates(y, a, n_bootstrap, seed, patients)[1]
    reps_b = macro_ap_and_replicates(y, b, n_bootstrap, seed, patients)[1]
    return _difference(point, reps_a - reps_b)


def _difference(point: float, replicates: np.ndarray) -> tuple[float, float, float]:
    """``(point, low, high)`` rounded to 5 digits, the bias-corrected :data:`CHOICE_LEVEL` interval of the paired
    ``(B,)`` replicate differences."""
    low, high = percentile_interval(replicates, CHOICE_LEVEL, point)
    return round(point, 5), round(low, 5), round(high, 5)
