"""Early stopping whose patience grows with the epoch of the best result so far.

A fixed patience fits one learning curve: curves that peak early (large label spaces, short histories) waste
most of a run after their best epoch, while slowly rising curves with noisy tuning metrics (a few hundred
tuning patients) stop on a plateau they would have left. With ``ratio`` r, the run stops after
``max(patience, ceil(r x b))`` validation checks without improvement, where ``b`` is the number of checks up
to and including the best one: at r = 1 a run stops once it has gone twice as far as its best check (and at
least ``patience`` checks past it). r = 0 is Lightning's fixed patience, unchanged.

Only *when* the run stops changes: the checkpoint kept is still the best one, and the learning-rate schedule
still runs to ``max_epochs``, so a run that stops early keeps exactly the model the full run would have kept
whenever its best check came before the stop.

>>> stop = GrowingPatienceEarlyStopping(monitor="val/macro_ap", mode="max", patience=5, ratio=1.0)
>>> [stop.patience_after(best) for best in (1, 4, 9, 15)]
[5, 5, 9, 15]
"""

from __future__ import annotations

import math
from typing import Any

import torch
from pytorch_lightning.callbacks import EarlyStopping
from torch import Tensor


class GrowingPatienceEarlyStopping(EarlyStopping):
    """Lightning's :class:`EarlyStopping` with ``patience = max(patience, ceil(ratio x checks to the best))``."""

    def __init__(self, *, monitor: str, mode: str, patience: int, ratio: float = 0.0) -> None:
        if ratio < 0:
            raise ValueError("the patience ratio must be >= 0")
        super().__init__(monitor=monitor, mode=mode, patience=patience, strict=False)
        self.min_patience = patience
        self.ratio = ratio
        self.checks = 0
        """Validation checks seen (each with the monitored metric)."""
        self.best_check = 0
        """1-based number of the check with the best value so far (0 before the first)."""

    def patience_after(self, best_check: int) -> int:
        """Checks without improvement allowed when the best value came at check ``best_check`` (1-based)."""
        return max(self.min_patience, math.ceil(self.ratio * best_check))

    def check(self, value: float) -> bool:
        """One validation check outside a Trainer (e.g. replaying a logged curve): True when the run would stop."""
        return self._evaluate_stopping_criteria(torch.as_tensor(float(value)))[0]

    def _evaluate_stopping_criteria(self, current: Tensor) -> tuple[bool, str | None]:
        self.checks += 1
        self.patience = self.patience_after(self.best_check)
        should_stop, reason = super()._evaluate_stopping_criteria(current)
        if self.wait_count == 0 and not should_stop:
            self.best_check = self.checks
        return should_stop, reason

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "checks": self.checks, "best_check": self.best_check}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.checks = int(state_dict.get("checks", 0))
        self.best_check = int(state_dict.get("best_check", 0))
