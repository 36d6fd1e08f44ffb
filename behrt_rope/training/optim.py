"""AdamW with decoupled weight decay on weight matrices only, and a warm-up-then-decay schedule."""

from __future__ import annotations

import math

import torch

from behrt_rope.training.config import TrainerConfig


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay 2-D weights (linear layers); leave biases, norms and Time2Vec's scalars alone."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        is_matrix = param.ndim >= 2 and "embedding" not in name.lower()
        (decay if is_matrix else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lr_factor(step: int, total: int, warmup: int, schedule: str) -> float:
    """Multiplier of the peak learning rate at ``step``: linear warm-up, then linear or cosine decay to 0.

    >>> [round(lr_factor(s, 10, 2, "linear"), 3) for s in (0, 1, 2, 6, 10)]
    [0.5, 1.0, 1.0, 0.5, 0.0]
    """
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0 - progress


def build_optimizer(
    model: torch.nn.Module, cfg: TrainerConfig, total_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """The optimizer and a per-step scheduler for ``total_steps`` optimizer steps."""
    optimizer = torch.optim.AdamW(parameter_groups(model, cfg.weight_decay), lr=cfg.learning_rate)
    warmup = max(1, int(cfg.warmup_fraction * total_steps))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps, warmup, cfg.schedule)
    )
    return optimizer, scheduler
