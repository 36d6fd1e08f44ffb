"""``benchmarks/distillation_choice_study.py``: the rules replayed on tuning subsets keep the weights they should,
and each is scored on patients that did not choose it."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.distillation_choice_study import rule_weights, study


def _runs(n: int = 900, labels: int = 8, seed: int = 0, teacher_noise: float = 1.6) -> tuple[dict, dict]:
    """Tuning logits of two trainings of one cohort: the first deep part (noise 1.0) leads the distilled one
    (noise 1.3); the teacher's noise sets who led the first comparison. Three samples a patient."""
    rng = np.random.default_rng(seed)
    y = (rng.random((n, labels)) < 0.2).astype(np.int64)
    signal = 2.0 * y - 1.0
    path = signal + rng.normal(0.0, teacher_noise, y.shape)
    common = {"y": y, "patients": np.arange(n) // 3, "path": path, "state_share": np.array(0.0)}
    first = {**common, "deep": signal + rng.normal(0.0, 1.0, y.shape)}
    distilled = {**common, "deep": signal + rng.normal(0.0, 1.3, y.shape)}
    return first, distilled


def test_the_leader_rule_keeps_labels_alone_where_the_deep_part_led():
    first, distilled = _runs(teacher_noise=1.1)  # the deep part ahead of its teacher, but not by much
    probs = {name: 1 / (1 + np.exp(-run["deep"])) for name, run in (("0", first), ("0.8", distilled))}
    teacher = 1 / (1 + np.exp(-first["path"]))
    weights = rule_weights(first["y"], probs["0"], probs["0.8"], teacher, first["patients"])
    assert weights["fixed_0"] == 0.0 and weights["fixed_0.8"] == 0.8
    assert weights["prefer_the_leader"] == 0.0


def test_the_study_scores_the_kept_deep_part_on_the_other_patients():
    first, distilled = _runs(teacher_noise=1.1)
    result = study(first, distilled, choose_patients=60, repeats=5, seed=1)
    rules = result["rules"]
    assert rules["fixed_0"]["macro_ap"] > rules["fixed_0.8"]["macro_ap"]  # the first deep part is the better one
    assert rules["fixed_0.8"]["kept_0.8"] == 1.0 and rules["fixed_0"]["kept_0.8"] == 0.0
    assert rules["prefer_0.8"]["minus_prefer_0.8"] == 0.0
    assert rules["prefer_the_leader"]["macro_ap"] >= rules["prefer_0.8"]["macro_ap"]
    whole = result["deep_macro_ap_whole_tuning_split"]
    assert whole["0"] > whole["0.8"] and result["tuning_patients"] == 300 and result["labels"] == 8


def test_the_study_needs_two_runs_of_the_same_tuning_samples():
    first, distilled = _runs()
    other = {**distilled, "y": 1 - distilled["y"]}
    with pytest.raises(SystemExit, match="same tuning samples"):
        study(first, other, choose_patients=60, repeats=1, seed=0)
