"""Early stopping with a patience that grows with the best epoch (``trainer.early_stopping_ratio``)."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import EarlyStopping
from torch.utils.data import DataLoader, TensorDataset

from behrt_rope.training.config import TrainerConfig
from behrt_rope.training.early_stopping import GrowingPatienceEarlyStopping


class ScriptedCurve(pl.LightningModule):
    """Trains nothing useful; its validation reports ``curve[epoch]`` as ``val/macro_ap``."""

    def __init__(self, curve: list[float]) -> None:
        super().__init__()
        self.curve = curve
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return (self.weight - batch[0]).pow(2).mean()

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("val/macro_ap", self.curve[self.current_epoch])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def epochs_run(curve: list[float], stopper: pl.Callback) -> int:
    """Epochs a trainer runs on ``curve`` (at most its length) with ``stopper``."""
    loader = DataLoader(TensorDataset(torch.ones(2, 1)), batch_size=2)
    trainer = pl.Trainer(
        max_epochs=len(curve),
        callbacks=[stopper],
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(ScriptedCurve(curve), loader, loader)
    return trainer.current_epoch


def rising_then_flat(best_epoch: int, epochs: int = 20) -> list[float]:
    """A curve that improves until ``best_epoch`` (1-based) and then stays just below its best."""
    return [0.1 + 0.01 * min(e, best_epoch) - 0.001 * (e > best_epoch) for e in range(1, epochs + 1)]


@pytest.mark.parametrize(("best_epoch", "stops_after"), [(2, 7), (4, 9), (8, 16), (12, 20)])
def test_a_run_stops_once_it_has_gone_twice_as_far_as_its_best_epoch(best_epoch: int, stops_after: int) -> None:
    stopper = GrowingPatienceEarlyStopping(monitor="val/macro_ap", mode="max", patience=5, ratio=1.0)
    assert epochs_run(rising_then_flat(best_epoch), stopper) == stops_after
    assert stopper.best_check == best_epoch


def test_ratio_zero_is_lightnings_fixed_patience() -> None:
    curve = [0.20, 0.25, 0.24, 0.26, 0.25, 0.25, 0.24, 0.26, 0.23, 0.22, 0.21, 0.20]
    fixed = EarlyStopping(monitor="val/macro_ap", mode="max", patience=3, strict=False)
    growing = GrowingPatienceEarlyStopping(monitor="val/macro_ap", mode="max", patience=3, ratio=0.0)
    assert epochs_run(curve, growing) == epochs_run(curve, fixed) == 7  # best at epoch 4, 3 epochs without progress


def test_a_late_improvement_restarts_the_count_with_a_longer_patience() -> None:
    # best at epoch 3 (patience 3), a new best at epoch 5 (patience 5 from there): stops after epoch 10,
    # where a fixed patience of 2 would have stopped after epoch 7
    curve = [0.10, 0.20, 0.30, 0.29, 0.31] + [0.30] * 15
    stopper = GrowingPatienceEarlyStopping(monitor="val/macro_ap", mode="max", patience=2, ratio=1.0)
    assert epochs_run(curve, stopper) == 10
    assert (stopper.best_check, stopper.patience) == (5, 5)
    fixed = EarlyStopping(monitor="val/macro_ap", mode="max", patience=2, strict=False)
    assert epochs_run(curve, fixed) == 7


def test_state_survives_a_checkpoint_round_trip() -> None:
    stopper = GrowingPatienceEarlyStopping(monitor="val/macro_ap", mode="max", patience=5, ratio=1.0)
    epochs_run(rising_then_flat(4, epochs=6), stopper)
    again = GrowingPatienceEarlyStopping(monitor="val/macro_ap", mode="max", patience=5, ratio=1.0)
    again.load_state_dict(stopper.state_dict())
    assert (again.checks, again.best_check, again.wait_count) == (6, 4, 2)
    assert float(again.best_score) == pytest.approx(0.14)


def test_negative_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="early_stopping_ratio"):
        TrainerConfig(early_stopping_ratio=-1.0)
    with pytest.raises(ValueError, match="ratio"):
        GrowingPatienceEarlyStopping(monitor="m", mode="max", patience=1, ratio=-0.5)
