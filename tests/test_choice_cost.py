"""The cost of fine-tuning's choices after training, measured before it so that the time budget holds it back."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from behrt_rope.training import choice_cost
from behrt_rope.training.choice_cost import choice_seconds
from pipelines.finetune import Config, _choice_candidates


class StepClock:
    """``time.perf_counter`` stand-in: every read moves on by ``step`` seconds."""

    def __init__(self, step: float) -> None:
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def test_one_candidate_is_timed_on_the_tuning_splits_shape_and_multiplied(monkeypatch: pytest.MonkeyPatch) -> None:
    scored: list[dict[str, Any]] = []

    def score(y: np.ndarray, probs: dict[float, np.ndarray], patients: np.ndarray) -> None:
        scored.append({"y": y, "probs": probs, "patients": patients})

    monkeypatch.setattr(choice_cost.ScoredCandidates, "score", score)
    monkeypatch.setattr(choice_cost.time, "perf_counter", StepClock(1.5))
    y = np.zeros((40, 3), dtype=int)
    patients = np.repeat(np.arange(20), 2)
    assert choice_seconds(y, patients, candidates=13) == pytest.approx(13 * 1.5)
    assert len(scored) == 1  # one candidate timed, not all thirteen
    (probs,) = scored[0]["probs"].values()
    assert probs.shape == (40, 3) and ((probs >= 0) & (probs <= 1)).all()
    assert scored[0]["y"] is y and scored[0]["patients"] is patients


def test_no_candidates_or_no_tuning_samples_cost_nothing_and_nothing_is_scored(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("nothing should be scored")

    monkeypatch.setattr(choice_cost.ScoredCandidates, "score", fail)
    assert choice_seconds(np.zeros((40, 3)), np.arange(40), candidates=0) == 0.0
    assert choice_seconds(np.zeros((0, 3)), np.arange(0), candidates=5) == 0.0


def test_a_real_candidate_is_scored_in_positive_time() -> None:
    rng = np.random.default_rng(0)
    y = (rng.random((200, 4)) < 0.2).astype(int)
    assert choice_seconds(y, np.repeat(np.arange(100), 2), candidates=3) > 0


def _model(sparse: bool, chains: bool) -> Any:
    return SimpleNamespace(sparse_time=object() if sparse else None, state_path=object() if chains else None)


@pytest.mark.parametrize(
    ("settings", "sparse", "chains", "weights", "expected"),
    [
        ({}, True, True, (0.0,), 5 + 8),  # the sparse path's five shares, the state path's eight
        ({}, True, True, (0.0, 0.8), 5 + 8 + 2 + 2 + 8),  # + the path lead (2), the runs (2), the teacher's mixes (8)
        ({"state_path_teacher": False}, True, True, (0.0, 0.8), 5 + 8 + 2 + 2),
        ({"sparse_time_share": 0.5}, True, True, (0.0,), 8),  # a share given is not chosen
        ({"state_path_share": 0.0}, True, True, (0.0,), 5),
        ({"state_path_max_epochs": 0}, True, True, (0.0,), 5),  # chains never fitted: no share to choose
        ({}, False, False, (0.0,), 0),
    ],
)
def test_the_candidates_counted_are_those_the_choices_after_training_score(
    settings: dict[str, Any], sparse: bool, chains: bool, weights: tuple[float, ...], expected: int
) -> None:
    assert _choice_candidates(Config(**settings), _model(sparse, chains), weights) == expected
