"""Label-code tying (``model.label_code_tie``): the head starts as the untied one, learns through maps shared by
every label, and a trained model carries its label codes."""

from __future__ import annotations

import pytest
import torch

from behrt_rope.model.config import ModelConfig
from behrt_rope.model.heads import BehrtForMultiLabel
from behrt_rope.model.label_codes import label_vectors
from behrt_rope.schema import CLS_ID, N_SPECIAL, SEP_ID

LABEL_IDS = [N_SPECIAL + i for i in range(4)]


def _config(tie: bool) -> ModelConfig:
    return ModelConfig(
        vocab_size=N_SPECIAL + 8, hidden_size=16, num_heads=2, intermediate_size=32, num_layers=1,
        dropout=0.0, label_code_tie=tie,
    )  # fmt: skip


def _batch() -> dict[str, torch.Tensor]:
    """Two patients of two and three visits, every [SEP] scored."""
    a, b, c, d = LABEL_IDS
    token_ids = torch.tensor(
        [[CLS_ID, a, b, SEP_ID, c, a, SEP_ID, 0, 0], [CLS_ID, d, SEP_ID, b, SEP_ID, a, d, c, SEP_ID]]
    )
    visit_index = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 0, 0], [0, 0, 0, 1, 1, 2, 2, 2, 2]])
    ages = 40.0 + visit_index.float() * 0.7
    return {
        "token_ids": token_ids,
        "ages": ages,
        "segments": visit_index % 2,
        "visit_index": visit_index,
        "score_at": token_ids == SEP_ID,
    }


def _logits(model: BehrtForMultiLabel) -> torch.Tensor:
    return model(**_batch())


def test_a_tied_head_starts_as_the_untied_one_with_the_same_weights():
    torch.manual_seed(0)
    tied = BehrtForMultiLabel(_config(True), len(LABEL_IDS), label_token_ids=LABEL_IDS).eval()
    untied = BehrtForMultiLabel(_config(False), len(LABEL_IDS), label_token_ids=LABEL_IDS).eval()
    result = untied.load_state_dict(tied.state_dict(), strict=False)
    assert not result.missing_keys
    assert set(result.unexpected_keys) >= {"label_codes", "classifier_tie.map.weight"}
    torch.testing.assert_close(_logits(tied), _logits(untied), rtol=0, atol=0)


def test_label_vectors_are_unit_length_rows_of_the_label_codes():
    embedding = torch.randn(12, 16) * 3.0 + 1.0
    ids = torch.tensor([5, 9, 5])
    vectors = label_vectors(embedding, ids)
    assert vectors.shape == (3, 16)
    torch.testing.assert_close(vectors.norm(dim=-1), torch.ones(3))
    torch.testing.assert_close(vectors[0], vectors[2])  # the same code, the same vector
    assert not torch.allclose(vectors[0], vectors[1])
    # invariant to the embedding's scale and offset (layer-normalised)
    torch.testing.assert_close(label_vectors(embedding * 5.0 + 2.0, ids), vectors, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tie", [True, False])
def test_only_a_tied_head_carries_what_one_label_learns_to_the_others(tie: bool):
    """One SGD step on label 0's logit alone, training only the per-label parameters (and the tying maps): the
    untied head's other labels do not move; the tied head's do, through the shared maps."""
    torch.manual_seed(1)
    model = BehrtForMultiLabel(_config(tie), len(LABEL_IDS), label_token_ids=LABEL_IDS).eval()
    per_label = ("classifier.", *(f"label_attention.{n}" for n in ("query", "value.", "time_", "sink_value", "own_")))
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(per_label) or "tie." in name)
    before = _logits(model).detach()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    (-_logits(model)[:, 0].sum()).backward()
    optimizer.step()
    moved = (_logits(model).detach() - before).abs().amax(dim=0)  # (L,)
    assert moved[0] > 1e-3
    if tie:
        assert (moved[1:] > 1e-4).all()
    else:
        torch.testing.assert_close(moved[1:], torch.zeros(3), rtol=0, atol=1e-6)


def test_a_loaded_tied_model_brings_its_label_codes():
    torch.manual_seed(2)
    trained = BehrtForMultiLabel(_config(True), len(LABEL_IDS), label_token_ids=LABEL_IDS).eval()
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    loaded = BehrtForMultiLabel(_config(True), len(LABEL_IDS)).eval()  # label codes unknown until loaded
    assert loaded.label_codes is not None and (loaded.label_codes == -1).all()
    loaded.load_state_dict(trained.state_dict())
    assert loaded.label_codes.tolist() == LABEL_IDS
    torch.testing.assert_close(_logits(loaded), _logits(trained))


def test_the_tied_label_attention_needs_the_label_vectors():
    model = BehrtForMultiLabel(_config(True), len(LABEL_IDS), label_token_ids=LABEL_IDS)
    assert model.label_attention is not None
    with pytest.raises(ValueError, match="label_code_tie needs label_vectors"):
        model.label_attention.label_parameters(None)
