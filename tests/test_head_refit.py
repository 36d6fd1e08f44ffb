"""``benchmarks/head_refit.py``: the head trained on cached encoder states starts exactly at the saved model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from behrt_rope import schema as S
from behrt_rope.data.labels import TaskConfig, build_samples, label_index, targets
from behrt_rope.data.sequences import load_tokens
from behrt_rope.training.bundle import load_bundle
from behrt_rope.training.inference import multilabel_model, score_parts
from behrt_rope.training.tasks import macro_average_precision
from benchmarks.head_refit import cache_states, head_optimizer, split_scores, train_pass
from tests.fixtures_training import build_finetuned


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    raw, model_dir = build_finetuned(tmp_path_factory.mktemp("head_refit"), patients=160, seed=5)
    return raw.parent / "etl", model_dir


def test_the_cached_head_scores_the_tuning_split_as_the_saved_model_does(finetuned):
    etl, model_dir = finetuned
    bundle = load_bundle(model_dir, "multilabel")
    model = multilabel_model(bundle)
    seqs = load_tokens(etl).split(S.TUNING)
    label_of_token = label_index(np.asarray(bundle["label_token_ids"]), len(bundle["vocab"]))
    samples = build_samples(seqs, TaskConfig())
    y = targets(seqs, samples, label_of_token)
    assert len(y) > 0 and y.sum() > 0
    parts = score_parts(model, seqs, samples.rows, samples.cuts, parts=("deep", "model"))
    cached = split_scores(model, cache_states(model, seqs, label_of_token, batch_size=8))
    assert cached["deep"] == pytest.approx(round(macro_average_precision(y, parts["deep"]), 4), abs=1e-4)
    assert cached["model"] == pytest.approx(round(macro_average_precision(y, parts["model"]), 4), abs=1e-4)


def test_refitting_moves_the_head_and_leaves_the_encoder_and_the_path_alone(finetuned):
    etl, model_dir = finetuned
    bundle = load_bundle(model_dir, "multilabel")
    model = multilabel_model(bundle)
    label_of_token = label_index(np.asarray(bundle["label_token_ids"]), len(bundle["vocab"]))
    batches = cache_states(model, load_tokens(etl).split(S.TRAIN), label_of_token, batch_size=16)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = head_optimizer(model, lr=1e-2, weight_decay=0.01)
    train_pass(model, optimizer, batches, np.arange(len(batches)))
    moved = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    assert "classifier.weight" in moved and "classifier.bias" in moved
    assert not any(name.startswith(("encoder.", "sparse_time.")) for name in moved)
