"""Step features of the time since a record in the label attention (``model.label_time_steps``): where the steps
start, that each reads one clock, that a label can weigh a window of record ages as sharply as a binned feature,
and that a model saved before the option loads as it was trained."""

from __future__ import annotations

import math

import pytest
import torch

from behrt_rope.model.config import ModelConfig
from behrt_rope.model.token_label_attention import (
    ELAPSED_SIZE,
    KEY_SIZE,
    STEP_DAYS,
    STEP_VISITS,
    TokenLabelAttention,
    step_features,
)
from behrt_rope.schema import CLS_ID, N_SPECIAL, SEP_ID
from behrt_rope.training.bundle import ADDED_LATER, load_bundle, save_bundle

CODE, OTHER = N_SPECIAL, N_SPECIAL + 1
DAYS_PER_YEAR = 365.25


def test_each_step_is_half_way_at_its_knot_and_reads_one_clock():
    steps = step_features()
    knots = [(math.log1p(d), 0.0) for d in STEP_DAYS] + [(0.0, math.log1p(v)) for v in STEP_VISITS]
    with torch.no_grad():
        at_knots = steps(torch.tensor(knots))  # (16, 16): row j at feature j's knot
    assert torch.allclose(torch.diagonal(at_knots[: len(STEP_DAYS)]), torch.tensor(0.5), atol=1e-6)
    # A day-step does not move with the visits since, nor a visit-step with the days since.
    weight = steps[0].weight
    assert torch.all(weight[: len(STEP_DAYS), 1] == 0) and torch.all(weight[len(STEP_DAYS) :, 0] == 0)
    assert weight.shape == (ELAPSED_SIZE, 2)


def test_steps_are_sharp_around_their_knots_and_ordered():
    """10% below the 152-day knot the step is mostly off, 10% above it mostly on; later steps are off there."""
    steps = step_features()
    j = STEP_DAYS.index(152)
    with torch.no_grad():
        below, above = steps(torch.log1p(torch.tensor([[137.0, 0.0], [167.0, 0.0]])))
    assert below[j] < 0.2 < 0.8 < above[j]
    assert torch.all(above[j + 1 : len(STEP_DAYS)] < 0.2) and torch.all(above[:j] > 0.8)


def _config(steps: bool) -> ModelConfig:
    return ModelConfig(
        label_code_tie=False,
        label_own_code=False,
        label_time_steps=steps,
        vocab_size=12,
        hidden_size=KEY_SIZE,
        num_heads=2,
        label_attention_heads=1,
    )


def _record_then_visit(days_ago: float) -> dict[str, torch.Tensor]:
    """CODE recorded at a visit ``days_ago`` days before a visit with OTHER, scored at the last [SEP]."""
    ids = [CLS_ID, CODE, SEP_ID, OTHER, SEP_ID]
    age = 30.0
    return {
        "token_ids": torch.tensor([ids]),
        "visit_index": torch.tensor([[0, 0, 0, 1, 1]]),
        "ages": torch.tensor([[age, age, age, age + days_ago / DAYS_PER_YEAR, age + days_ago / DAYS_PER_YEAR]]),
        "score_at": torch.tensor([[False, False, False, False, True]]),
    }


def test_a_label_can_vote_for_a_window_of_record_ages():
    """States all zero: the record takes the attention from the sink, and its vote is the time features' share
    alone, here the 152-day step minus the 243-day step: about 1 for a record 170-215 days old, about 0 for one a
    month, three months or a year old."""
    attention = TokenLabelAttention(_config(True), num_labels=1)
    with torch.no_grad():
        for name, p in attention.named_parameters():
            if not name.startswith("elapsed"):
                p.zero_()
        attention.time_bias[0, 0, 0] = 30.0  # a record over a week old outweighs the sink (score 0)
        attention.time_value[STEP_DAYS.index(152), 0, 0] = 1.0
        attention.time_value[STEP_DAYS.index(243), 0, 0] = -1.0

    def logit(days_ago: float) -> float:
        batch = _record_then_visit(days_ago)
        hidden = torch.zeros(1, batch["token_ids"].shape[1], KEY_SIZE)
        with torch.no_grad():
            return float(attention(hidden, batch["token_ids"], batch["visit_index"], batch["ages"], batch["score_at"]))

    inside = [logit(d) for d in (170, 200, 215)]
    outside = [logit(d) for d in (30, 100, 300, 400)]
    assert min(inside) > 0.8 and max(outside) < 0.2


def test_on_by_default_and_a_model_saved_before_it_loads_with_the_ramps(tmp_path):
    assert ModelConfig().label_time_steps
    assert ADDED_LATER["label_time_steps"] is False
    config = _config(False)
    attention = TokenLabelAttention(config, num_labels=2)
    assert isinstance(attention.elapsed[1], torch.nn.GELU)
    assert isinstance(TokenLabelAttention(_config(True), num_labels=2).elapsed[1], torch.nn.Sigmoid)
    save_bundle(tmp_path, "multilabel", config, torch.nn.Linear(2, 2).state_dict())
    meta_path = tmp_path / "model.json"
    text = meta_path.read_text().replace('"label_time_steps": false,', "")
    assert "label_time_steps" not in text
    meta_path.write_text(text)
    (tmp_path / ".done").write_text("finetune")
    assert load_bundle(tmp_path, "multilabel")["model_config"].label_time_steps is False


@pytest.mark.parametrize("steps", [False, True])
def test_the_same_state_dict_keys_either_way(steps):
    keys = set(TokenLabelAttention(_config(steps), num_labels=2).state_dict())
    assert keys == set(TokenLabelAttention(_config(not steps), num_labels=2).state_dict())
