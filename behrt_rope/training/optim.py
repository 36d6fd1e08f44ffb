"""AdamW with decoupled weight decay on weight matrices only, and a warm-up-then-decay schedule."""

from __future__ import annotations

import math

import torch

from behrt_rope.training.config import TrainerConfig


def parameter_groups(
    model: torch.nn.Module,
    weight_decay: float,
    lr: float = 1e-3,
    lr_scales: dict[str, float] | None = None,
    other_scale: float = 1.0,
) -> list[dict]:
    """Decay the weight matrices of linear layers (and those a module lists in ``DECAYED``) only; leave
    biases, LayerNorms, embedding tables (the code embedding doubles as the tied MLM decoder) and Time2Vec's
    frequencies and phases alone.

    Chosen by module type, not by parameter name: a name test such as ``"embedding" in name`` would also
    exempt the Time2Vec projection, a linear layer that lives under ``embeddings``.

    ``lr_scales`` maps a submodule name (e.g. ``"wide"``) to a learning-rate multiplier for its parameters:
    a zero-initialised linear readout of code counts needs weights of order 1, far beyond what Adam's
    ~``lr``-sized steps reach in a few hundred steps at the encoder's rate. Parameters under none of those
    submodules get ``other_scale``.

    >>> groups = parameter_groups(torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.LayerNorm(3)), 0.1)
    >>> [[tuple(p.shape) for p in g["params"]] for g in groups]
    [[(3, 2)], [(3,), (3,), (3,)]]
    """
    linear_weights = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    # Modules whose weight matrices are bare parameters name them in DECAYED (e.g. the wide path).
    linear_weights |= {
        id(p) for m in model.modules() for n in getattr(m, "DECAYED", ()) if (p := getattr(m, n)) is not None
    }
    scale_of = {}
    for name, module in model.named_modules():
        scale = (lr_scales or {}).get(name.rsplit(".", 1)[-1])
        if scale is not None:
            scale_of.update({id(p): scale for p in module.parameters()})
    groups: dict[tuple[bool, float], list[torch.nn.Parameter]] = {}
    for param in model.parameters():  # each parameter once, even when shared (tied)
        if param.requires_grad:
            key = (id(param) in linear_weights, scale_of.get(id(param), other_scale))
            groups.setdefault(key, []).append(param)
    ordered = sorted(groups.items(), key=lambda item: (not item[0][0], item[0][1]))
    return [
        {"params": params, "weight_decay": weight_decay if decays else 0.0, "lr": lr * scale}
        for (decays, scale), params in ordered
    ]


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


class WarmupDecay:
    """The schedule as a ``LambdaLR`` multiplier whose length can be shortened while training runs.

    A time budget (``training.time_budget``) that finds fewer epochs fit than ``max_epochs`` ends the decay at
    the last epoch that fits, rather than stopping a run whose learning rate is still high. An object, not a
    closure, so that ``LambdaLR.state_dict`` saves ``total`` and a resumed run keeps the shortened schedule.

    >>> f = WarmupDecay(total=10, warmup=2, schedule="linear")
    >>> f.shorten(6), [round(f(s), 2) for s in (2, 4, 6)]
    (True, [1.0, 0.5, 0.0])
    >>> f.shorten(8), f.total
    (False, 6)
    """

    def __init__(self, total: int, warmup: int, schedule: str) -> None:
        self.total, self.warmup, self.schedule = total, warmup, schedule

    def __call__(self, step: int) -> float:
        return lr_factor(step, self.total, self.warmup, self.schedule)

    def shorten(self, total: int) -> bool:
        """End the decay at optimizer step ``total`` if that is sooner than now; True when it changed."""
        total = max(1, int(total))
        if total >= self.total:
            return False
        self.total = total
        return True


def build_optimizer(
    model: torch.nn.Module, cfg: TrainerConfig, total_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """The optimizer and a per-step scheduler for ``total_steps`` optimizer steps."""
    scales = {"wide": cfg.wide_lr_scale, "state_filter": cfg.state_filter_lr_scale, "encoder": cfg.encoder_lr_scale}
    groups = parameter_groups(model, cfg.weight_decay, cfg.learning_rate, scales, cfg.head_lr_scale)
    optimizer = torch.optim.AdamW(groups, lr=cfg.learning_rate)
    warmup = max(1, int(cfg.warmup_fraction * total_steps))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupDecay(total_steps, warmup, cfg.schedule))
    return optimizer, scheduler
