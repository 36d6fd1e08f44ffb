"""Choosing a setting on the tuning split only when it is clearly better than the reference."""

from __future__ import annotations

import numpy as np

from behrt_rope.training.clear_gain import ScoredCandidates, choose_clearly_better
from behrt_rope.training.tasks import macro_average_precision


def _scores(seed: int, patients: int = 300, labels: int = 5) -> tuple[np.ndarray, np.ndarray, np.random.Generator]:
    """Targets (base rate 0.2) and informative scores with noise."""
    rng = np.random.default_rng(seed)
    y = (rng.random((patients, labels)) < 0.2).astype(int)
    return y, y * 0.6 + rng.normal(size=y.shape), rng


def test_noise_that_wins_the_point_estimate_does_not_replace_the_reference():
    y, base, rng = _scores(16)
    noisy = base + 0.05 * rng.normal(size=base.shape)  # the same scores, jittered: no real gain
    assert macro_average_precision(y, noisy) > macro_average_precision(y, base) + 0.002  # points favour it
    choice = choose_clearly_better(y, {0.0: base, 0.5: noisy}, np.arange(len(y)), reference=0.0)
    difference, low, _ = choice.over_reference[0.5]
    assert choice.chosen == 0.0 and difference > 0.002 and low <= 0


def test_noise_is_chosen_about_as_often_as_the_one_sided_level_allows():
    chosen = 0
    for seed in range(40):
        y, base, rng = _scores(seed)
        noisy = base + 0.05 * rng.normal(size=base.shape)
        chosen += choose_clearly_better(y, {0.0: base, 0.5: noisy}, np.arange(len(y)), reference=0.0).chosen == 0.5
    assert chosen <= 5  # 5% expected (2 of 40); picking the better point would choose about half


def test_a_clearly_better_candidate_is_chosen_and_of_two_the_larger_gain():
    y, base, rng = _scores(0)
    better = y * 1.2 + rng.normal(size=y.shape)
    best = y * 2.0 + rng.normal(size=y.shape)
    patients = np.repeat(np.arange(len(y) // 3), 3)  # three samples a patient: resampled together
    choice = choose_clearly_better(y, {0.0: base, 0.35: better, 0.65: best}, patients, reference=0.0)
    assert choice.chosen == 0.65
    assert all(low > 0 for _, low, _ in choice.over_reference.values())
    assert choice.macro_ap[0.65] > choice.macro_ap[0.35] > choice.macro_ap[0.0]


def test_the_choice_among_a_subset_is_the_choice_made_on_that_subset_alone():
    y, base, rng = _scores(3)
    candidates = {
        0.0: base,
        0.5: base + 0.4 * y,  # clearly better
        0.8: base + 0.8 * y,  # better still
        0.9: base + 0.02 * rng.normal(size=base.shape),
    }
    patients = np.arange(len(y))
    everyone = choose_clearly_better(y, candidates, patients, reference=0.0)
    assert everyone.chosen == 0.8
    for subset in ((0.0, 0.5), (0.0, 0.9), (0.0, 0.5, 0.9)):
        alone = choose_clearly_better(y, {w: candidates[w] for w in subset}, patients, reference=0.0)
        assert everyone.among(subset) == alone.chosen
    assert everyone.among((0.0, 0.5)) == 0.5 and everyone.among((0.0, 0.9)) == 0.0


def test_candidates_scored_once_choose_against_any_reference_as_a_fresh_choice_would():
    y, base, rng = _scores(5)
    candidates = {0.0: base, 0.5: base + 0.3 * y, 1.0: base + 0.6 * y + 0.3 * rng.normal(size=y.shape)}
    patients = np.repeat(np.arange(len(y) // 2), 2)
    scored = ScoredCandidates.score(y, candidates, patients)
    for reference in candidates:
        fresh = choose_clearly_better(y, candidates, patients, reference=reference)
        again = scored.choose(reference)
        assert again.chosen == fresh.chosen
        assert again.macro_ap == fresh.macro_ap and again.over_reference == fresh.over_reference
    assert scored.choose(0.0).chosen != 0.0  # the references do differ in what they keep
