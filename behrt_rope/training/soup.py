"""A uniform weight soup of the best validation checks: one model, the average of the k best epochs' weights.

Fine-tuning picks the epoch with the best tuning value (``finetune``'s ``select_by``: loss by default). On a
small tuning split that pick is noisy and the epochs around it are about as good, so averaging their *weights*
(a "model soup", Wortsman et al. 2022; the epochs share one run, hence one basin) gives one model, at no extra
scoring cost, that is usually better than any of them. :class:`TopChecksSoup` keeps CPU copies of the weights
at the ``k`` best checks; ``finetune`` validates their average and keeps it only when it scores at least as
well as the best single check.

Integer buffers (label-code ids) are taken from the best check, not averaged; the frozen sparse time path's
float buffers are equal in every check, so their average is themselves.
"""

from __future__ import annotations

import logging
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.trainer.states import TrainerFn

log = logging.getLogger(__name__)

State = dict[str, torch.Tensor]


def average_states(states: list[State]) -> State:
    """The uniform average of ``states`` (same keys): floating tensors averaged in float32 then cast back,
    the others taken from the first state.

    >>> a = {"w": torch.tensor([1.0, 3.0]), "i": torch.tensor([7])}
    >>> b = {"w": torch.tensor([3.0, 5.0]), "i": torch.tensor([9])}
    >>> out = average_states([a, b]); out["w"].tolist(), out["i"].tolist()
    ([2.0, 4.0], [7])
    """
    if not states:
        raise ValueError("average_states needs at least one state")
    first = states[0]
    if any(s.keys() != first.keys() for s in states[1:]):
        raise ValueError("the states to average must have the same keys")
    out: State = {}
    for name, value in first.items():
        if value.is_floating_point():
            total = torch.stack([s[name].float() for s in states]).mean(dim=0)
            out[name] = total.to(value.dtype)
        else:
            out[name] = value.clone()
    return out


class TopChecksSoup(pl.Callback):
    """Keeps the weights (on the CPU) of the ``k`` validation checks with the best ``monitor`` value.

    ``checks`` is ``[(score, epoch, state)]``, best first. Saved in and restored from checkpoints, so a resumed
    run soups over all its checks. Only checks made while fitting count (not sanity checks, not a later
    ``trainer.validate``), and only those with the metric."""

    def __init__(self, k: int, monitor: str = "val/macro_ap", mode: str = "max") -> None:
        if k < 1:
            raise ValueError(f"the soup needs k >= 1 checks, got {k}")
        if mode not in ("max", "min"):
            raise ValueError(f"mode must be 'max' or 'min', got {mode!r}")
        self.k, self.monitor, self.mode = k, monitor, mode
        self.checks: list[tuple[float, int, State]] = []

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        fitting = trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking
        if not fitting or self.monitor not in trainer.callback_metrics:
            return
        score = float(trainer.callback_metrics[self.monitor])
        if score != score:  # NaN: no label could be scored
            return
        state = {name: value.detach().to("cpu", copy=True) for name, value in pl_module.state_dict().items()}
        self.checks.append((score, int(trainer.current_epoch), state))
        self.checks.sort(key=lambda check: check[0], reverse=self.mode == "max")
        del self.checks[self.k :]

    def no_worse_than_best(self, score: float) -> bool:
        """Whether ``score`` (of the same monitor) is at least as good as the best kept check's, by ``mode``."""
        best = self.checks[0][0]
        return score >= best if self.mode == "max" else score <= best

    def soup(self) -> State:
        """The average of the kept checks' weights (the task's state-dict keys)."""
        return average_states([state for _, _, state in self.checks])

    @property
    def epochs(self) -> list[int]:
        """The kept checks' epochs (0-based), best first."""
        return [epoch for _, epoch, _ in self.checks]

    def state_dict(self) -> dict[str, Any]:
        return {"checks": [{"score": s, "epoch": e, "state": st} for s, e, st in self.checks]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.checks = [(c["score"], c["epoch"], c["state"]) for c in state_dict.get("checks", [])]
