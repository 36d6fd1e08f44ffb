"""Per-label attention over every code recorded so far, weighed by how long ago it was recorded.

What a clinician (and a gradient-boosted model on time features) reads off a history is, per diagnosis:
was it ever recorded, how often, how many visits and how many days ago it last was, how long ago it first
was. A pooled summary of the whole history has to squeeze all of that, for every code at once, into one
vector; a mean over ``n`` tokens dilutes a single recorded code ``n`` times. Here each label ``l`` has its
own learned query that scores every code token ``t`` of the history, and the score carries a learned,
label-specific function of the time elapsed between ``t`` and the scored visit:

    score(l, t) = q_l . K h_t / sqrt(k) + a_l . e(t)
    vote(l, t)  = u_l . h_t + c_l . e(t)
    logit_l    += sum_heads [ softmax_t'(sink_l, score(l, t')) . (v_sink_l, vote(l, t')) ]

with ``e(t)`` learned features of ``log(1 + days since t)`` and ``log(1 + visits since t)``. The softmax
picks out the tokens relevant to ``l`` (typically ``l`` itself and what predicts it); the time bias lets each
label prefer recent or old records; a learned *sink* takes the weight when nothing relevant was recorded,
so the mass on real tokens grows with how often they were recorded. The same mechanism as CAML/LAAT's
label-wise attention (Mullenbach et al. 2018; Vu et al. 2020) with time in the scores, as in time-aware
attention for EHRs (e.g. Bai et al. 2018).

The keys are contextual encoder states, not hand-made features: with the wide path switched off the model
still learns presence, counts and recency from the tokens and their times. The cost is ``N L T nh`` for
``N`` scored visits, ``L`` labels, ``T`` tokens and ``nh`` heads, computed in chunks of scored visits to
bound memory.

Shapes: ``B`` patients, ``T`` tokens, ``N`` scored positions, ``L`` labels, ``nh`` heads, ``k`` key size,
``E`` elapsed-time features.
"""

from __future__ import annotations

import torch
from torch import nn

from behrt_rope.model.config import ModelConfig
from behrt_rope.model.encoder import DAYS_PER_YEAR, INIT_STD
from behrt_rope.schema import N_SPECIAL

KEY_SIZE = 16
"""Size of each head's label queries and token keys: a query only has to pick out a few codes."""
ELAPSED_SIZE = 16
"""Width of the learned features of the time elapsed since a token was recorded."""
CHUNK_SCORES = 4_000_000
"""Most ``N x nh x L x T`` scores computed at once; larger batches are split over scored positions."""


class TokenLabelAttention(nn.Module):
    """Hidden states of a visit-causal pass -> one extra logit per label at each scored [SEP]."""

    def __init__(self, config: ModelConfig, num_labels: int) -> None:
        super().__init__()
        nh, k, E = config.label_attention_heads, KEY_SIZE, ELAPSED_SIZE
        self.num_heads, self.num_labels = nh, num_labels
        self.query = nn.Parameter(torch.randn(nh, num_labels, k) * INIT_STD)
        self.key = nn.Linear(config.hidden_size, nh * k)
        self.sink_key = nn.Parameter(torch.zeros(nh, k))
        self.elapsed = nn.Sequential(nn.Linear(2, E), nn.GELU())
        self.time_bias = nn.Parameter(torch.zeros(nh, num_labels, E))
        # Votes start at zero, so the path starts silent and the rest of the model is undisturbed.
        self.value = nn.Linear(config.hidden_size, nh * num_labels, bias=False)
        self.time_value = nn.Parameter(torch.zeros(E, nh, num_labels))
        self.sink_value = nn.Parameter(torch.zeros(nh, num_labels))
        nn.init.normal_(self.key.weight, std=INIT_STD)
        nn.init.zeros_(self.key.bias)
        nn.init.zeros_(self.value.weight)

    def forward(
        self,
        hidden: torch.Tensor,
        token_ids: torch.Tensor,
        visit_index: torch.Tensor,
        ages: torch.Tensor,
        score_at: torch.Tensor,
    ) -> torch.Tensor:
        """Per-label logits at the scored positions.

        Args:
            hidden: ``(B, T, H)`` states of a visit-causal encoder pass.
            token_ids: ``(B, T)`` long ids; only code tokens (not [CLS], [SEP], [PAD]) are keys.
            visit_index: ``(B, T)`` long visit numbers.
            ages: ``(B, T)`` float ages in years.
            score_at: ``(B, T)`` bool, the ``N`` [SEP] positions to score.

        Returns:
            ``(N, L)`` logits, rows in row-major order of ``score_at``.
        """
        B, T, _ = hidden.shape
        nh, L = self.num_heads, self.num_labels
        rows, cols = score_at.nonzero(as_tuple=True)  # (N,), (N,)
        keys = self.key(hidden).view(B, T, nh, KEY_SIZE)  # (B, T, nh, k)
        # What does not depend on the scored visit is computed once per patient, laid out (B, nh, L, T) like
        # the per-visit tensors, so the rest is elementwise work without permuted copies.
        match = torch.einsum("hlk,bthk->bhlt", self.query.to(hidden.dtype), keys) * KEY_SIZE**-0.5
        votes = self.value(hidden).view(B, T, nh, L).permute(0, 2, 3, 1).contiguous()  # (B, nh, L, T)
        is_code = token_ids >= N_SPECIAL  # (B, T)
        chunk = max(1, CHUNK_SCORES // max(1, nh * L * T))
        out = [
            self._score(match, votes, is_code, visit_index, ages, rows[s : s + chunk], cols[s : s + chunk])
            for s in range(0, len(rows), chunk)
        ]
        return torch.cat(out) if out else hidden.new_zeros(0, L)

    def _score(
        self,
        match: torch.Tensor,
        votes: torch.Tensor,
        is_code: torch.Tensor,
        visit_index: torch.Tensor,
        ages: torch.Tensor,
        rows: torch.Tensor,
        cols: torch.Tensor,
    ) -> torch.Tensor:
        """``(n, L)`` logits for ``n`` scored positions ``(rows, cols)``; ``match`` and ``votes`` are the
        per-patient query-key scores and token votes, ``(B, nh, L, T)``."""
        _, nh, L, T = match.shape
        dtype = votes.dtype
        position = torch.arange(T, device=votes.device)
        visible = is_code[rows] & (position[None, :] < cols[:, None])  # (n, T): codes up to the scored [SEP]
        days = ((ages[rows, cols][:, None] - ages[rows]) * DAYS_PER_YEAR).clamp(min=0.0)  # (n, T)
        visits = (visit_index[rows, cols][:, None] - visit_index[rows]).clamp(min=0).to(days.dtype)  # (n, T)
        e = self.elapsed(torch.stack([torch.log1p(days), torch.log1p(visits)], dim=-1).to(dtype))  # (n, T, E)
        # Time's share of the scores and of the votes in one matmul: (n, T, E) @ (E, 2 nh L) -> (n, 2 nh L, T).
        time_maps = torch.cat([self.time_bias.permute(2, 0, 1), self.time_value], dim=1).flatten(1).to(dtype)
        time_bias, time_votes = (e @ time_maps).transpose(1, 2).reshape(len(rows), 2, nh, L, T).unbind(1)
        scores = (match[rows] + time_bias).masked_fill(~visible[:, None, None, :], float("-inf"))  # (n, nh, L, T)
        sink = torch.einsum("hlk,hk->hl", self.query.to(dtype), self.sink_key.to(dtype)) * KEY_SIZE**-0.5  # (nh, L)
        sink = sink[None, :, :, None].expand(len(rows), -1, -1, 1)  # (n, nh, L, 1)
        weights = torch.softmax(torch.cat([sink, scores], dim=-1), dim=-1)  # (n, nh, L, 1 + T)
        from_tokens = (weights[..., 1:] * (votes[rows] + time_votes)).sum(-1)  # (n, nh, L)
        return (from_tokens + weights[..., 0] * self.sink_value.to(dtype)).sum(1)  # (n, L)
