"""The model on a CUDA device: training there, scoring there, and the same answers as on the CPU.

Every test here is marked ``gpu`` and skipped without a CUDA device (CI has none); run them where one is:
``python -m pytest -m gpu``. The CPU suite covers the same code paths on the CPU.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from behrt_rope.cli import main
from behrt_rope.data.sequences import load_tokens
from behrt_rope.model.attention import SelfAttention, key_padding_mask
from behrt_rope.model.config import ModelConfig
from behrt_rope.model.heads import BehrtForMultiLabel
from behrt_rope.scoring.scorer import Scorer
from behrt_rope.training.bundle import load_bundle
from behrt_rope.training.inference import multilabel_model, score_parts
from tests.fixtures_training import FAST_TRAINER, TINY_MODEL, build_etl, read_metrics

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def etl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_etl(tmp_path_factory.mktemp("gpu"), patients=160, seed=3)


def default_head_model(vocab_size: int, num_labels: int) -> BehrtForMultiLabel:
    """A small model with the default fine-tuning head (label attention, age heads, history max), spread
    so that its probabilities differ between patients."""
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=vocab_size, hidden_size=32, num_layers=2, num_heads=4, sparse_time=False)
    model = BehrtForMultiLabel(config, num_labels).eval()
    torch.nn.init.normal_(model.classifier.weight, std=0.5)
    return model


def test_gpu_scoring_in_fp32_equals_cpu_scoring(etl: Path) -> None:
    seqs = load_tokens(etl)
    model = default_head_model(int(seqs.token_ids.max()) + 1, 6)
    on_cpu = Scorer(model, CPU, "fp32", max_tokens=2000, max_batch=32).score(seqs)
    on_gpu = Scorer(model, CUDA, "fp32", max_tokens=2000, max_batch=32).score(seqs)
    assert on_gpu.shape == on_cpu.shape == (len(seqs), 6)
    assert on_cpu.std() > 0.01  # the comparison is not between constants
    np.testing.assert_allclose(on_gpu, on_cpu, atol=1e-4, rtol=0)


def test_gpu_bf16_scoring_keeps_the_cpu_ranking(etl: Path) -> None:
    if not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    seqs = load_tokens(etl)
    model = default_head_model(int(seqs.token_ids.max()) + 1, 6)
    on_cpu = Scorer(model, CPU, "fp32", max_tokens=2000, max_batch=32).score(seqs)
    in_bf16 = Scorer(model, CUDA, "bf16", max_tokens=2000, max_batch=32).score(seqs)
    assert np.abs(in_bf16 - on_cpu).max() < 0.05
    for label in range(on_cpu.shape[1]):  # each label orders the patients almost as in fp32
        assert np.corrcoef(in_bf16[:, label], on_cpu[:, label])[0, 1] > 0.99


def test_finetune_on_the_gpu_then_score_the_saved_model_on_the_cpu(etl: Path, tmp_path: Path) -> None:
    out = tmp_path / "ft"
    argv = ["finetune", "--data", str(etl), "--out", str(out), "--max-epochs", "2", "task.min_label_count=2"]
    status = main([*argv, *TINY_MODEL, *FAST_TRAINER, "trainer.accelerator=gpu", "trainer.devices=1"])
    assert status == 0
    metrics = read_metrics(out)
    assert 0.0 < metrics["tuning_macro_ap"] <= 1.0
    assert 0.0 <= metrics["sparse_time_share"] <= 1.0  # the sparse path was fitted and mixed on the GPU run
    bundle = load_bundle(out, "multilabel")
    assert all(t.device.type == "cpu" for t in bundle["state_dict"].values())  # saved device-free
    model = multilabel_model(bundle)
    seqs = load_tokens(etl)
    parts = score_parts(model, seqs, parts=("model", "deep", "path"), device=CPU)
    on_gpu = score_parts(model, seqs, parts=("model",), device=CUDA)["model"]
    assert all(np.isfinite(p).all() and ((p >= 0) & (p <= 1)).all() for p in parts.values())
    assert not np.allclose(parts["deep"], parts["path"])  # both parts are in the saved model
    np.testing.assert_allclose(on_gpu, parts["model"], atol=0.02, rtol=0)  # bf16 autocast on the GPU
    assert math.isfinite(float(np.mean(parts["model"])))


def test_a_model_scored_on_the_gpu_can_still_be_changed(etl: Path) -> None:
    """``finetune`` scores the tuning split on the training device, then sets the path's share on the same
    model: scoring must not leave its tensors as inference-mode tensors (which refuse in-place updates)."""
    seqs = load_tokens(etl)
    torch.manual_seed(0)
    model = BehrtForMultiLabel(ModelConfig(vocab_size=int(seqs.token_ids.max()) + 1, hidden_size=16, num_heads=2), 4)
    assert model.sparse_time is not None
    score_parts(model, seqs, parts=("deep", "path"), device=CUDA)
    assert not any(t.is_inference() for t in [*model.parameters(), *model.buffers()])
    model.sparse_time.set_share(0.3)
    assert float(model.sparse_time.share) == pytest.approx(0.3)


def test_attention_on_the_gpu_does_not_take_cudnn_s_per_shape_plans() -> None:
    """Training brings a new padded length almost every batch; cuDNN's SDPA builds a plan for each (about
    130 ms a step on an H200), so the model's attention runs on the other backends there."""
    attention = SelfAttention(ModelConfig(vocab_size=10, hidden_size=32, num_heads=4)).to(CUDA).train()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        for length in (7, 13, 29):  # new shapes, padded keys masked as in training
            x = torch.randn(2, length, 32, device=CUDA, requires_grad=True)
            mask = key_padding_mask(
                torch.arange(length, device=CUDA)[None] < torch.tensor([[length], [3]], device=CUDA)
            )
            with torch.autocast("cuda", dtype=torch.bfloat16):
                attention(x, attn_mask=mask).float().sum().backward()
    names = [event.key for event in profile.key_averages()]
    assert not [name for name in names if "cudnn_attention" in name]
    assert [name for name in names if "efficient_attention" in name or "flash_attention" in name]


def test_the_state_filter_on_the_gpu_under_autocast_equals_the_cpu() -> None:
    """The hidden-state filter runs in float32 even under bf16 autocast (its chances multiply over dozens of
    visits): on the GPU its logits equal the CPU's to float32 rounding, and so do its gradients."""
    from behrt_rope.model.state_filter import HiddenStateFilter
    from behrt_rope.schema import CLS_ID, N_SPECIAL, SEP_ID

    torch.manual_seed(0)
    B, visits, codes = 8, 12, 3
    ids = torch.randint(N_SPECIAL, N_SPECIAL + 20, (B, visits, codes + 1))
    ids[:, :, -1] = SEP_ID
    ids = torch.cat([torch.full((B, 1), CLS_ID), ids.flatten(1)], dim=1)  # (B, 1 + visits (codes + 1))
    visit_index = torch.cat(
        [torch.zeros(B, 1, dtype=torch.long), torch.arange(visits).repeat_interleave(codes + 1).expand(B, -1)], dim=1
    )
    ages = 30.0 + torch.rand(B, 1) * 40 + visit_index.float() * torch.rand(B, 1) * 2
    sex = torch.randint(1, 3, (B, 1)).expand_as(ids)
    score_at = ids == SEP_ID
    results = {}
    for device in (CPU, CUDA):
        torch.manual_seed(1)
        chain = HiddenStateFilter(N_SPECIAL + 20, num_labels=5, num_states=3).to(device)
        inputs = [t.to(device) for t in (ids, visit_index, ages, score_at, sex)]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = chain(*inputs[:4], inputs[4])
        assert logits.dtype == torch.float32
        logits.sum().backward()
        results[device.type] = (logits.detach().cpu(), chain.evidence.grad.cpu())
    torch.testing.assert_close(results["cuda"][0], results["cpu"][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(results["cuda"][1], results["cpu"][1], rtol=1e-3, atol=1e-5)
