"""The encoder and its heads, on tiny configurations: shapes, invariances, padding, ablation, training."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from behrt_rope.data.masking import mask_tokens
from behrt_rope.model import (
    BehrtEncoder,
    BehrtForMaskedLM,
    BehrtForMultiLabel,
    Block,
    ModelConfig,
    SelfAttention,
    Time2Vec,
    key_padding_mask,
    load_encoder_weights,
    multilabel_loss,
    pos_weight_from_counts,
    positions_for,
    rope_angles,
)
from behrt_rope.schema import CLS_ID, PAD_ID, SEP_ID

VOCAB = 40


def tiny_config(**overrides: object) -> ModelConfig:
    base: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        intermediate_size=64,
        dropout=0.0,
        time2vec_periodic=4,
        max_positions=64,
    )
    base.update(overrides)
    return ModelConfig(**base)


Batch = dict[str, torch.Tensor]


def make_batch(patients: list[list[tuple[float, list[int]]]], length: int | None = None) -> Batch:
    """Token the way the ETL does: [CLS], then each visit's codes closed by [SEP]; pad to ``length``.

    ``patients``: per patient, a list of visits ``(age in years, codes)``. [CLS] takes visit 0's fields.
    """
    rows = []
    for visits in patients:
        ids, ages, segs, vis = [CLS_ID], [visits[0][0]], [0], [0]
        for v, (age, codes) in enumerate(visits):
            for code in [*codes, SEP_ID]:
                ids.append(code)
                ages.append(age)
                segs.append(v % 2)
                vis.append(v)
        rows.append((ids, ages, segs, vis))
    T = length or max(len(r[0]) for r in rows)
    out: dict[str, list[list[Any]]] = {k: [] for k in ("token_ids", "ages", "segments", "visit_index")}
    for ids, ages, segs, vis in rows:
        pad = T - len(ids)
        out["token_ids"].append(ids + [PAD_ID] * pad)
        out["ages"].append(ages + [0.0] * pad)
        out["segments"].append(segs + [0] * pad)
        out["visit_index"].append(vis + [0] * pad)
    batch = {
        "token_ids": torch.tensor(out["token_ids"]),
        "ages": torch.tensor(out["ages"], dtype=torch.float32),
        "segments": torch.tensor(out["segments"]),
        "visit_index": torch.tensor(out["visit_index"]),
    }
    batch["attention_mask"] = batch["token_ids"] != PAD_ID
    return batch


PATIENT_A = [(30.5, [5, 6, 7]), (31.0, [8, 9]), (45.25, [10, 11, 12, 13])]
PATIENT_B = [(2.0, [14]), (70.0, [15, 16, 17, 18, 19, 20])]


def encoder(config: ModelConfig, seed: int = 0, sharpen: float = 1.0) -> BehrtEncoder:
    """A seeded encoder in eval mode. ``sharpen`` scales the q/k/v weights: at BERT's initialisation
    (std 0.02) attention is nearly uniform, so position effects are small; larger scores make the invariance
    tests below discriminating."""
    torch.manual_seed(seed)
    model = BehrtEncoder(config).eval()
    with torch.no_grad():
        for block in model.blocks:
            assert isinstance(block, Block)
            block.attn.qkv.weight.mul_(sharpen)
    return model


def encode(model: BehrtEncoder, batch: Batch) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch)


def test_forward_shapes_and_finiteness() -> None:
    batch = make_batch([PATIENT_A, PATIENT_B])
    out = encode(encoder(tiny_config()), batch)
    assert out.shape == (2, batch["token_ids"].shape[1], 32)
    assert torch.isfinite(out).all()


def test_attention_mask_defaults_to_non_padding() -> None:
    batch = make_batch([PATIENT_A, PATIENT_B])
    model = encoder(tiny_config())
    no_mask = {k: v for k, v in batch.items() if k != "attention_mask"}
    torch.testing.assert_close(encode(model, no_mask), encode(model, batch))


def test_padding_embeds_to_zero_and_init_is_bert_like() -> None:
    model = encoder(tiny_config(hidden_size=64, num_heads=4, vocab_size=2000))
    code = model.embeddings.code.weight
    assert code[PAD_ID].abs().sum() == 0
    assert code[1:].std().item() == pytest.approx(0.02, rel=0.05)
    block = model.blocks[0]
    assert isinstance(block, Block)
    assert block.attn.qkv.bias.abs().sum() == 0


def permute_visit(batch: Batch, perm: torch.Tensor) -> Batch:
    return {k: v[:, perm] for k, v in batch.items()}


def visit_permutation(batch: Batch) -> torch.Tensor:
    """Reverse the codes (not the [SEP]) of patient A's third visit: token positions 8..11."""
    T = batch["token_ids"].shape[1]
    perm = torch.arange(T)
    perm[8:12] = torch.tensor([11, 10, 9, 8])
    assert batch["token_ids"][0, 8:12].tolist() == [10, 11, 12, 13]
    return perm


def test_invariant_to_code_order_inside_a_visit_with_visit_positions() -> None:
    batch = make_batch([PATIENT_A])
    perm = visit_permutation(batch)
    model = encoder(tiny_config(position_source="visit"), sharpen=20.0)
    out = encode(model, batch)
    out_perm = encode(model, permute_visit(batch, perm))
    torch.testing.assert_close(out_perm, out[:, perm], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("encoding", ["rope", "absolute"])
def test_token_positions_see_code_order(encoding: str) -> None:
    """The control for the test above: with token positions, the same shuffle changes the outputs."""
    batch = make_batch([PATIENT_A])
    perm = visit_permutation(batch)
    model = encoder(tiny_config(position_source="token", position_encoding=encoding), sharpen=20.0)
    out = encode(model, batch)
    out_perm = encode(model, permute_visit(batch, perm))
    assert (out_perm - out[:, perm]).abs().max() > 1e-2


@pytest.mark.parametrize("source", ["visit", "token", "age"])
def test_padding_does_not_change_real_tokens(source: str) -> None:
    model = encoder(tiny_config(position_source=source), sharpen=20.0)
    alone = make_batch([PATIENT_A])
    T = alone["token_ids"].shape[1]
    reference = encode(model, alone)[0]  # no padding: the attn_mask=None path
    for length in (T + 1, T + 7):
        padded = encode(model, make_batch([PATIENT_A], length=length))[0]
        torch.testing.assert_close(padded[:T], reference, atol=1e-5, rtol=1e-5)
    # and in a batch with a longer patient
    mixed = encode(model, make_batch([PATIENT_B, PATIENT_A, PATIENT_B]))[1]
    torch.testing.assert_close(mixed[:T], reference, atol=1e-5, rtol=1e-5)


def test_all_padding_row_gives_no_nan() -> None:
    config = tiny_config()
    batch = make_batch([PATIENT_A, PATIENT_B])
    for key in batch:
        batch[key][1] = 0  # patient B becomes a row of [PAD] only
    assert not batch["attention_mask"][1].any()
    torch.manual_seed(0)
    model = BehrtForMaskedLM(config)
    labels = torch.full_like(batch["token_ids"], -100)
    labels[0, 2] = 6
    out = model(**batch, labels=labels)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    hidden = encode(model.encoder.eval(), batch)
    assert torch.isfinite(hidden).all()


def test_key_padding_mask() -> None:
    assert key_padding_mask(None) is None
    assert key_padding_mask(torch.ones(3, 5, dtype=torch.bool)) is None
    mask = torch.tensor([[True, True, False], [False, False, False]])
    kpm = key_padding_mask(mask)
    assert kpm is not None and kpm.shape == (2, 1, 1, 3)
    assert kpm[0, 0, 0].tolist() == [True, True, False]
    assert kpm[1, 0, 0].tolist() == [True, False, False]  # all-padding row: key 0 only
    assert mask[1].tolist() == [False, False, False]  # the input is untouched


def test_no_mask_path_equals_all_true_mask_path() -> None:
    config = tiny_config()
    torch.manual_seed(0)
    attn = SelfAttention(config).eval()
    x = torch.randn(2, 9, 32)
    cos, sin = rope_angles(torch.tensor([[0, 0, 1, 1, 1, 2, 3, 3, 4]] * 2), head_dim=8)
    with torch.no_grad():
        no_mask = attn(x, cos, sin, None)
        all_true = attn(x, cos, sin, torch.ones(2, 1, 1, 9, dtype=torch.bool))
    torch.testing.assert_close(no_mask, all_true, atol=1e-6, rtol=1e-6)


def test_attention_dropout_only_in_training() -> None:
    config = tiny_config(attention_dropout=0.5)
    torch.manual_seed(0)
    attn = SelfAttention(config)
    x = torch.randn(1, 6, 32)
    attn.eval()
    with torch.no_grad():
        assert torch.equal(attn(x), attn(x))  # deterministic in eval
    attn.train()
    with torch.no_grad():
        assert not torch.equal(attn(x), attn(x))


def test_positions_for() -> None:
    visit_index = torch.tensor([[0, 0, 0, 1, 1]])
    ages = torch.tensor([[1.5, 1.5, 1.5, 2.0, 2.0]])
    assert positions_for(tiny_config(), visit_index, ages).tolist() == [[0, 0, 0, 1, 1]]
    token = positions_for(tiny_config(position_source="token"), visit_index, ages)
    assert token.tolist() == [[0, 1, 2, 3, 4]]
    age = positions_for(tiny_config(position_source="age", rope_age_scale=12.0), visit_index, ages)
    assert age.tolist() == [[18, 18, 18, 24, 24]]
    for p in (token, age):
        assert p.dtype == torch.float32


def test_absolute_ablation_keeps_the_api_and_the_weights() -> None:
    batch = make_batch([PATIENT_A, PATIENT_B])
    rope_model = encoder(tiny_config())
    absolute = encoder(tiny_config(position_encoding="absolute"))
    # Same parameters, same state-dict keys: the sinusoidal table is a non-persistent buffer.
    assert rope_model.state_dict().keys() == absolute.state_dict().keys()
    absolute.load_state_dict(rope_model.state_dict())
    out_rope, out_abs = encode(rope_model, batch), encode(absolute, batch)
    assert out_abs.shape == out_rope.shape
    assert torch.isfinite(out_abs).all()
    assert (out_abs - out_rope).abs().max() > 1e-3  # the switch does switch
    # Same heads on top.
    torch.manual_seed(0)
    labels = torch.full_like(batch["token_ids"], -100)
    labels[:, 2] = 7
    out = BehrtForMaskedLM(tiny_config(position_encoding="absolute"))(**batch, labels=labels)
    assert out.logits.shape == (2, VOCAB)


def test_absolute_ablation_rejects_positions_outside_its_table() -> None:
    batch = make_batch([PATIENT_A])
    batch["visit_index"][0, -1] = 64  # max_positions is 64
    with pytest.raises(ValueError, match="max_positions"):
        encode(encoder(tiny_config(position_encoding="absolute")), batch)


def test_vocab_must_exceed_the_special_tokens() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        BehrtEncoder(ModelConfig())


def test_time2vec() -> None:
    config = tiny_config(time2vec_periodic=3, age_scale=100.0)
    t2v = Time2Vec.of_age(config)
    ages = torch.tensor([[0.0, 50.0, 100.0]])
    features = t2v.features(ages)
    assert features.shape == (1, 3, 4)
    # the linear feature, w0 * age / 100 + b0, with w0 = 1 and b0 = 0 at initialisation
    assert features[0, :, 0].tolist() == pytest.approx([0.0, 0.5, 1.0])
    assert features[0, :, 1:].abs().max() <= 1.0
    assert t2v(ages).shape == (1, 3, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert t2v.features(ages).dtype == torch.float32  # features never in bf16


def test_bf16_autocast_forward_is_finite() -> None:
    batch = make_batch([PATIENT_A, PATIENT_B])
    model = encoder(tiny_config(position_source="age", rope_age_scale=12.0))
    reference = encode(model, batch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = encode(model, batch)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), reference, atol=0.15, rtol=0.1)


def mlm_batch(seed: int = 0) -> tuple[Batch, torch.Tensor]:
    batch = make_batch([PATIENT_A, PATIENT_B, PATIENT_A[::-1], PATIENT_B[:1]])
    gen = torch.Generator().manual_seed(seed)
    input_ids, labels = mask_tokens(batch["token_ids"], VOCAB, gen, mask_prob=0.5)
    return {**batch, "token_ids": input_ids}, labels


def test_the_ignore_index_agrees_between_masking_and_heads() -> None:
    from behrt_rope.data import masking
    from behrt_rope.model import IGNORE_INDEX

    assert masking.IGNORE_INDEX == IGNORE_INDEX == -100


def test_mlm_returns_logits_only_at_chosen_tokens() -> None:
    torch.manual_seed(0)
    model = BehrtForMaskedLM(tiny_config())
    batch, labels = mlm_batch()
    out = model(**batch, labels=labels)
    n = int((labels != -100).sum())
    assert n > 0
    assert out.logits.shape == (n, VOCAB)
    assert out.labels.tolist() == labels[labels != -100].tolist()
    assert out.loss.ndim == 0 and torch.isfinite(out.loss)
    # Near-uniform predictions at initialisation: loss near log(V).
    assert out.loss.item() == pytest.approx(torch.log(torch.tensor(float(VOCAB))).item(), rel=0.2)


def test_mlm_with_nothing_chosen_gives_zero_loss() -> None:
    torch.manual_seed(0)
    model = BehrtForMaskedLM(tiny_config())
    batch, labels = mlm_batch()
    out = model(**batch, labels=torch.full_like(labels, -100))
    assert out.logits.shape == (0, VOCAB)
    assert out.loss.item() == 0.0
    out.loss.backward()  # still attached to the graph


def test_mlm_decoder_is_tied_to_the_code_embedding() -> None:
    torch.manual_seed(0)
    model = BehrtForMaskedLM(tiny_config())
    assert [k for k in model.state_dict() if "decoder" in k] == ["decoder_bias"]
    batch, labels = mlm_batch()
    model(**batch, labels=labels).loss.backward()
    grad = model.encoder.embeddings.code.weight.grad
    assert grad is not None
    # Codes that appear nowhere in the input still get a gradient, through the decoder.
    assert grad[VOCAB - 1].abs().sum() > 0


def test_a_few_steps_reduce_the_mlm_loss() -> None:
    torch.manual_seed(0)
    model = BehrtForMaskedLM(tiny_config())
    batch, labels = mlm_batch()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(10):
        optimizer.zero_grad()
        loss = model(**batch, labels=labels).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0]


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_multilabel_head(pooling: str) -> None:
    torch.manual_seed(0)
    batch = make_batch([PATIENT_A, PATIENT_B])
    model = BehrtForMultiLabel(tiny_config(), num_labels=7, pooling=pooling)  # type: ignore[arg-type]
    logits = model(**batch)
    assert logits.shape == (2, 7)
    targets = torch.zeros(2, 7)
    targets[0, 3] = 1
    loss = multilabel_loss(logits, targets, pos_weight=pos_weight_from_counts(torch.tensor([1] * 7), 2))
    assert torch.isfinite(loss)
    loss.backward()


def test_mean_pooling_ignores_padding() -> None:
    torch.manual_seed(0)
    model = BehrtForMultiLabel(tiny_config(), num_labels=3, pooling="mean").eval()
    alone = make_batch([PATIENT_B])
    padded = make_batch([PATIENT_B], length=alone["token_ids"].shape[1] + 5)
    with torch.no_grad():
        torch.testing.assert_close(model(**padded), model(**alone), atol=1e-5, rtol=1e-5)


def test_multilabel_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        BehrtForMultiLabel(tiny_config(), num_labels=0)
    with pytest.raises(ValueError):
        BehrtForMultiLabel(tiny_config(), num_labels=2, pooling="max")  # type: ignore[arg-type]


def test_pos_weight_from_counts() -> None:
    assert pos_weight_from_counts(torch.tensor([1, 4, 0]), total=5).tolist() == [4.0, 0.25, 1.0]
    assert pos_weight_from_counts(torch.tensor([1, 4]), total=101, max_weight=10.0).tolist() == [10.0, 10.0]


def test_load_encoder_weights_from_a_pretrained_mlm_model() -> None:
    config = tiny_config()
    torch.manual_seed(1)
    pretrained = BehrtForMaskedLM(config)
    torch.manual_seed(2)
    finetune = BehrtForMultiLabel(config, num_labels=4)
    classifier_before = finetune.classifier.weight.clone()
    loaded = load_encoder_weights(finetune, pretrained.state_dict())
    assert loaded == sorted(pretrained.encoder.state_dict())
    for key, value in pretrained.encoder.state_dict().items():
        assert torch.equal(finetune.encoder.state_dict()[key], value)
    assert torch.equal(finetune.classifier.weight, classifier_before)
    # a bare encoder state dict, with prefix=""
    fresh = BehrtEncoder(config)
    load_encoder_weights(fresh, pretrained.encoder.state_dict(), prefix="")
    batch = make_batch([PATIENT_A])
    torch.testing.assert_close(encode(fresh.eval(), batch), encode(pretrained.encoder.eval(), batch))
    with pytest.raises(ValueError, match="starts with"):
        load_encoder_weights(finetune, {"head.weight": torch.zeros(1)})
    with pytest.raises(RuntimeError):  # a config mismatch is an error, not a partial load
        load_encoder_weights(BehrtForMultiLabel(dataclasses.replace(config, vocab_size=41), 4), pretrained.state_dict())


def test_one_scored_visit_per_row_gives_the_running_history_features():
    """predict scores one visit per row through masked sums and maxima; they must equal the running sum and
    max that training reads at the same positions (padding after the scored position never counts)."""
    torch.manual_seed(0)
    model = BehrtForMultiLabel(tiny_config(), num_labels=3).eval()
    hidden = torch.randn(4, 9, 32)
    ages = torch.rand(4, 9) * 80
    positions = torch.tensor([8, 3, 0, 5])
    one_per_row = torch.zeros(4, 9, dtype=torch.bool)
    one_per_row[torch.arange(4), positions] = True
    fast = model._visit_features(hidden, ages, one_per_row)
    H = hidden.shape[-1]
    running_mean = hidden.cumsum(dim=1)[one_per_row] / (positions[:, None].float() + 1.0)
    running_max = torch.cummax(hidden, dim=1).values[one_per_row]
    torch.testing.assert_close(fast[:, :H], hidden[one_per_row])
    torch.testing.assert_close(fast[:, H : 2 * H], running_mean, rtol=1e-6, atol=1e-6)
    assert torch.equal(fast[:, 2 * H : 3 * H], running_max)
    two_in_a_row = one_per_row.clone()
    two_in_a_row[0, 2] = True  # the general path
    general = model._visit_features(hidden, ages, two_in_a_row)
    torch.testing.assert_close(general[1:], fast, rtol=1e-6, atol=1e-6)  # row 0 scored at 2, then at 8
