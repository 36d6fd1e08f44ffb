"""Time2Vec embedding of age (Kazemi et al., "Time2Vec: Learning a Vector Representation of Time", 2019).

BEHRT looked age up in a table of whole years; Time2Vec instead maps the continuous age ``t`` to ``k + 1``
features, one linear and ``k`` periodic with learned frequencies and phases::

    t2v(t)[0] = w0 * t + b0
    t2v(t)[i] = sin(wi * t + bi),  i = 1 .. k

and a linear layer projects them to the hidden size. ``t`` is the age in years divided by ``config.age_scale``
(default 100), which keeps the linear feature near unit scale.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from behrt_rope.model.config import ModelConfig


class Time2Vec(nn.Module):
    """Age in years ``(B, T)`` -> ``(B, T, hidden_size)`` through ``k + 1`` Time2Vec features.

    The features are computed in float32 with autocast disabled: under bf16 a periodic feature
    ``sin(w t + b)`` with ``w t`` in the hundreds would lose all its precision (see ``rope.py``). Only the
    projection runs in the autocast dtype.

    Initialisation: the ``k`` angular frequencies are spread geometrically from 1 (period ``2 pi`` scaled
    units, longer than a lifetime: nearly linear) to ``2 pi * age_scale`` (period one year), and the phases
    uniformly in ``[0, 2 pi)``, so the features start out resolving time scales from a lifetime to a year.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        k = config.time2vec_periodic
        if k < 0:
            raise ValueError(f"time2vec_periodic must be >= 0, got {k}")
        if config.age_scale <= 0:
            raise ValueError(f"age_scale must be positive, got {config.age_scale}")
        self.age_scale = config.age_scale
        self.linear_weight = nn.Parameter(torch.empty(1))  # w0
        self.linear_bias = nn.Parameter(torch.empty(1))  # b0
        self.periodic_weight = nn.Parameter(torch.empty(k))  # w1 .. wk, radians per scaled unit
        self.periodic_bias = nn.Parameter(torch.empty(k))  # b1 .. bk, radians
        self.proj = nn.Linear(k + 1, config.hidden_size)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise the Time2Vec weights (the projection is left to the model's initialisation)."""
        k = self.periodic_weight.numel()
        self.linear_weight.fill_(1.0)
        self.linear_bias.zero_()
        if k:
            top = math.log(2 * math.pi * self.age_scale)  # one-year period
            self.periodic_weight.copy_(torch.exp(torch.linspace(0.0, top, k)))
            self.periodic_bias.uniform_(0.0, 2 * math.pi)

    def features(self, ages: torch.Tensor) -> torch.Tensor:
        """The raw ``(B, T, k + 1)`` float32 Time2Vec features of ``ages`` ``(B, T)`` in years."""
        with torch.autocast(device_type=ages.device.type, enabled=False):
            t = (ages.float() / self.age_scale)[..., None]  # (B, T, 1), scaled age
            linear = t * self.linear_weight.float() + self.linear_bias.float()  # (B, T, 1)
            periodic = torch.sin(t * self.periodic_weight.float() + self.periodic_bias.float())  # (B, T, k)
            return torch.cat((linear, periodic), dim=-1)  # (B, T, k + 1)

    def forward(self, ages: torch.Tensor) -> torch.Tensor:
        """``ages`` ``(B, T)`` in years -> ``(B, T, hidden_size)``."""
        features = self.features(ages)  # (B, T, k + 1) float32
        # (B, T, H); the cast is a no-op unless the weights themselves were converted (e.g. to bf16)
        return self.proj(features.to(self.proj.weight.dtype))
