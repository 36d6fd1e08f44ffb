"""Fine-tuning with an exponential moving average of the weights (``trainer.ema_decay``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch
import torch

from behrt_rope import schema as S
from behrt_rope.cli import main
from behrt_rope.errors import UserError
from behrt_rope.training.checkpoints import load_checkpoint
from behrt_rope.training.config import TrainerConfig
from behrt_rope.training.trainer import weight_average
from tests.fixtures_training import FAST_TRAINER, TINY_MODEL, build_etl, read_metrics


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ema")
    etl = build_etl(root, patients=120)
    out = root / "ft"
    argv = ["finetune", "--data", str(etl), "--out", str(out), "--max-epochs", "2", "task.min_label_count=2"]
    assert main([*argv, *TINY_MODEL, *FAST_TRAINER, "trainer.ema_decay=0.9", "trainer.learning_rate=0.01"]) == 0
    return out


def test_saved_model_is_the_average_not_the_last_step(ema_run: Path) -> None:
    best = load_checkpoint(Path(read_metrics(ema_run)["best_checkpoint"]))  # the kept run's (of two weights)
    averaged, current = best["state_dict"], best["current_model_state"]
    assert averaged.keys() == current.keys()
    name = "model.classifier.weight"
    assert not torch.allclose(averaged[name], current[name]), "the average lags the optimiser's weights"
    saved = safetensors.torch.load_file(str(ema_run / S.MODEL_WEIGHTS_FILE))
    torch.testing.assert_close(saved["classifier.weight"], averaged[name])
    ids = [k for k in averaged if k.endswith("label_token_ids")]
    assert ids and all(torch.equal(averaged[k], current[k]) for k in ids), "integer buffers are not averaged"


def test_resume_restores_both_weight_sets(ema_run: Path) -> None:
    last = load_checkpoint(ema_run / S.CHECKPOINT_DIR / S.LAST_CHECKPOINT)
    assert {"state_dict", "current_model_state", "averaging_state"} <= last.keys()


def test_decay_outside_the_unit_interval_is_refused() -> None:
    assert weight_average(TrainerConfig()) is None
    with pytest.raises(UserError, match="ema_decay"):
        weight_average(TrainerConfig(ema_decay=1.5))
