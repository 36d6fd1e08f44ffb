"""The distillation teacher: the frozen paths' logits, the state path's share chosen on tuning, computed once."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from behrt_rope import schema as S
from behrt_rope.cli import main
from behrt_rope.data.datasets import (
    LabelledDataset,
    VisitScoredDataset,
    collate_labelled,
    collate_visit_scored,
)
from behrt_rope.data.labels import TaskConfig, build_samples, label_index
from behrt_rope.data.sequences import Sequences, load_tokens
from behrt_rope.training import tasks
from behrt_rope.training import teacher as teacher_module
from behrt_rope.training.bundle import load_bundle
from behrt_rope.training.clear_gain import ClearChoice
from behrt_rope.training.distillation_choice import PathLead
from behrt_rope.training.inference import multilabel_model, score_parts
from behrt_rope.training.teacher import choose_teacher
from behrt_rope.training.tuning_logits import TuningLogits
from pipelines.finetune import _split_data
from tests.fixtures_training import FAST_TRAINER, TINY_MODEL, build_etl, read_metrics


def _sequences() -> Sequences:
    """Three patients of 2, 3 and 1 visits, ``[CLS] code [SEP]`` per visit."""
    streams = [[1, 5, 2, 6, 2], [1, 7, 2, 5, 2, 6, 2], [1, 8, 2]]
    flat = np.concatenate(streams).astype(np.int64)
    visit = np.concatenate([[0] + [i // 2 for i in range(len(s) - 1)] for s in streams]).astype(np.int64)
    return Sequences(
        patients=pd.DataFrame(index=range(3)),
        offsets=np.r_[0, np.cumsum([len(s) for s in streams])].astype(np.int64),
        token_ids=flat,
        ages=np.full(len(flat), 50.0, dtype=np.float32),
        segments=np.zeros(len(flat), dtype=np.int64),
        visit_index=visit,
        visit_days=np.zeros(len(flat), dtype=np.int64),
    )


def test_items_carry_their_own_samples_teacher_rows_in_the_models_output_order():
    seqs = _sequences()
    rows, cuts = np.array([1, 0, 1, 2]), np.array([5, 3, 3, 3])  # samples not grouped by patient
    spans = np.array([[0, 0]] * 4)
    label_of_token = np.full(9, -1)
    label_of_token[5:7] = [0, 1]
    teacher = np.arange(8, dtype=np.float32).reshape(4, 2)  # sample i's row: [2 i, 2 i + 1]
    visit = VisitScoredDataset(seqs, rows, cuts, spans, label_of_token)
    visit.teacher = teacher
    batch = collate_visit_scored([visit[i] for i in range(len(visit))])
    sample_of_output = np.concatenate([visit.sample_order[visit.groups[i] : visit.groups[i + 1]] for i in range(3)])
    np.testing.assert_array_equal(batch["teacher"].numpy(), teacher[sample_of_output])
    assert batch["teacher"].shape == batch["targets"].shape
    per_sample = LabelledDataset(seqs, rows, cuts, spans, label_of_token)
    per_sample.teacher = teacher
    np.testing.assert_array_equal(collate_labelled([per_sample[i] for i in (2, 0)])["teacher"].numpy(), teacher[[2, 0]])
    visit.teacher = None
    assert "teacher" not in collate_visit_scored([visit[0]])


def test_a_training_step_learns_toward_the_batchs_teacher_rows():
    logits, y = torch.tensor([[0.3, -1.0]]), torch.tensor([[1.0, 0.0]])
    loss = tasks.multilabel_loss(logits, y, None)
    low, high = (tasks.distillation_loss(loss, logits, torch.full((1, 2), t), 0.8) for t in (-4.0, 4.0))
    expected = 0.2 * loss + 0.8 * torch.nn.functional.binary_cross_entropy_with_logits(
        logits, torch.sigmoid(torch.full((1, 2), 4.0))
    )
    torch.testing.assert_close(high, expected)
    assert low != high


def test_the_state_path_joins_the_teacher_only_when_clearly_better(monkeypatch: pytest.MonkeyPatch):
    rng = np.random.default_rng(0)
    n, labels = 600, 3
    y = (rng.random((n, labels)) < 0.3).astype(np.float32)
    noise = rng.normal(size=(n, labels)).astype(np.float32)
    informative = (3.0 * y - 1.5 + 0.5 * rng.normal(size=(n, labels))).astype(np.float32)

    def tuning(path: np.ndarray, states: np.ndarray) -> TuningLogits:
        return TuningLogits(y, np.arange(n), path, states, {0.0: noise})

    taught = choose_teacher(tuning(noise, informative), with_states=True)
    assert taught.share > 0 and taught.report["state_path_share"] == taught.share
    assert taught.report["over_share_0"][f"{taught.share:g}"]["low"] > 0
    mixed_probs = 1 / (1 + np.exp(-((1 - taught.share) * noise + taught.share * informative)))
    np.testing.assert_allclose(taught.tuning_probs, mixed_probs, rtol=1e-5)
    # on another split the teacher mixes that split's logits at the share it chose
    monkeypatch.setattr(teacher_module, "_path_logits", lambda model, split, device, with_states: (noise, informative))
    mixed = taught.logits(None, None, torch.device("cpu"))  # type: ignore[arg-type]
    np.testing.assert_allclose(mixed, (1 - taught.share) * noise + taught.share * informative, rtol=1e-6)
    assert choose_teacher(tuning(informative, noise), with_states=True).share == 0.0  # the states only blur it
    alone = choose_teacher(tuning(noise, informative), with_states=False)
    assert alone.share == 0.0 and alone.report == {"state_path_share": 0.0}


@pytest.fixture(scope="module")
def etl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_etl(tmp_path_factory.mktemp("teacher"), patients=160, seed=3)


def test_finetune_fits_the_chains_first_and_distills_the_chosen_teacher(
    etl: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """With the state path forced into the teacher (share 0.5), the second training's steps read the teacher's
    precomputed logits: (1 - t) x sparse time path + t x state path of the saved model, every train sample."""
    monkeypatch.setattr("pipelines.finetune.path_leads", lambda y, deep, path, patients: PathLead(0.1, 0.2))
    forced = ClearChoice(0.5, {0.0: 0.1, 0.5: 0.2}, {0.5: (0.1, 0.05, 0.15)})
    monkeypatch.setattr(teacher_module, "choose_clearly_better", lambda *a, **k: forced)
    seen: list[torch.Tensor] = []
    distill = tasks.distillation_loss

    def spy(loss: torch.Tensor, logits: torch.Tensor, teacher: torch.Tensor, weight: float) -> torch.Tensor:
        seen.append(teacher.detach().clone())
        return distill(loss, logits, teacher, weight)

    monkeypatch.setattr(tasks, "distillation_loss", spy)
    out = tmp_path / "ft"
    argv = ["finetune", "--data", str(etl), "--out", str(out), "--max-epochs", "1", "task.min_label_count=2"]
    chains = ("model.state_path=2", "model.state_path_copies=1", "state_path_max_epochs=2")
    assert main([*argv, *TINY_MODEL, *FAST_TRAINER, *chains]) == 0
    metrics = read_metrics(out)
    assert metrics["distillation_choice"]["weights_tried"] == [0.0, 0.8]
    assert metrics["state_path"]["fitted"] and metrics["state_path"]["distillation_teacher"]["state_path_share"] == 0.5
    bundle = load_bundle(out, "multilabel")
    model = multilabel_model(bundle)
    train_seqs = load_tokens(etl).split(S.TRAIN)
    task = TaskConfig(min_label_count=2)
    train = _split_data(train_seqs, task, label_index(bundle["label_token_ids"], len(bundle["vocab"])), "visit")
    rows, cuts = train.samples.rows, train.samples.cuts
    logit = score_parts(model, train.seqs, rows, cuts, parts=("path", "states"), logits=True)
    expected = 0.5 * logit["path"] + 0.5 * logit["states"]  # (N, L) in the samples' order
    taught = torch.cat(seen).numpy()  # one epoch: every train sample once, in batch order
    assert taught.shape == expected.shape == (len(build_samples(train_seqs, task).rows), len(bundle["labels"]))
    np.testing.assert_allclose(np.sort(taught, axis=0), np.sort(expected, axis=0), rtol=1e-4, atol=1e-4)
