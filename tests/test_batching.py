"""Batching, the MLM collator and the optimiser: padding, length buckets, DDP shards, masks, decay, schedule."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from behrt_rope import schema as S
from behrt_rope.data import batching
from behrt_rope.data.batching import FIELDS, BucketBatchSampler, pad_batch, padding_share
from behrt_rope.data.datasets import IGNORE_INDEX, MlmCollator, PatientDataset
from behrt_rope.data.sequences import Sequences
from behrt_rope.model import BehrtForMaskedLM, ModelConfig
from behrt_rope.training.config import TrainerConfig
from behrt_rope.training.optim import build_optimizer, lr_factor, parameter_groups

VOCAB = 30


# ---------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------
def item(visits: list[list[int]], index: int = 0) -> dict[str, np.ndarray]:
    """One dataset item: [CLS], then each visit's codes closed by [SEP]; ages grow one year per visit."""
    ids, visit = [S.CLS_ID], [0]
    for k, codes in enumerate(visits):
        ids += [*codes, S.SEP_ID]
        visit += [k] * (len(codes) + 1)
    visit_index = np.array(visit)
    return {
        "token_ids": np.array(ids),
        "ages": 30.0 + visit_index.astype(np.float32),
        "segments": visit_index % 2,
        "visit_index": visit_index,
        "sex": np.full(len(ids), 1 + index % 3),
        "index": np.array(index),
    }


def skewed_lengths(n: int = 2000, seed: int = 0) -> np.ndarray:
    """Long-tailed sequence lengths, like real histories: most short, a few long."""
    return np.minimum(3 + np.random.default_rng(seed).lognormal(2.5, 1.0, n).astype(int), 512)


def sequences(lengths: list[int], seed: int = 0) -> Sequences:
    """A ``Sequences`` of random well-formed streams ([CLS] codes... [SEP]) of the given lengths."""
    rng = np.random.default_rng(seed)
    streams = []
    for n in lengths:
        codes = rng.integers(S.N_SPECIAL, VOCAB, size=n)
        codes[rng.random(n) < 0.25] = S.SEP_ID
        codes[0], codes[-1] = S.CLS_ID, S.SEP_ID
        streams.append(codes)
    flat = np.concatenate(streams)
    visit = np.concatenate([np.cumsum(s == S.SEP_ID) - (s == S.SEP_ID) for s in streams])  # [SEP]s before
    return Sequences(
        patients=None,  # type: ignore[arg-type]  # not used by PatientDataset
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        token_ids=flat.astype(np.int64),
        ages=(40 + visit).astype(np.float32),
        segments=visit % 2,
        visit_index=visit,
        visit_days=visit * 30,
    )


# ---------------------------------------------------------------------------------------------------------
# pad_batch
# ---------------------------------------------------------------------------------------------------------
def test_pad_batch_shapes_values_and_mask() -> None:
    items = [item([[5, 6], [7]], index=4), item([[8]], index=9), item([[9, 10, 11], [12], [13, 14]], index=1)]
    batch = pad_batch(items)
    lengths = [len(i["token_ids"]) for i in items]
    B, T = len(items), max(lengths)
    for name in (*FIELDS, "attention_mask"):
        assert batch[name].shape == (B, T), name
    assert batch["token_ids"].dtype == batch["segments"].dtype == batch["visit_index"].dtype == torch.long
    assert batch["ages"].dtype == torch.float32 and batch["attention_mask"].dtype == torch.bool
    assert batch["attention_mask"].sum(1).tolist() == lengths
    for row, it in enumerate(items):
        n = lengths[row]
        for name in FIELDS:
            assert batch[name][row, :n].tolist() == pytest.approx(it[name].tolist()), name
            assert (batch[name][row, n:] == 0).all(), name  # PAD_ID is 0, other fields pad with 0
        assert not batch["attention_mask"][row, n:].any()
    assert batch["index"].tolist() == [4, 9, 1]


def test_pad_batch_without_index_has_no_index() -> None:
    items = [{name: np.arange(3) for name in FIELDS}]
    assert "index" not in pad_batch(items)


# ---------------------------------------------------------------------------------------------------------
# BucketBatchSampler
# ---------------------------------------------------------------------------------------------------------
def flat(batches: list) -> list[int]:
    return sorted(int(i) for b in batches for i in b)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 400),
    batch_size=st.integers(1, 40),
    bucket=st.integers(1, 8),
    seed=st.integers(0, 99),
    epoch=st.integers(0, 5),
    shuffle=st.booleans(),
)
def test_sampler_covers_every_index_once_per_epoch(
    n: int, batch_size: int, bucket: int, seed: int, epoch: int, shuffle: bool
) -> None:
    lengths = np.random.default_rng(seed).integers(1, 100, n)
    sampler = BucketBatchSampler(lengths, batch_size, bucket, shuffle=shuffle, seed=seed)
    sampler.set_epoch(epoch)
    batches = list(sampler)
    assert flat(batches) == list(range(n))
    assert len(batches) == len(sampler) == -(-n // batch_size)
    assert all(1 <= len(b) <= batch_size for b in batches)


def test_sampler_batches_change_with_the_epoch_and_repeat_for_a_seed() -> None:
    lengths = skewed_lengths(500)
    sampler = BucketBatchSampler(lengths, 16, 4, seed=3)
    first = list(sampler)
    sampler.set_epoch(1)
    second = list(sampler)
    assert first != second and flat(first) == flat(second)
    again = BucketBatchSampler(lengths, 16, 4, seed=3)
    assert list(again) == first  # epoch 0 of the same seed
    again.set_epoch(1)
    assert list(again) == second
    assert list(BucketBatchSampler(lengths, 16, 4, seed=4)) != first


def test_sampler_without_shuffle_sorts_by_length() -> None:
    lengths = skewed_lengths(300)
    batches = list(BucketBatchSampler(lengths, 32, 1_000_000, shuffle=False))
    order = [i for b in batches for i in b]
    assert np.all(np.diff(lengths[order]) >= 0)


def test_bucketing_pads_less_than_random_batches() -> None:
    lengths = skewed_lengths()
    bucketed = BucketBatchSampler(lengths, 64, 50, seed=0).batches()
    plain = BucketBatchSampler(lengths, 64, 1, seed=0).batches()  # a window of one batch: no sorting
    share_bucketed, share_plain = padding_share(lengths, bucketed), padding_share(lengths, plain)
    assert share_bucketed < 0.5 * share_plain, (share_bucketed, share_plain)
    assert 0.0 <= share_bucketed < share_plain < 1.0


@pytest.mark.parametrize("n", [1, 3, 50, 97, 640, 641])
@pytest.mark.parametrize("shuffle", [True, False])
def test_ddp_ranks_get_equal_batch_counts_and_cover_everything(
    monkeypatch: pytest.MonkeyPatch, n: int, shuffle: bool
) -> None:
    lengths = skewed_lengths(n, seed=n)
    per_rank = {}
    for rank in (0, 1):
        monkeypatch.setattr(batching, "_world", lambda rank=rank: (2, rank))
        sampler = BucketBatchSampler(lengths, 32, 4, shuffle=shuffle, seed=1)
        sampler.set_epoch(2)
        per_rank[rank] = list(sampler)
        assert len(per_rank[rank]) == len(sampler)
    assert len(per_rank[0]) == len(per_rank[1]) >= 1
    together = per_rank[0] + per_rank[1]
    assert set(flat(together)) == set(range(n))
    # repeats only pad the shards: at most one extra batch in all, and it is an exact copy of another
    n_batches = -(-n // 32)
    assert len(together) - n_batches in (0, 1)
    reference = BucketBatchSampler(lengths, 32, 4, shuffle, seed=1)
    reference.set_epoch(2)
    assert {tuple(b) for b in together} == {tuple(b) for b in reference.batches()}


def test_ddp_with_more_ranks_than_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    lengths = np.array([3, 4, 5])
    counts = []
    for rank in range(4):
        monkeypatch.setattr(batching, "_world", lambda rank=rank: (4, rank))
        counts.append(len(list(BucketBatchSampler(lengths, 8, 1, shuffle=False))))
    assert counts == [1, 1, 1, 1]


# ---------------------------------------------------------------------------------------------------------
# MlmCollator
# ---------------------------------------------------------------------------------------------------------
def dataset() -> PatientDataset:
    lengths = [12, 40, 7, 25, 33, 18, 9, 30]
    return PatientDataset(sequences(lengths, seed=5), rows=np.arange(len(lengths)))


def test_fixed_collator_gives_identical_masks_on_repeated_calls() -> None:
    ds = dataset()
    items = [ds[i] for i in (2, 5, 7)]
    first = MlmCollator(VOCAB, seed=11, fixed=True)(items)
    again = MlmCollator(VOCAB, seed=11, fixed=True)
    for _ in range(2):
        batch = again(items)
        assert torch.equal(batch["token_ids"], first["token_ids"])
        assert torch.equal(batch["labels"], first["labels"])
    other = MlmCollator(VOCAB, seed=12, fixed=True)(items)
    assert not torch.equal(other["labels"], first["labels"])


def test_training_collator_draws_new_masks_each_epoch_and_batch() -> None:
    ds = dataset()
    items = [ds[i] for i in range(len(ds))]
    collate = MlmCollator(VOCAB, seed=0, mask_prob=0.5)
    first = collate(items)["labels"]
    collate.set_epoch(1)
    assert not torch.equal(collate(items)["labels"], first)  # same patients, next epoch: new masks
    other = MlmCollator(VOCAB, seed=0, mask_prob=0.5)(items[:-1])["labels"]
    assert not torch.equal(other, first[:-1, : other.shape[1]])  # another batch: its own masks
    # a function of (seed, epoch, batch) alone: what a resumed run (or a DataLoader worker) draws again
    collate.set_epoch(0)
    assert torch.equal(collate(items)["labels"], first)
    assert torch.equal(MlmCollator(VOCAB, seed=0, mask_prob=0.5)(items)["labels"], first)
    assert not torch.equal(MlmCollator(VOCAB, seed=1, mask_prob=0.5)(items)["labels"], first)


def test_sampler_resume_at_skips_the_batches_already_trained_on() -> None:
    lengths = np.arange(1, 41)
    full = BucketBatchSampler(lengths, 4, 2, shuffle=True, seed=3)
    full.set_epoch(2)
    epoch = list(full)
    resumed = BucketBatchSampler(lengths, 4, 2, shuffle=True, seed=3)
    resumed.resume_at(2, 3)
    assert list(resumed) == epoch[3:] and len(resumed) == len(epoch)
    assert list(resumed) == epoch  # the skip applies to one iteration only
    seen: list[int] = []
    resumed.add_epoch_listener(seen.append)
    resumed.resume_at(2, len(epoch))  # a finished epoch continues with the next one
    full.set_epoch(3)
    assert resumed.epoch == 3 and list(resumed) == list(full) and seen == [2, 3]


def test_training_collator_streams_differ_across_ddp_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    ds = dataset()
    items = [ds[i] for i in range(len(ds))]
    labels = []
    for rank in (0, 1):
        monkeypatch.setattr(batching, "_world", lambda rank=rank: (2, rank))
        labels.append(MlmCollator(VOCAB, seed=0, mask_prob=0.5)(items)["labels"])
    assert not torch.equal(labels[0], labels[1])


@pytest.mark.parametrize("fixed", [True, False])
def test_collator_labels_align_with_original_ids_and_skip_special_tokens(fixed: bool) -> None:
    ds = dataset()
    items = [ds[i] for i in range(len(ds))]
    original = pad_batch(items)["token_ids"]
    batch = MlmCollator(VOCAB, seed=3, fixed=fixed, mask_prob=0.5)(items)
    labels, inputs = batch["labels"], batch["token_ids"]
    chosen = labels != IGNORE_INDEX
    assert chosen.any()
    assert torch.equal(labels[chosen], original[chosen])  # the label is the original id
    special = original < S.N_SPECIAL  # [PAD], [CLS], [SEP] (and [MASK], [UNK])
    assert not chosen[special].any()
    assert torch.equal(inputs[special], original[special])  # never corrupted
    assert torch.equal(inputs[~chosen], original[~chosen])  # only chosen tokens change
    assert (inputs[chosen] == S.MASK_ID).float().mean() > 0.5  # mostly [MASK] (80% in expectation)
    assert (inputs[original == S.PAD_ID] == S.PAD_ID).all()
    for name in ("ages", "segments", "visit_index", "attention_mask"):
        assert name in batch


# ---------------------------------------------------------------------------------------------------------
# optimiser and schedule
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_lr_factor_warms_up_linearly_then_decays_to_zero(schedule: str) -> None:
    total, warmup = 100, 10
    f = np.array([lr_factor(s, total, warmup, schedule) for s in range(total + 1)])
    assert f[:warmup] == pytest.approx((np.arange(warmup) + 1) / warmup)  # linear warm-up, reaching 1
    assert f[warmup] == pytest.approx(1.0)
    assert np.all(np.diff(f[warmup:]) <= 1e-12)  # monotone decay
    assert f[total] == pytest.approx(0.0, abs=1e-12)
    assert f[(warmup + total) // 2] == pytest.approx(0.5)  # half-way through the decay, both schedules
    if schedule == "cosine":
        assert f[warmup + 10] > 1.0 - 10 / 90  # cosine stays above the line early on
    assert np.all((f >= 0) & (f <= 1))


def test_lr_factor_past_the_end_stays_at_zero() -> None:
    assert lr_factor(150, 100, 10, "linear") == 0.0


def test_weight_decay_groups_exclude_biases_norms_and_embeddings() -> None:
    model = BehrtForMaskedLM(
        ModelConfig(
            vocab_size=VOCAB, hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32, time2vec_periodic=4
        )
    )
    decay, no_decay = parameter_groups(model, 0.01)
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    kept = {names[id(p)] for p in no_decay["params"]}
    assert not decayed & kept
    assert decayed | kept == set(names.values())  # every parameter exactly once
    assert all(n.endswith(".weight") for n in decayed)
    assert not any(n.endswith("bias") for n in decayed)
    modules = dict(model.named_modules())

    def owner(name: str) -> torch.nn.Module:
        return modules[name.rpartition(".")[0]]

    for name in decayed:
        assert isinstance(owner(name), torch.nn.Linear), name
    for name in kept:
        assert (
            name.endswith("bias")
            or isinstance(owner(name), (torch.nn.LayerNorm, torch.nn.Embedding))
            or ".age." in name
            or ".visit_gap.log_gap." in name
            or name.endswith("visit_gap.first_visit")
        ), name  # Time2Vec's (age's and the visit gap's) own frequencies and phases, the first-visit vector
    assert "encoder.embeddings.age.proj.weight" in decayed  # a linear layer, though under "embeddings"
    assert "encoder.embeddings.visit_gap.log_gap.proj.weight" in decayed
    assert "encoder.embeddings.code.weight" in kept  # the code table, tied to the decoder
    assert "encoder.blocks.0.ln1.weight" in kept


def test_build_optimizer_schedule_follows_lr_factor() -> None:
    model = torch.nn.Linear(2, 2)
    cfg = TrainerConfig(learning_rate=0.1, warmup_fraction=0.2)
    optimizer, scheduler = build_optimizer(model, cfg, total_steps=10)
    seen = []
    for _ in range(10):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([0.1 * lr_factor(s, 10, 2, "linear") for s in range(10)])
    assert isinstance(optimizer, torch.optim.AdamW)
