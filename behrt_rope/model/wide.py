"""The wide path of the fine-tuning head: a linear map from what each code's record looks like over time.

Wide & Deep (Cheng et al., 2016) adds to a deep model a linear model over sparse inputs, which learns
memorisable associations ("code X recorded -> label Y likely") from the first step, while the deep part
learns what generalises. For visit histories the sparse input is each code's record up to the scored visit.
In its plain form (``config.wide_time=false``) that is ``log(1 + count)`` of each code, a bag of codes. In
its time-aware form (the default) each code ``v`` is described by

* ``log(1 + n_v)``, the number of visits that recorded it;
* ``sum_t exp(-visits since t / s_j)`` over its records ``t``, for three learned visit scales ``s_j``
  (initially 0.7, 2 and 6 visits): recorded at the last visit, in the last few, long ago;
* ``sum_t exp(-days since t / d_j)``, for three learned day scales ``d_j`` (initially 30, 180, 1,000 days);
* ``log(1 + years since it was first recorded)`` (0 when never): how long a condition has been present.

so a label's logit can rise or fall with how recently, how often and for how long each code was recorded,
linearly in these 8 features per code. The scales are parameters, learned with the rest; nothing here is
computed outside the model or specific to a cohort, and the encoder's own path does not read these features.

Shapes: ``B`` patients, ``T`` tokens, ``N`` scored positions, ``V`` vocabulary, ``L`` labels,
``F`` features per code (8, or 1 in the plain form), ``P`` (scored position, history token) pairs.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from behrt_rope.schema import N_SPECIAL

DAYS_PER_YEAR = 365.25
VISIT_SCALES = (0.7, 2.0, 6.0)
"""Initial visit scales of the recency features, in visits."""
DAY_SCALES = (30.0, 180.0, 1000.0)
"""Initial day scales of the recency features, in days."""


class WidePath(nn.Module):
    """``(N, V, F)`` per-code record features at each scored position -> ``(N, L)`` logits, linearly."""

    def __init__(self, vocab_size: int, num_labels: int, time_aware: bool = True) -> None:
        super().__init__()
        self.vocab_size, self.time_aware = vocab_size, time_aware
        self.num_features = 2 + len(VISIT_SCALES) + len(DAY_SCALES) if time_aware else 1
        # Zero start: the path begins silent and the rest of the model is undisturbed. The weight of the
        # plain form is (L, V), the shape of the nn.Linear it replaced, so earlier bundles load unchanged.
        self.weight = nn.Parameter(torch.zeros(num_labels, vocab_size * self.num_features))
        self.log_visit_scale: nn.Parameter | None = None
        self.log_day_scale: nn.Parameter | None = None
        if time_aware:
            self.log_visit_scale = nn.Parameter(torch.tensor([math.log(s) for s in VISIT_SCALES]))
            self.log_day_scale = nn.Parameter(torch.tensor([math.log(s) for s in DAY_SCALES]))

    def forward(
        self, token_ids: torch.Tensor, visit_index: torch.Tensor, ages: torch.Tensor, score_at: torch.Tensor
    ) -> torch.Tensor:
        """``(B, T)`` ids, visit numbers, ages in years and the scored [SEP] mask -> ``(N, L)`` logits
        (rows in row-major order of ``score_at``)."""
        features = self.features(token_ids, visit_index, ages, score_at)  # (N, V, F)
        return features.flatten(1).to(self.weight.dtype) @ self.weight.T  # (N, L)

    def features(
        self, token_ids: torch.Tensor, visit_index: torch.Tensor, ages: torch.Tensor, score_at: torch.Tensor
    ) -> torch.Tensor:
        """``(N, V, F)`` float32 features of every code at each scored position (module docstring).

        The stream is ordered by visit, so the history of the [SEP] at position ``p`` is the row's code
        tokens at positions ``<= p``; each (scored position, history token) pair adds to its code's sums.
        """
        rows, positions = score_at.nonzero(as_tuple=True)  # (N,), (N,)
        n, T, V = len(rows), token_ids.shape[1], self.vocab_size
        tokens = token_ids[rows]  # (N, T)
        in_history = (torch.arange(T, device=token_ids.device)[None, :] <= positions[:, None]) & (tokens >= N_SPECIAL)
        sample, position = in_history.nonzero(as_tuple=True)  # (P,), (P,)
        code = tokens[sample, position]  # (P,)
        slot = sample * V + code  # (P,) flat (scored position, code) index
        ones = torch.ones(len(slot), device=token_ids.device)
        counts = torch.zeros(n * V, device=token_ids.device).index_add(0, slot, ones)  # (N V,)
        if not self.time_aware:
            return torch.log1p(counts).view(n, V, 1)
        assert self.log_visit_scale is not None and self.log_day_scale is not None
        patient = rows[sample]  # (P,)
        visits = (visit_index[rows, positions][sample] - visit_index[patient, position]).float().clamp(min=0.0)
        days = ((ages[rows, positions][sample] - ages[patient, position]).float() * DAYS_PER_YEAR).clamp(min=0.0)
        decay = torch.cat(
            [
                torch.exp(-visits[:, None] / self.log_visit_scale.exp()),
                torch.exp(-days[:, None] / self.log_day_scale.exp()),
            ],
            dim=1,
        )  # (P, 6)
        sums = torch.zeros(n * V, decay.shape[1], device=decay.device, dtype=decay.dtype).index_add(0, slot, decay)
        first = torch.zeros(n * V, device=days.device).scatter_reduce(0, slot, days, reduce="amax")  # (N V,)
        parts = [torch.log1p(counts)[:, None], sums, torch.log1p(first / DAYS_PER_YEAR)[:, None]]
        return torch.cat(parts, dim=1).view(n, V, self.num_features)
