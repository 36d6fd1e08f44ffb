"""Per-label attention over a patient's history, with time-aware rotary positions.

One pooled vector for all labels makes the [SEP] state a bottleneck: it must say, for every code at once,
whether and how recently it was recorded. Label-wise attention (as in CAML, Mullenbach et al. 2018, and
LAAT, Vu et al. 2020, for clinical notes) gives each label its own learned query, which reads the encoder's
states of the visits up to the scored one. Here the query and the keys are also rotated (RoPE) by their
positions, so the score between label ``j`` and an earlier visit depends on how long before the scored visit
it happened: half the heads count visits, half count days (see ``encoder.rope_tables``). A learned *sink* key
with no position lets a label attend to nothing in particular when no visit is relevant, so "never recorded"
is representable rather than forced onto the least irrelevant visit.

Shapes: ``B`` patients, ``T`` tokens, ``V`` visits, ``N`` scored positions, ``L`` labels, ``nh`` heads with
queries and keys of size ``k``.
"""

from __future__ import annotations

import torch
from torch import nn

from behrt_rope.model.config import ModelConfig
from behrt_rope.model.encoder import DAYS_PER_YEAR, INIT_STD, rope_tables
from behrt_rope.model.rope import rotate

KEY_SIZE = 16
"""Size of each head's label queries and keys: small, since a query only has to pick out a few codes."""
ELAPSED_SIZE = 16
"""Width of the learned features of the time elapsed since a visit."""
VOTE_HIDDEN = 64
"""Hidden width of the map from a visit's state and elapsed time to its votes."""


class LabelAttention(nn.Module):
    """Hidden states of a visit-causal pass -> one logit per label at each scored [SEP].

    The keys are the visits, not the tokens: the [SEP] state of each earlier visit, which has attended to
    that visit's codes. So label ``j`` looks for the visits that recorded ``j`` (or what predicts it) and
    weighs them by how long ago they were. Each head's value of a visit is one number per label (the readout
    folded into the value projection), so the cost is ``N nh L V`` for ``N`` scored positions and ``V``
    visits: small next to the encoder.
    """

    def __init__(self, config: ModelConfig, num_labels: int) -> None:
        super().__init__()
        self.config = config
        self.num_heads = config.label_attention_heads
        self.num_labels = num_labels
        self.age_heads = self.num_heads // 2
        self.query = nn.Parameter(torch.randn(self.num_heads, num_labels, KEY_SIZE) * INIT_STD)
        self.key = nn.Linear(config.hidden_size, self.num_heads * KEY_SIZE)
        self.sink_key = nn.Parameter(torch.zeros(self.num_heads, KEY_SIZE))
        # A visit's vote, per head and label, from its state and how long before the scored visit it was
        # (log days and log visits, through a small learned map): "recorded 3 weeks ago" and "recorded 3
        # years ago" can vote differently. The last layer starts at zero, so the path starts silent.
        self.elapsed = nn.Sequential(nn.Linear(2, ELAPSED_SIZE), nn.GELU())
        readout = nn.Linear(VOTE_HIDDEN, self.num_heads * num_labels)
        nn.init.zeros_(readout.weight)
        nn.init.zeros_(readout.bias)
        self.vote = nn.Sequential(nn.Linear(config.hidden_size + ELAPSED_SIZE, VOTE_HIDDEN), nn.GELU(), readout)
        self.sink_value = nn.Parameter(torch.zeros(self.num_heads, num_labels))

    def forward(
        self,
        hidden: torch.Tensor,
        visit_end: torch.Tensor,
        positions: torch.Tensor,
        ages: torch.Tensor,
        score_at: torch.Tensor,
    ) -> torch.Tensor:
        """Per-label logits at the scored positions.

        Args:
            hidden: ``(B, T, H)`` states of a visit-causal encoder pass.
            visit_end: ``(B, T)`` bool, the [SEP] that closes each visit (the keys).
            positions: ``(B, T)`` float visit positions (see ``encoder.positions_for``).
            ages: ``(B, T)`` float ages in years.
            score_at: ``(B, T)`` bool, the ``N`` positions to score (a subset of ``visit_end``).

        Returns:
            ``(N, L)`` logits, rows in row-major order of ``score_at``.
        """
        B, _, H = hidden.shape
        nh = self.num_heads
        rows, cols = score_at.nonzero(as_tuple=True)  # (N,), (N,)
        # Compact each patient's visit ends to the front: (B, V) positions, V = most visits in the batch.
        n_visits = visit_end.sum(1)  # (B,)
        V = max(int(n_visits.max()), 1)
        where = torch.argsort((~visit_end).to(torch.int8), dim=1, stable=True)[:, :V]  # (B, V)
        real = torch.arange(V, device=hidden.device)[None, :] < n_visits[:, None]  # (B, V)
        h_v = hidden.gather(1, where[..., None].expand(-1, -1, H))  # (B, V, H)
        cos, sin = rope_tables(
            self.config, positions.gather(1, where), ages.gather(1, where), nh, self.age_heads, KEY_SIZE
        )
        if cos.dim() == 3:  # every head on one source: (B, V, k/2) -> (B, nh, V, k/2)
            cos, sin = cos[:, None].expand(-1, nh, -1, -1), sin[:, None].expand(-1, nh, -1, -1)
        keys = rotate(self.key(h_v).view(B, V, nh, KEY_SIZE).transpose(1, 2), cos, sin)  # (B, nh, V, k)
        # The scored [SEP] closes the patient's k-th visit (compact index k): rotate the queries to its position.
        k = (visit_end.long().cumsum(1) - 1)[rows, cols]  # (N,)
        votes = self._votes(h_v[rows], ages.gather(1, where)[rows], ages[rows, cols], k)  # (N, V, nh, L)
        q_cos, q_sin = cos[rows, :, k][:, :, None], sin[rows, :, k][:, :, None]  # (N, nh, 1, k/2)
        queries = rotate(self.query.to(hidden.dtype), q_cos, q_sin)  # (N, nh, L, k)
        scale = KEY_SIZE**-0.5
        scores = torch.einsum("nhlk,nhvk->nhlv", queries, keys[rows]) * scale  # (N, nh, L, V)
        sink = torch.einsum("nhlk,hk->nhl", queries, self.sink_key.to(hidden.dtype)) * scale  # (N, nh, L)
        visible = real[rows] & (torch.arange(V, device=hidden.device)[None, :] <= k[:, None])  # (N, V)
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        weights = torch.softmax(torch.cat([sink[..., None], scores], dim=-1), dim=-1)  # (N, nh, L, 1 + V)
        from_history = torch.einsum("nhlv,nvhl->nl", weights[..., 1:], votes)  # (N, L)
        return from_history + (weights[..., 0] * self.sink_value.to(hidden.dtype)).sum(1)  # (N, L)

    def _votes(self, h: torch.Tensor, visit_ages: torch.Tensor, now: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """``(N, V, nh, L)`` votes of each scored position's visits: ``h`` ``(N, V, H)`` their states,
        ``visit_ages`` ``(N, V)`` and ``now`` ``(N,)`` ages in years, ``k`` ``(N,)`` the scored visit's index."""
        N, V, _ = h.shape
        days = ((now[:, None] - visit_ages) * DAYS_PER_YEAR).clamp(min=0.0)  # (N, V); later visits masked anyway
        visits = (k[:, None] - torch.arange(V, device=h.device)[None, :]).clamp(min=0).to(days.dtype)  # (N, V)
        elapsed = self.elapsed(torch.stack([torch.log1p(days), torch.log1p(visits)], dim=-1).to(h.dtype))
        return self.vote(torch.cat([h, elapsed], dim=-1)).view(N, V, self.num_heads, self.num_labels)
