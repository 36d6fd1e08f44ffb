"""The wide path of the fine-tuning head: linear in what the record shows, from the first step.

Wide & Deep (Cheng et al., 2016) adds to a deep model a linear model over sparse inputs, which learns
memorisable associations ("code X recorded -> label Y likely") at once, while the deep part learns what
generalises. Here the linear part reads, at each scored visit:

* every code's ``log(1 + n_v)``, ``n_v`` the number of visits that recorded it (a bag of codes: ``(L, V)``
  weights);
* with ``config.wide_time`` (the default), the time course of each label's *own* code (8 weights per label):
  its ``log(1 + n)``; ``sum_t exp(-visits since t / s_j)`` over its records ``t`` for three learned visit
  scales ``s_j`` (initially 0.7, 2 and 6 visits: recorded at the last visit, in the last few, long ago);
  ``sum_t exp(-days since t / d_j)`` for three learned day scales (initially 30, 180 and 1,000 days); and
  ``log(1 + years since it was first recorded)`` (0 when never): how long a condition has been present.

A diagnosis already on file is the strongest single predictor of itself, and how recently and for how long
it has been on file decides much of the rest; a linear path learns that shape in the first epoch and leaves
the encoder and the label attention the interactions, other codes' timing and order. The time course is
kept to the label's own code on purpose: the same 8 features for every (label, code) pair fitted 8x more
weights than samples allowed and lowered tuning macro AP (docs/benchmarks.md, "Settings study, session 6").
The scales are parameters learned with the rest; nothing is computed outside the model.

Shapes: ``B`` patients, ``T`` tokens, ``N`` scored positions, ``V`` vocabulary, ``L`` labels, ``F = 8``
time features, ``P`` (scored position, history token) pairs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn

from behrt_rope.model.encoder import DAYS_PER_YEAR
from behrt_rope.model.token_label_attention import label_id_tensor
from behrt_rope.schema import N_SPECIAL

VISIT_SCALES = (0.7, 2.0, 6.0)
"""Initial visit scales of the recency features, in visits."""
DAY_SCALES = (30.0, 180.0, 1000.0)
"""Initial day scales of the recency features, in days."""
TIME_FEATURES = 2 + len(VISIT_SCALES) + len(DAY_SCALES)
"""Features of a label's own-code time course: count, 3 visit and 3 day recencies, years since first."""


class WidePath(nn.Module):
    """Per-code counts and each label's own-code time course at each scored position -> ``(N, L)`` logits."""

    DECAYED = ("weight", "own_weight")
    """Weight matrices that AdamW decays like a linear layer's (``training.optim.parameter_groups``)."""
    label_token_ids: torch.Tensor  # (L,) long buffer with time_aware: the token id of each label's code (-1: none)

    def __init__(
        self,
        vocab_size: int,
        num_labels: int,
        time_aware: bool = True,
        label_token_ids: Sequence[int] | torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.vocab_size, self.num_labels = vocab_size, num_labels
        # Zero start: the path begins silent and the rest of the model is undisturbed. ``weight`` has the shape
        # of the nn.Linear it replaced, so bundles saved before the time-aware features load unchanged.
        self.weight = nn.Parameter(torch.zeros(num_labels, vocab_size))
        self.own_weight: nn.Parameter | None = None
        self.log_visit_scale: nn.Parameter | None = None
        self.log_day_scale: nn.Parameter | None = None
        if time_aware:  # the label codes are part of the state dict: a trained model carries them
            self.register_buffer("label_token_ids", label_id_tensor(num_labels, label_token_ids))
            self.own_weight = nn.Parameter(torch.zeros(num_labels, TIME_FEATURES))
            self.log_visit_scale = nn.Parameter(torch.tensor([math.log(s) for s in VISIT_SCALES]))
            self.log_day_scale = nn.Parameter(torch.tensor([math.log(s) for s in DAY_SCALES]))

    def forward(
        self, token_ids: torch.Tensor, visit_index: torch.Tensor, ages: torch.Tensor, score_at: torch.Tensor
    ) -> torch.Tensor:
        """``(B, T)`` ids, visit numbers, ages in years and the scored [SEP] mask -> ``(N, L)`` float32 logits
        (rows in row-major order of ``score_at``)."""
        pairs = history_pairs(token_ids, score_at)
        ones = torch.ones(len(pairs.code), device=token_ids.device)
        counts = torch.zeros(pairs.n * self.vocab_size, device=token_ids.device)
        counts = counts.index_add(0, pairs.sample * self.vocab_size + pairs.code, ones)  # (N V,)
        logits = torch.log1p(counts).view(pairs.n, self.vocab_size) @ self.weight.float().T  # (N, L)
        if self.own_weight is None:
            return logits
        own = self.own_code_features(pairs, visit_index, ages)  # (N, L, F)
        return logits + (own * self.own_weight.float()).sum(-1)

    def own_code_features(self, pairs: HistoryPairs, visit_index: torch.Tensor, ages: torch.Tensor) -> torch.Tensor:
        """``(N, L, F)`` float32: the time course of each label's own code at each scored position."""
        assert self.log_visit_scale is not None and self.log_day_scale is not None
        pairs, label = pairs.of_labels(self.label_token_ids)
        visits, days = pairs.visits(visit_index), pairs.days(ages)  # (P',), (P',)
        slot = pairs.sample * self.num_labels + label  # (P',) flat (scored position, label) index
        per_pair = torch.cat(
            [
                torch.ones_like(days)[:, None],
                torch.exp(-visits[:, None] / self.log_visit_scale.exp()),
                torch.exp(-days[:, None] / self.log_day_scale.exp()),
            ],
            dim=1,
        )  # (P', 7)
        size = pairs.n * self.num_labels
        sums = torch.zeros(size, per_pair.shape[1], device=days.device).index_add(0, slot, per_pair)
        first = torch.zeros(size, device=days.device).scatter_reduce(0, slot, days, reduce="amax")
        features = [torch.log1p(sums[:, :1]), sums[:, 1:], torch.log1p(first / DAYS_PER_YEAR)[:, None]]
        return torch.cat(features, dim=1).view(pairs.n, self.num_labels, TIME_FEATURES)


class HistoryPairs(NamedTuple):
    """Every (scored position, code token in its history) pair of a batch; ``(P,)`` long tensors."""

    n: int
    """N, the number of scored positions."""
    sample: torch.Tensor
    """Which scored position (0..N-1)."""
    patient: torch.Tensor
    """Its batch row."""
    scored: torch.Tensor
    """The scored [SEP]'s position in the row."""
    position: torch.Tensor
    """The history token's position in the row."""
    code: torch.Tensor
    """The history token's id."""

    def subset(self, keep: torch.Tensor) -> HistoryPairs:
        return HistoryPairs(self.n, *(t[keep] for t in self[1:]))

    def of_labels(self, label_token_ids: torch.Tensor) -> tuple[HistoryPairs, torch.Tensor]:
        """The pairs whose code is a label's (``label_token_ids`` ``(L,)``, -1: none), and that label
        ``(P',)``."""
        ids = label_token_ids
        size = max(int(self.code.max()) if len(self.code) else 0, int(ids.max()) if len(ids) else 0) + 1
        label_of_code = torch.full((size,), -1, dtype=torch.long, device=self.code.device)
        known = ids >= 0
        label_of_code[ids[known]] = torch.arange(len(ids), device=self.code.device)[known]
        label = label_of_code[self.code]  # (P,)
        keep = label >= 0
        return self.subset(keep), label[keep]

    def visits(self, visit_index: torch.Tensor) -> torch.Tensor:
        """``(P,)`` float32 visits from each token's visit to the scored one."""
        gap = visit_index[self.patient, self.scored] - visit_index[self.patient, self.position]
        return gap.float().clamp(min=0.0)

    def days(self, ages: torch.Tensor) -> torch.Tensor:
        """``(P,)`` float32 days from each token's visit to the scored one."""
        gap = ages[self.patient, self.scored].float() - ages[self.patient, self.position].float()
        return (gap * DAYS_PER_YEAR).clamp(min=0.0)


def history_pairs(token_ids: torch.Tensor, score_at: torch.Tensor) -> HistoryPairs:
    """The stream is ordered by visit, so the history of the [SEP] at position ``p`` is the row's code tokens
    at positions ``<= p``."""
    rows, positions = score_at.nonzero(as_tuple=True)  # (N,), (N,)
    tokens = token_ids[rows]  # (N, T)
    T = token_ids.shape[1]
    in_history = (torch.arange(T, device=token_ids.device)[None, :] <= positions[:, None]) & (tokens >= N_SPECIAL)
    sample, position = in_history.nonzero(as_tuple=True)  # (P,), (P,)
    return HistoryPairs(len(rows), sample, rows[sample], positions[sample], position, tokens[sample, position])
