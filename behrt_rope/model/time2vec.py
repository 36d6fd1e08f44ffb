"""Time2Vec embedding of age (Kazemi et al., "Time2Vec: Learning a Vector Representation of Time", 2019).

BEHRT looked age up in a table of whole years; Time2Vec instead maps the continuous age ``t`` to ``k + 1``
features, one linear and ``k`` periodic with learned frequencies and phases::

    t2v(t)[0] = w0 * t + b0
    t2v(t)[i] = sin(wi * t + bi),  i = 1 .. k

and a linear layer projects them to the hidden size. For age, ``t`` is the age in years divided by
``config.age_scale`` (default 100), which keeps the linear feature near unit scale. The same map serves any
other time input given its own scale and frequency range (the visit gap, ``visit_gap.py``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from behrt_rope.model.config import ModelConfig


class Time2Vec(nn.Module):
    """A time ``(B, T)`` -> ``(B, T, hidden_size)`` through ``k + 1`` Time2Vec features of ``time / scale``.

    The features are computed in float32 with autocast disabled: under bf16 a periodic feature
    ``sin(w t + b)`` with ``w t`` in the hundreds would lose all its precision (see ``rope.py``). Only the
    projection runs in the autocast dtype.

    Initialisation: the ``k`` angular frequencies are spread geometrically from 1 (nearly linear over the
    scaled unit) to ``top_frequency`` radians per scaled unit, and the phases uniformly in ``[0, 2 pi)``, so
    the features start out resolving every time scale in between. :meth:`of_age` builds the age embedding.

    Args:
        periodic: k, the number of periodic features (plus one linear feature).
        hidden_size: the output width.
        scale: times are divided by this before the features (their units become "scaled units").
        top_frequency: the highest initial angular frequency, radians per scaled unit.
    """

    def __init__(self, periodic: int, hidden_size: int, scale: float, top_frequency: float) -> None:
        super().__init__()
        if periodic < 0:
            raise ValueError(f"time2vec_periodic must be >= 0, got {periodic}")
        if scale <= 0:
            raise ValueError(f"the Time2Vec scale (age_scale) must be positive, got {scale}")
        self.scale = scale
        self.top_frequency = top_frequency
        self.linear_weight = nn.Parameter(torch.empty(1))  # w0
        self.linear_bias = nn.Parameter(torch.empty(1))  # b0
        self.periodic_weight = nn.Parameter(torch.empty(periodic))  # w1 .. wk, radians per scaled unit
        self.periodic_bias = nn.Parameter(torch.empty(periodic))  # b1 .. bk, radians
        self.proj = nn.Linear(periodic + 1, hidden_size)
        self.reset_parameters()

    @classmethod
    def of_age(cls, config: ModelConfig) -> Time2Vec:
        """The age embedding: ages in years over ``config.age_scale``, periods from ``2 pi`` scaled units
        (longer than a lifetime) down to one year."""
        return cls(config.time2vec_periodic, config.hidden_size, config.age_scale, 2 * math.pi * config.age_scale)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise the Time2Vec weights (the projection is left to the model's initialisation)."""
        k = self.periodic_weight.numel()
        self.linear_weight.fill_(1.0)
        self.linear_bias.zero_()
        if k:
            self.periodic_weight.copy_(torch.exp(torch.linspace(0.0, math.log(self.top_frequency), k)))
            self.periodic_bias.uniform_(0.0, 2 * math.pi)

    def features(self, times: torch.Tensor) -> torch.Tensor:
        """The raw ``(B, T, k + 1)`` float32 Time2Vec features of ``times`` ``(B, T)`` (e.g. ages in years)."""
        with torch.autocast(device_type=times.device.type, enabled=False):
            t = (times.float() / self.scale)[..., None]  # (B, T, 1), scaled time
            linear = t * self.linear_weight.float() + self.linear_bias.float()  # (B, T, 1)
            periodic = torch.sin(t * self.periodic_weight.float() + self.periodic_bias.float())  # (B, T, k)
            return torch.cat((linear, periodic), dim=-1)  # (B, T, k + 1)

    def forward(self, times: torch.Tensor) -> torch.Tensor:
        """``times`` ``(B, T)`` -> ``(B, T, hidden_size)``."""
        features = self.features(times)  # (B, T, k + 1) float32
        # (B, T, H); the cast is a no-op unless the weights themselves were converted (e.g. to bf16)
        return self.proj(features.to(self.proj.weight.dtype))
