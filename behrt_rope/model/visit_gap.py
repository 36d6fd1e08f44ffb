"""An input embedding of the days between a token's visit and the visit before it.

A token's age says when it was recorded; how long the patient had been away before that visit is a
difference of two ages that attention would have to work out, at a resolution (days against a lifetime of
years) that Time2Vec's age features do not give. Yet it carries meaning in a record: a visit a week or two
after the last is usually a follow-up of what was recorded there, one after years away is a fresh start. So
each token also gets an embedding of ``log(1 + days since the previous visit)`` (zero with a first-visit
flag on the first visit and ``[CLS]``), added to its code, segment and age embeddings.

The log gap goes through its own :class:`~behrt_rope.model.time2vec.Time2Vec` (one linear and ``k`` periodic
features with learned frequencies and phases, then a linear map to the hidden size); the first-visit flag adds
a learned vector. Both start at zero, so an encoder gains the input without its first steps changing what it
computes.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from behrt_rope.model.config import ModelConfig
from behrt_rope.model.time2vec import Time2Vec
from behrt_rope.schema import SEP_ID

DAYS_PER_YEAR = 365.25
"""Days in a year of age (ages are in years)."""
LOG_GAP_SCALE = math.log1p(3650.0)
"""``log(1 + days)`` is divided by this (ten years' worth), so the linear feature stays near unit scale."""
GAP_PERIODIC = 8
"""Periodic features of the scaled log gap."""


def days_since_previous_visit(
    ages: torch.Tensor, visit_index: torch.Tensor, attention_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, the days between its visit and the one before, and whether its visit is the first.

    Args:
        ages: ``(B, T)`` float ages in years (every token of a visit at the visit's age).
        visit_index: ``(B, T)`` long 0-based visit numbers.
        attention_mask: ``(B, T)`` bool, True at real tokens.

    Returns:
        ``(B, T)`` float32 days (0 on a first visit and on padding) and ``(B, T)`` bool first-visit flags.

    >>> ages, visits = torch.tensor([[50.0, 50.0, 50.5, 50.5, 0.0]]), torch.tensor([[0, 0, 1, 1, 0]])
    >>> days, first = days_since_previous_visit(ages, visits, torch.tensor([[1, 1, 1, 1, 0]]).bool())
    >>> [round(d) for d in days[0].tolist()], first[0].tolist()
    ([0, 0, 183, 183, 0], [True, True, False, False, True])
    """
    B, T = ages.shape
    index = torch.where(attention_mask, visit_index, 0).clamp(0, T - 1)  # (B, T): at most T visits
    masked = torch.where(attention_mask, ages.float(), torch.full_like(ages, -torch.inf, dtype=torch.float32))
    visit_age = torch.full((B, T), -torch.inf, device=ages.device).scatter_reduce(
        1, index, masked, reduce="amax", include_self=True
    )  # (B, visits): the age of each visit
    gap = torch.zeros_like(visit_age)
    gap[:, 1:] = (visit_age[:, 1:] - visit_age[:, :-1]).clamp(min=0.0) * DAYS_PER_YEAR  # (B, visits)
    gap = torch.nan_to_num(gap, nan=0.0, posinf=0.0, neginf=0.0)  # visits that do not exist
    first = (index == 0) | ~attention_mask
    days = torch.where(first, 0.0, gap.gather(1, index))  # (B, T)
    return days, first


class VisitGapEmbedding(nn.Module):
    """``(B, T)`` days since the previous visit and first-visit flags -> ``(B, T, hidden_size)``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # frequencies from 1 to 2 pi * 4 over the scaled log gap (0 .. ~1.1): from near-linear to a few swings
        self.log_gap = Time2Vec(GAP_PERIODIC, config.hidden_size, scale=LOG_GAP_SCALE, top_frequency=8 * math.pi)
        self.first_visit = nn.Parameter(torch.zeros(config.hidden_size))  # added on first visits and [CLS]

    def reset_to_zero(self) -> None:
        """Start as no input at all (called after the encoder's initialisation)."""
        with torch.no_grad():
            self.log_gap.proj.weight.zero_()
            self.log_gap.proj.bias.zero_()
            self.first_visit.zero_()

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args, **kwargs) -> None:
        """Also load the first layout of this input (session 45: parameters ``freq``, ``phase`` and ``proj`` over
        ``[log gap, first-visit flag, k periodic]``), mapped exactly onto this one (linear feature at w0 = 1,
        b0 = 0; the flag's column becomes ``first_visit``)."""
        if prefix + "freq" in state_dict:
            weight = state_dict.pop(prefix + "proj.weight")  # (H, k + 2)
            state_dict[prefix + "log_gap.periodic_weight"] = state_dict.pop(prefix + "freq")
            state_dict[prefix + "log_gap.periodic_bias"] = state_dict.pop(prefix + "phase")
            state_dict[prefix + "log_gap.linear_weight"] = torch.ones(1, dtype=weight.dtype)
            state_dict[prefix + "log_gap.linear_bias"] = torch.zeros(1, dtype=weight.dtype)
            state_dict[prefix + "log_gap.proj.weight"] = torch.cat([weight[:, :1], weight[:, 2:]], dim=1)
            state_dict[prefix + "log_gap.proj.bias"] = state_dict.pop(prefix + "proj.bias")
            state_dict[prefix + "first_visit"] = weight[:, 1].clone()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, days: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` days and flags -> ``(B, T, H)``; the features in float32, the projection in any dtype."""
        gap = self.log_gap(torch.log1p(days.float()))  # (B, T, H)
        return gap + first[..., None].to(gap.dtype) * self.first_visit.to(gap.dtype)


def visit_ages(token_ids: torch.Tensor, visit_index: torch.Tensor, ages: torch.Tensor) -> torch.Tensor:
    """``(B, V)`` float32: each visit's age in years, read at its [SEP] (0 for visits a row does not have)."""
    visits = int(visit_index.max()) + 1 if visit_index.numel() else 1
    sep = token_ids == SEP_ID
    out = torch.zeros(len(token_ids), visits + 1, device=ages.device)
    column = torch.where(sep, visit_index, torch.full_like(visit_index, visits))  # non-[SEP] -> spare column
    return out.scatter(1, column, ages.float())[:, :visits]
