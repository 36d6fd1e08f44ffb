"""The wide path: per-code record features (count, recency in visits and days, years since first)."""

from __future__ import annotations

import math

import pytest
import torch

from behrt_rope.model.config import ModelConfig
from behrt_rope.model.heads import BehrtForMultiLabel
from behrt_rope.model.wide import DAY_SCALES, VISIT_SCALES, WidePath, history_pairs
from behrt_rope.schema import CLS_ID, N_SPECIAL, PAD_ID, SEP_ID

A, B = N_SPECIAL, N_SPECIAL + 1
V = N_SPECIAL + 3


def _stream():
    """One patient: visit 0 (age 50.0) records A and B, visit 1 (age 50.5) records A, visit 2 (age 52) B."""
    ids = torch.tensor([[CLS_ID, A, B, SEP_ID, A, SEP_ID, B, SEP_ID, PAD_ID]])
    visit = torch.tensor([[0, 0, 0, 0, 1, 1, 2, 2, 0]])
    ages = torch.tensor([[50.0, 50.0, 50.0, 50.0, 50.5, 50.5, 52.0, 52.0, 0.0]])
    score_at = ids == SEP_ID
    return ids, visit, ages, score_at


def _wide(**kw):
    return WidePath(V, num_labels=2, label_token_ids=[A, B], **kw)


def _own(wide, ids, visit, ages, score_at):
    return wide.own_code_features(history_pairs(ids, score_at), visit, ages)


def test_own_code_features_count_recency_and_duration():
    ids, visit, ages, score_at = _stream()
    f = _own(_wide(), ids, visit, ages, score_at)  # (3 scored visits, 2 labels, 8)
    assert f.shape == (3, 2, 8)
    a, b = f[:, 0], f[:, 1]
    assert a[:, 0].tolist() == pytest.approx([math.log(2), math.log(3), math.log(3)])
    assert b[:, 0].tolist() == pytest.approx([math.log(2), math.log(2), math.log(3)])
    # at visit 2: A was recorded 1 and 2 visits ago, 1.5 and 2 years ago; B now and 2 visits ago
    s = VISIT_SCALES[0]
    assert a[2, 1].item() == pytest.approx(math.exp(-1 / s) + math.exp(-2 / s), rel=1e-5)
    assert b[2, 1].item() == pytest.approx(1 + math.exp(-2 / s), rel=1e-5)
    d = DAY_SCALES[1]
    assert a[2, 5].item() == pytest.approx(math.exp(-1.5 * 365.25 / d) + math.exp(-2 * 365.25 / d), rel=1e-4)
    assert a[:, 7].tolist() == pytest.approx([0.0, math.log1p(0.5), math.log1p(2.0)], rel=1e-5)


def test_a_label_whose_code_is_unknown_gets_no_own_features():
    ids, visit, ages, score_at = _stream()
    wide = WidePath(V, num_labels=2, label_token_ids=[A, -1])
    f = _own(wide, ids, visit, ages, score_at)
    assert f[:, 1].abs().sum() == 0 and f[:, 0].abs().sum() > 0


def test_features_see_only_the_history_of_the_scored_visit():
    ids, visit, ages, score_at = _stream()
    wide = _wide()
    wide.weight.data.normal_()
    assert wide.own_weight is not None
    wide.own_weight.data.normal_()
    before = wide(ids, visit, ages, score_at)[:2]
    later = ids.clone()
    later[0, 6] = A  # change the last visit's code
    torch.testing.assert_close(before, wide(later, visit, ages, score_at)[:2])
    assert not torch.allclose(wide(ids, visit, ages, score_at)[2], wide(later, visit, ages, score_at)[2])


def test_scales_and_weights_learn():
    ids, visit, ages, score_at = _stream()
    wide = _wide()
    assert wide.own_weight is not None and wide.log_visit_scale is not None and wide.log_day_scale is not None
    wide.own_weight.data.normal_()
    wide(ids, visit, ages, score_at).sum().backward()
    assert wide.log_visit_scale.grad is not None and wide.log_visit_scale.grad.abs().sum() > 0
    assert wide.log_day_scale.grad is not None and wide.log_day_scale.grad.abs().sum() > 0
    assert wide.weight.grad is not None and wide.weight.grad[:, A].abs().sum() > 0


def test_plain_form_keeps_the_bag_of_codes_state_dict():
    """A model saved before the time-aware features (weight (L, V), no label ids) loads into the plain form."""
    config = ModelConfig(vocab_size=V, hidden_size=16, num_heads=2, wide=True, wide_time=False)
    plain = BehrtForMultiLabel(config, 3)
    assert {k for k in plain.state_dict() if k.startswith("wide.")} == {"wide.weight"}
    assert plain.state_dict()["wide.weight"].shape == (3, V)
    timed = BehrtForMultiLabel(ModelConfig(vocab_size=V, hidden_size=16, num_heads=2, wide=True), 3, "visit", [A, B, 4])
    assert timed.state_dict()["wide.own_weight"].shape == (3, 8)
    assert timed.state_dict()["wide.label_token_ids"].tolist() == [A, B, 4]


def test_wide_weights_decay_like_linear_weights_and_scales_do_not():
    from behrt_rope.training.optim import parameter_groups

    model = BehrtForMultiLabel(ModelConfig(vocab_size=V, hidden_size=16, num_heads=2, wide=True), 3, "visit", [A, B, 4])
    groups = parameter_groups(model, weight_decay=0.1, lr=1.0, lr_scales={"wide": 10.0})
    decay_of = {id(p): (g["weight_decay"], g["lr"]) for g in groups for p in g["params"]}
    wide = model.wide
    assert wide is not None and wide.own_weight is not None and wide.log_day_scale is not None
    assert decay_of[id(wide.weight)] == (0.1, 10.0) and decay_of[id(wide.own_weight)] == (0.1, 10.0)
    assert decay_of[id(wide.log_day_scale)] == (0.0, 10.0)
