"""The fast scorer: length buckets, vectorised padding, and probabilities equal to the reference loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from behrt_rope.data.sequences import load_tokens
from behrt_rope.model.config import ModelConfig
from behrt_rope.model.heads import BehrtForMultiLabel
from behrt_rope.scoring.batches import length_buckets
from behrt_rope.scoring.precision import resolve_dtype
from behrt_rope.scoring.scorer import Scorer
from behrt_rope.training.inference import score
from tests.fixtures_training import build_etl


@given(st.lists(st.integers(1, 300), min_size=1, max_size=200), st.integers(1, 4000), st.integers(1, 64))
@settings(max_examples=60, deadline=None)
def test_length_buckets_cover_every_row_once_within_the_budget(lengths, max_tokens, max_batch):
    lengths = np.array(lengths)
    batches = length_buckets(lengths, max_tokens, max_batch)
    rows = np.concatenate(batches)
    assert sorted(rows.tolist()) == list(range(len(lengths)))
    assert (np.diff(lengths[rows]) >= 0).all()  # ascending length: similar lengths share a batch
    for b in batches:
        assert 1 <= len(b) <= max_batch
        assert len(b) == 1 or len(b) * lengths[b].max() <= max_tokens


@pytest.fixture(scope="module")
def seqs(tmp_path_factory):
    return load_tokens(build_etl(tmp_path_factory.mktemp("scoring"), patients=120, seed=1))


@pytest.mark.parametrize("pooling", ["visit", "cls", "mean"])
def test_scorer_matches_the_reference_scoring_loop(seqs, pooling):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=int(seqs.token_ids.max()) + 1, hidden_size=16, num_layers=2, num_heads=2)
    model = BehrtForMultiLabel(config, 7, pooling).eval()
    torch.nn.init.normal_(model.classifier.weight, std=0.5)  # spread the probabilities
    reference = score(model, seqs, batch_size=1)  # one patient per forward: no padding at all
    fast = Scorer(model, torch.device("cpu"), "fp32", max_tokens=900, max_batch=16).score(seqs)
    assert fast.shape == (len(seqs), 7)
    np.testing.assert_allclose(fast, reference, atol=2e-6, rtol=0)
    assert fast.std() > 0.01


def test_parallel_workers_give_the_same_probabilities(seqs):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=int(seqs.token_ids.max()) + 1, hidden_size=16, num_layers=2, num_heads=2)
    model = BehrtForMultiLabel(config, 5).eval()
    one = Scorer(model, torch.device("cpu"), "fp32", max_tokens=300, max_batch=8, workers=1).score(seqs)
    threads = torch.get_num_threads()
    three = Scorer(model, torch.device("cpu"), "fp32", max_tokens=300, max_batch=8, workers=3).score(seqs)
    assert torch.get_num_threads() == threads  # the pool's single-thread setting stays in its own threads
    np.testing.assert_allclose(three, one, atol=1e-6, rtol=0)
    assert (three > 0).all()  # every row written, in its place
    with pytest.raises(ValueError, match="workers"):
        Scorer(model, torch.device("cpu"), workers=-1)


def test_precision_auto_never_picks_emulated_bf16():
    cpu = torch.device("cpu")
    assert resolve_dtype("fp32", cpu) == torch.float32 and resolve_dtype("bf16", cpu) == torch.bfloat16
    native = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert resolve_dtype("auto", cpu) == (torch.bfloat16 if native else torch.float32)
