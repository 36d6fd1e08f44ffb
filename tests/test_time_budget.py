"""The wall-clock budget of a training stage (``trainer.max_minutes``): a clock that the test moves by hand
stands in for the host, so what the budget decides is exact."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch

from behrt_rope.training.config import TrainerConfig
from behrt_rope.training.optim import WarmupDecay, build_optimizer
from behrt_rope.training.time_budget import TimeBudget, epochs_that_fit
from behrt_rope.training.trainer import build_trainer

BATCHES = 4
"""Training batches per epoch of the toy task."""


class FakeClock:
    """Seconds that pass only when the test says so: every training epoch takes ``epoch_seconds`` (a list: one
    value per epoch, the last one repeated)."""

    def __init__(self, epoch_seconds: float | list[float]) -> None:
        self.now = 1000.0
        self.durations = epoch_seconds if isinstance(epoch_seconds, list) else [epoch_seconds]
        self.epochs = 0

    def next_epoch(self) -> None:
        self.now += self.durations[min(self.epochs, len(self.durations) - 1)]
        self.epochs += 1

    def __call__(self) -> float:
        return self.now


class EpochTakes(pl.Callback):
    """Moves the fake clock on by one epoch's duration at the start of every epoch."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.clock.next_epoch()


class ValidationTakes(pl.Callback):
    """Moves the fake clock on by ``seconds`` during every validation epoch (before the budget reads it)."""

    def __init__(self, clock: FakeClock, seconds: float) -> None:
        self.clock, self.seconds = clock, seconds

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.clock.now += self.seconds


class Toy(pl.LightningModule):
    """A linear regression trained with the library's optimiser and schedule; records the lr of every step."""

    def __init__(self, cfg: TrainerConfig) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.cfg = cfg
        self.lrs: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> Any:
        optimizer, scheduler = build_optimizer(self, self.cfg, int(self.trainer.estimated_stepping_batches))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val/loss", torch.nn.functional.mse_loss(self.layer(x), y))


def fit(
    tmp_path: Path, cfg: TrainerConfig, budget: TimeBudget | None, clock: FakeClock, validation_seconds: float = 0.0
) -> tuple[pl.Trainer, Toy]:
    """Train the toy; with ``validation_seconds`` it is validated after every epoch, each validation taking that
    long on the clock."""
    data = torch.utils.data.TensorDataset(torch.randn(BATCHES * 8, 3), torch.randn(BATCHES * 8, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    toy = Toy(cfg)
    cfg.progress_bar = False
    validated = [ValidationTakes(clock, validation_seconds)] if validation_seconds else []
    callbacks = [EpochTakes(clock), *validated, *([budget] if budget else [])]
    trainer = build_trainer(cfg, tmp_path, monitor=None, mode="min", extra_callbacks=callbacks)
    trainer.fit(toy, loader, loader if validation_seconds else None)
    return trainer, toy


def schedule_of(trainer: pl.Trainer) -> WarmupDecay:
    factor = trainer.lr_scheduler_configs[0].scheduler.lr_lambdas[0]  # type: ignore[attr-defined]
    assert isinstance(factor, WarmupDecay)
    return factor


def test_a_tight_budget_ends_the_schedule_at_the_last_epoch_that_fits_and_stops_there(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock(epoch_seconds=60.0)
    budget = TimeBudget(minutes=5.5, spent_seconds=30.0, clock=clock)  # 300 s left for 60 s epochs: 5 fit
    cfg = TrainerConfig(max_epochs=20, accelerator="cpu", learning_rate=0.1, early_stopping_patience=0)
    with caplog.at_level(logging.WARNING, logger="behrt_rope.training.time_budget"):
        trainer, toy = fit(tmp_path, cfg, budget, clock)
    assert trainer.current_epoch == 5
    assert (budget.planned_epochs, budget.stopped) == (5, True)
    assert schedule_of(trainer).total == 5 * BATCHES  # was 20 epochs' steps
    assert len(toy.lrs) == 5 * BATCHES
    # Warm-up over the first 8 steps (10% of 20 epochs' 80), then the decay reaches 0 with the last step that
    # fits (step 19 of 20: 1/12 of the peak), instead of breaking off at a high learning rate.
    assert toy.lrs[-1] == pytest.approx(0.1 / 12, rel=1e-6)
    assert toy.lrs == sorted(toy.lrs[:8]) + sorted(toy.lrs[8:], reverse=True)
    assert budget.report() == {
        "time_budget_minutes": 5.5,
        "time_budget_planned_epochs": 5,
        "time_budget_stopped": True,
        "time_budget_reserved_seconds": 0.0,
        "time_budget_choices_seconds": 0.0,
        "time_budget_held_back_seconds": 0.0,
    }
    messages = [r.getMessage() for r in caplog.records]
    assert any("5 epochs fit in 5.5 minutes at 60 s per epoch" in m for m in messages), messages
    assert any("stopping after epoch 5 of 20" in m and "trainer.max_minutes" in m for m in messages), messages


def test_a_run_stops_where_its_shortened_schedule_ends_even_when_epochs_got_faster(tmp_path: Path) -> None:
    clock = FakeClock(epoch_seconds=[100.0, 10.0])  # a slow first epoch: 2 more fit, then time to spare
    budget = TimeBudget(minutes=5.0, clock=clock)
    trainer, toy = fit(tmp_path, TrainerConfig(max_epochs=20, accelerator="cpu"), budget, clock)
    assert trainer.current_epoch == 3 and budget.stopped  # no epochs at a learning rate of 0
    assert budget.planned_epochs == 3 and len(toy.lrs) == 3 * BATCHES


def test_a_budget_that_is_not_tight_changes_nothing(tmp_path: Path) -> None:
    clock = FakeClock(epoch_seconds=60.0)
    budget = TimeBudget(minutes=10.0, clock=clock)  # 3 epochs of 60 s
    cfg = TrainerConfig(max_epochs=3, accelerator="cpu", early_stopping_patience=0)
    trainer, toy = fit(tmp_path / "budget", cfg, budget, clock)
    _, free_toy = fit(tmp_path / "free", TrainerConfig(max_epochs=3, accelerator="cpu"), None, clock)
    assert trainer.current_epoch == 3 and not budget.stopped and budget.planned_epochs == 3
    assert schedule_of(trainer).total == 3 * BATCHES
    assert toy.lrs == free_toy.lrs


def test_a_budget_spent_before_training_allows_one_epoch(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock(epoch_seconds=1.0)
    budget = TimeBudget(minutes=1.0, spent_seconds=75.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="behrt_rope.training.time_budget"):
        trainer, _ = fit(tmp_path, TrainerConfig(max_epochs=4, accelerator="cpu"), budget, clock)
    assert trainer.current_epoch == 1 and budget.stopped
    assert any("1.2 of 1.0 minutes were spent before training" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(("reserve", "choices", "epochs"), [(0.0, 0.0, 4), (2.0, 0.0, 3), (2.0, 60.0, 2)])
def test_a_reserve_of_validations_and_measured_choices_is_held_back_for_the_work_after_training(
    tmp_path: Path, reserve: float, choices: float, epochs: int
) -> None:
    """Epochs of 60 s, each validated in 20 s, in 330 s: four fit; two validations' worth held back (40 s) leave
    290 s, in which three do; 60 s more for the choices after training (measured before it) leave 230 s: two."""
    clock = FakeClock(epoch_seconds=60.0)
    budget = TimeBudget(minutes=5.5, clock=clock, reserve_validations=reserve, reserve_choices=choices)
    cfg = TrainerConfig(max_epochs=20, accelerator="cpu", early_stopping_patience=0)
    trainer, _ = fit(tmp_path, cfg, budget, clock, validation_seconds=20.0)
    assert trainer.current_epoch == epochs and budget.planned_epochs == epochs and budget.stopped
    assert budget.validation_seconds == 20.0
    assert budget.report()["time_budget_reserved_seconds"] == 20.0 * reserve + choices
    assert budget.report()["time_budget_choices_seconds"] == choices
    assert budget.elapsed() + budget.reserve_seconds <= 330.0
    with pytest.raises(ValueError, match="reserve_validations must be >= 0"):
        TimeBudget(minutes=1.0, reserve_validations=-1.0)
    with pytest.raises(ValueError, match="reserve_choices must be >= 0"):
        TimeBudget(minutes=1.0, reserve_choices=-1.0)


def test_seconds_held_back_for_the_chains_shorten_the_training_and_stay_apart_from_the_reserve(tmp_path: Path) -> None:
    """Epochs of 60 s in 330 s: five fit; 100 s held back (fine-tuning's chains) leave 230 s, in which three do.
    The held-back seconds are not part of the reserve that the stage's later choices are told about."""
    clock = FakeClock(epoch_seconds=60.0)
    budget = TimeBudget(minutes=5.5, clock=clock, held_back_seconds=100.0)
    cfg = TrainerConfig(max_epochs=20, accelerator="cpu", early_stopping_patience=0)
    trainer, _ = fit(tmp_path, cfg, budget, clock)
    assert trainer.current_epoch == 3 and budget.planned_epochs == 3 and budget.stopped
    assert budget.reserve_seconds == 0.0
    assert budget.report()["time_budget_held_back_seconds"] == 100.0
    with pytest.raises(ValueError, match="held_back_seconds must be >= 0"):
        TimeBudget(minutes=1.0, held_back_seconds=-1.0)


def test_the_elapsed_time_and_the_plan_survive_a_checkpoint() -> None:
    clock = FakeClock(epoch_seconds=0.0)
    budget = TimeBudget(minutes=10.0, clock=clock)
    budget._started, budget.planned_epochs = clock.now - 125.0, 7
    resumed = TimeBudget(minutes=10.0, clock=clock)
    budget.validation_seconds = 12.5
    resumed.load_state_dict(budget.state_dict())
    assert (resumed.elapsed(), resumed.planned_epochs, resumed.stopped) == (125.0, 7, False)
    assert resumed.validation_seconds == 12.5


def test_a_shortened_schedule_is_saved_with_the_scheduler() -> None:
    cfg = TrainerConfig(learning_rate=1.0)
    _, scheduler = build_optimizer(torch.nn.Linear(2, 2), cfg, total_steps=100)
    scheduler.lr_lambdas[0].shorten(40)  # type: ignore[attr-defined]
    _, fresh = build_optimizer(torch.nn.Linear(2, 2), cfg, total_steps=100)
    fresh.load_state_dict(scheduler.state_dict())
    assert fresh.lr_lambdas[0].total == 40  # type: ignore[attr-defined]


def test_epochs_that_fit_and_bad_budgets() -> None:
    assert epochs_that_fit(elapsed=100.0, budget=1000.0, done=1) == 9
    assert epochs_that_fit(elapsed=100.0, budget=199.0, done=1) == 0
    with pytest.raises(ValueError, match="minutes > 0"):
        TimeBudget(minutes=0.0)
    with pytest.raises(ValueError, match="max_minutes must be >= 0"):
        TrainerConfig(max_minutes=-1.0)
