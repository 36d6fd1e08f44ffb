"""A wall-clock budget for a training stage: fit the schedule to the epochs that fit, stop before overrunning.

``max_epochs`` fixes the amount of work, not its time: a slower host, a larger label space (the fine-tuning
head's cost grows with the number of labels) or longer histories stretch a run past any budget a user
planned for. With ``trainer.max_minutes`` set, after every epoch (its validation included) this callback
estimates how many more epochs of the mean length seen so far fit in what is left of the budget, and

- when fewer than ``max_epochs`` fit, shortens the learning-rate schedule
  (:class:`~behrt_rope.training.optim.WarmupDecay`) so that the decay ends at the last epoch that fits: a
  run on a slow host still anneals, instead of being cut off at a high learning rate;
- when not even one more fits, stops the run (the best check and the checkpoint soup are kept as usual).

It never lengthens a schedule and never cuts an epoch in half, so a budget that is not tight changes nothing:
the run is the one without a budget, epoch for epoch. The training time so far is saved in checkpoints, so a
resumed run counts it. Time the stage spent before training (loading data, the sparse time path's fit) is
passed as ``spent_seconds`` and counts against the budget. Work the stage does after training is held back as
``reserve_validations`` x the longest validation epoch seen (fine-tuning scores the same tuning split as a
validation epoch does, ``training/tuning_logits.py``) plus ``reserve_choices`` seconds: the bootstrapped choices
on those scores, whose cost follows numpy's ranking on the host rather than the model's forward pass, measured
before training (``training/choice_cost.py``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl

from behrt_rope.training.optim import WarmupDecay

log = logging.getLogger(__name__)


class TimeBudget(pl.Callback):
    """Stops and shortens the schedule so that a stage's training ends within ``minutes`` of wall-clock time.

    ``planned_epochs`` is the number of epochs the schedule now ends at (``max_epochs`` until the budget binds);
    ``stopped`` tells whether the budget ended the run. ``clock`` (seconds) is there for tests.
    """

    def __init__(
        self,
        minutes: float,
        spent_seconds: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        reserve_validations: float = 0.0,
        held_back_seconds: float = 0.0,
        reserve_choices: float = 0.0,
    ):
        if minutes <= 0:
            raise ValueError(f"a time budget needs minutes > 0, got {minutes}")
        if reserve_validations < 0:
            raise ValueError(f"reserve_validations must be >= 0, got {reserve_validations}")
        if held_back_seconds < 0:
            raise ValueError(f"held_back_seconds must be >= 0, got {held_back_seconds}")
        if reserve_choices < 0:
            raise ValueError(f"reserve_choices must be >= 0, got {reserve_choices}")
        self.minutes = minutes
        self.spent_seconds = spent_seconds
        self.clock = clock
        self.reserve_validations = reserve_validations
        self.held_back_seconds = held_back_seconds
        self.reserve_choices = reserve_choices
        """Seconds of the reserve besides the validations' (fine-tuning's choices, measured before training)."""
        """Seconds left to the stage's work after training on top of the validations' reserve (fine-tuning's
        chains), not counted in :attr:`reserve_seconds`."""
        self.planned_epochs: int | None = None
        self.stopped = False
        self.validation_seconds = 0.0
        """The longest validation epoch so far (seconds)."""
        self._started: float | None = None
        self._validation_started: float | None = None
        self._resumed_seconds = 0.0
        """Training seconds of the run this one resumed (from its checkpoint)."""

    @property
    def reserve_seconds(self) -> float:
        """The time held back for the stage's work after training: ``reserve_validations`` x the longest
        validation epoch so far (0 before the first), plus ``reserve_choices``."""
        return self.reserve_validations * self.validation_seconds + self.reserve_choices

    @property
    def seconds(self) -> float:
        """The budget left for training: ``minutes`` less what the stage spent before training, the reserve and
        the seconds held back."""
        return self.minutes * 60.0 - self.spent_seconds - self.reserve_seconds - self.held_back_seconds

    def elapsed(self) -> float:
        """Seconds of training so far, the resumed run's included; 0 before training starts."""
        now = self.clock() - self._started if self._started is not None else 0.0
        return self._resumed_seconds + now

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._started = self.clock()
        if self.planned_epochs is None:
            self.planned_epochs = trainer.max_epochs
        if self.seconds <= 0:
            log.warning(
                "time budget: %.1f of %.1f minutes were spent before training; training runs one epoch",
                self.spent_seconds / 60,
                self.minutes,
            )

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._validation_started = self.clock()

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._validation_started is not None and not trainer.sanity_checking:
            self.validation_seconds = max(self.validation_seconds, self.clock() - self._validation_started)
        self._validation_started = None

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        done = trainer.current_epoch + 1  # epochs finished, this one (and a resumed run's) included
        fit = int(trainer.strategy.broadcast(epochs_that_fit(self.elapsed(), self.seconds, done), src=0))
        planned = self.planned_epochs if self.planned_epochs is not None and self.planned_epochs >= 0 else None
        if planned is not None and done >= planned:
            if planned != trainer.max_epochs:  # the shortened schedule has ended: its learning rate is 0
                self._stop(trainer, done, "the shortened learning-rate schedule has ended")
            return
        if fit == 0:
            self._stop(trainer, done, "another epoch would pass the budget")
            return
        batches = int(trainer.num_training_batches)  # per epoch; finite for our map-style loaders
        if (planned is None or done + fit < planned) and shorten_schedules(trainer, (done + fit) * batches):
            self.planned_epochs = done + fit
            log.warning(
                "time budget: %d epochs fit in %g minutes at %.0f s per epoch; the learning-rate schedule now "
                "ends at epoch %d of %s (trainer.max_minutes)",
                done + fit,
                self.minutes,
                self.elapsed() / done,
                done + fit,
                trainer.max_epochs,
            )

    def _stop(self, trainer: pl.Trainer, done: int, why: str) -> None:
        self.stopped = trainer.should_stop = True
        log.warning(
            "time budget: stopping after epoch %d of %s: %s (trainer.max_minutes=%g)",
            done,
            trainer.max_epochs,
            why,
            self.minutes,
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "elapsed": self.elapsed(),
            "planned_epochs": self.planned_epochs,
            "stopped": self.stopped,
            "validation_seconds": self.validation_seconds,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resumed_seconds = float(state_dict.get("elapsed", 0.0))
        self.planned_epochs = state_dict.get("planned_epochs")
        self.stopped = bool(state_dict.get("stopped", False))
        self.validation_seconds = float(state_dict.get("validation_seconds", 0.0))

    def report(self) -> dict[str, Any]:
        """What ``metrics.json`` records about the budget."""
        return {
            "time_budget_minutes": self.minutes,
            "time_budget_planned_epochs": self.planned_epochs,
            "time_budget_stopped": self.stopped,
            "time_budget_reserved_seconds": round(self.reserve_seconds, 1),
            "time_budget_choices_seconds": round(self.reserve_choices, 1),
            "time_budget_held_back_seconds": round(self.held_back_seconds, 1),
        }


def epochs_that_fit(elapsed: float, budget: float, done: int) -> int:
    """How many more epochs of the mean length so far fit in what is left of ``budget`` (seconds).

    >>> epochs_that_fit(elapsed=120.0, budget=600.0, done=2)  # 60 s per epoch, 480 s left
    8
    >>> epochs_that_fit(elapsed=590.0, budget=600.0, done=10)
    0
    """
    if done <= 0 or elapsed <= 0:
        return 0 if budget <= elapsed else 1
    per_epoch = elapsed / done
    return max(0, math.floor((budget - elapsed) / per_epoch))


def shorten_schedules(trainer: pl.Trainer, total_steps: int) -> bool:
    """End every :class:`WarmupDecay` schedule of ``trainer`` at ``total_steps``; True when one changed."""
    changed = False
    for config in trainer.lr_scheduler_configs:
        for factor in {id(f): f for f in getattr(config.scheduler, "lr_lambdas", [])}.values():
            if isinstance(factor, WarmupDecay):
                changed |= factor.shorten(total_steps)
    return changed
