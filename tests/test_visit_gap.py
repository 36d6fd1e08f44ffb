"""The days-since-the-previous-visit input (``model.visit_gap``): its values, that it starts as no input,
that it moves only the tokens of the visit whose gap changed, and that visit-causal encoding still reads
nothing of later visits."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from behrt_rope import schema as S
from behrt_rope.model.config import ModelConfig
from behrt_rope.model.encoder import BehrtEncoder
from behrt_rope.model.visit_gap import DAYS_PER_YEAR, VisitGapEmbedding, days_since_previous_visit
from behrt_rope.training.bundle import load_bundle, save_bundle

# two patients: [CLS] v0 v0 [SEP] v1 [SEP] v2 v2 [SEP], and a shorter one padded
VISITS = torch.tensor([[0, 0, 0, 0, 1, 1, 2, 2, 2], [0, 0, 0, 1, 1, 0, 0, 0, 0]])
MASK = torch.tensor([[True] * 9, [True] * 5 + [False] * 4])
VISIT_AGES = [[40.0, 40.1, 43.0], [7.0, 7.02]]


def _ages() -> torch.Tensor:
    ages = torch.zeros(VISITS.shape)
    for b, visit_ages in enumerate(VISIT_AGES):
        for t in range(VISITS.shape[1]):
            if MASK[b, t]:
                ages[b, t] = visit_ages[int(VISITS[b, t])]
    return ages


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.tensor([[1, 5, 6, 2, 7, 2, 8, 9, 2], [1, 5, 2, 6, 2, 0, 0, 0, 0]])
    return {"token_ids": ids, "ages": _ages(), "segments": VISITS % 2, "visit_index": VISITS, "attention_mask": MASK}


def test_days_are_the_gap_from_the_visit_before_and_zero_on_first_visits_and_padding():
    days, first = days_since_previous_visit(_ages(), VISITS, MASK)
    expected = np.zeros(VISITS.shape)
    for b, visit_ages in enumerate(VISIT_AGES):
        for t in range(VISITS.shape[1]):
            v = int(VISITS[b, t])
            if MASK[b, t] and v > 0:
                expected[b, t] = (visit_ages[v] - visit_ages[v - 1]) * DAYS_PER_YEAR
    np.testing.assert_allclose(days.numpy(), expected, rtol=1e-4)
    assert round(float(days[1, 3])) == 7  # a follow-up a week later
    assert first.tolist() == [[True] * 4 + [False] * 5, [True] * 3 + [False] * 2 + [True] * 4]


def _encoders(seed: int = 0) -> tuple[BehrtEncoder, BehrtEncoder]:
    torch.manual_seed(seed)
    plain = BehrtEncoder(ModelConfig(vocab_size=12, visit_gap=False)).eval()
    with_gap = BehrtEncoder(ModelConfig(vocab_size=12, visit_gap=True)).eval()
    missing, unexpected = with_gap.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and missing and all(k.startswith("embeddings.visit_gap.") for k in missing)
    return plain, with_gap


def test_the_input_starts_at_zero_so_a_pre_trained_encoder_computes_the_same():
    plain, with_gap = _encoders()
    torch.testing.assert_close(with_gap(**_batch()), plain(**_batch()))


def test_moving_a_visit_moves_only_its_tokens_and_later_ones_under_visit_causal_encoding():
    _, encoder = _encoders()
    with torch.no_grad():
        torch.nn.init.normal_(encoder.embeddings.visit_gap.log_gap.proj.weight, std=0.5)
    batch = _batch()
    moved = dict(batch, ages=batch["ages"].clone())
    moved["ages"][0, VISITS[0] == 2] = 40.2  # the third visit 36 days after the second instead of ~3 years
    before, after = (encoder(**b, visit_causal=True) for b in (batch, moved))
    earlier = (VISITS[0] < 2) & MASK[0]
    torch.testing.assert_close(after[0, earlier], before[0, earlier])  # nothing of a later visit leaks back
    assert (after[0, VISITS[0] == 2] - before[0, VISITS[0] == 2]).abs().max() > 1e-3
    torch.testing.assert_close(after[1], before[1])


def test_the_gap_embedding_is_time2vec_of_the_log_days_plus_a_first_visit_vector():
    torch.manual_seed(0)
    gap = VisitGapEmbedding(ModelConfig(vocab_size=12, hidden_size=8))
    with torch.no_grad():
        torch.nn.init.normal_(gap.log_gap.proj.weight)
        gap.first_visit.normal_()
    days, first = torch.tensor([[0.0, 30.0, 3650.0]]), torch.tensor([[True, False, False]])
    t = torch.log1p(days) / math.log1p(3650.0)  # (1, 3) scaled log gap: 0 .. 1
    w, b = gap.log_gap.periodic_weight, gap.log_gap.periodic_bias
    features = torch.cat([t[..., None], torch.sin(t[..., None] * w + b)], dim=-1)  # linear w0 = 1, b0 = 0
    expected = gap.log_gap.proj(features) + first[..., None] * gap.first_visit
    torch.testing.assert_close(gap(days, first), expected)
    assert gap.log_gap.periodic_weight[0].item() == pytest.approx(1.0)  # near-linear ...
    assert gap.log_gap.periodic_weight[-1].item() == pytest.approx(8 * math.pi)  # ... to four swings over 0 .. 1


def test_an_encoder_saved_before_the_input_loads_as_it_was(tmp_path):
    before = ModelConfig(vocab_size=12, visit_gap=False)
    save_bundle(tmp_path, "mlm", before, BehrtEncoder(before).state_dict())
    meta = json.loads((tmp_path / S.MODEL_META_FILE).read_text())
    del meta["model_config"]["visit_gap"]  # a model.json written before the setting existed
    (tmp_path / S.MODEL_META_FILE).write_text(json.dumps(meta))
    (tmp_path / S.DONE_MARKER).write_text("pretrain")
    bundle = load_bundle(tmp_path, "mlm")
    assert bundle["model_config"].visit_gap is False
    BehrtEncoder(bundle["model_config"]).load_state_dict(bundle["state_dict"], strict=True)


def test_the_first_layout_of_the_input_loads_and_computes_the_same():
    """Session 45 saved the input as ``freq``, ``phase`` and one projection over [log gap, flag, periodic]; such
    a state dict loads into the Time2Vec layout and gives the same embedding."""
    torch.manual_seed(1)
    hidden, k = 8, 8
    freq, phase = torch.rand(k) * 20, torch.rand(k) * 6
    proj = torch.nn.Linear(k + 2, hidden)
    old = {"freq": freq, "phase": phase, "proj.weight": proj.weight.detach(), "proj.bias": proj.bias.detach()}
    gap = VisitGapEmbedding(ModelConfig(vocab_size=12, hidden_size=hidden))
    gap.load_state_dict(old)
    days, first = torch.tensor([[0.0, 9.0, 400.0]]), torch.tensor([[True, False, False]])
    g = (torch.log1p(days) / math.log1p(3650.0))[..., None]  # (1, 3, 1)
    features = torch.cat([g, first.float()[..., None], torch.sin(g * freq + phase)], dim=-1)
    torch.testing.assert_close(gap(days, first), proj(features).detach())
