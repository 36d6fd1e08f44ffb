"""Per-label attention over every code recorded so far, weighed by how long ago it was recorded.

What a clinician (and a gradient-boosted model on time features) reads off a history is, per diagnosis:
was it ever recorded, how often, how many visits and how many days ago it last was, how long ago it first
was. A pooled summary of the whole history has to squeeze all of that, for every code at once, into one
vector; a mean over ``n`` tokens dilutes a single recorded code ``n`` times. Here each label ``l`` has its
own learned query that scores every code token ``t`` of the history, and the score carries a learned,
label-specific function of the time elapsed between ``t`` and the scored visit:

    score(l, t) = q_l . K h_t / sqrt(k) + a_l . e(t)  [+ s_l if t is l's own code] [+ f_l if t is a first record]
    vote(l, t)  = u_l . h_t + c_l . e(t)              [+ o_l if t is l's own code] [+ g_l if t is a first record]
    logit_l    += sum_heads [ softmax_t'(sink_l, score(l, t')) . (v_sink_l, vote(l, t')) ]

with ``e(t)`` learned features of ``log(1 + days since t)`` and ``log(1 + visits since t)``: sigmoid steps that
start at fixed knots (``config.label_time_steps``, :func:`step_features`), so that a label can weigh records of an
age window as sharply as binned features do, or GELU ramps of a random start (models saved before session 59).
The softmax picks out the tokens relevant to ``l`` (typically ``l`` itself and what predicts it); the time bias
lets each label prefer recent or old records; a learned *sink* takes the weight when nothing relevant was recorded,
so the mass on real tokens grows with how often they were recorded. With ``config.label_own_code`` a label
also has a learned score and vote bias (``s_l``, ``o_l``, per head) on the records of its own code: a copy
prior, since a diagnosis already on file is the first thing that predicts it. With ``config.label_first_record``
a label also has a learned score and vote bias on every code's *first* record (``first_records``), so it can
attend to when a condition was first recorded apart from when it last was. The same mechanism as CAML/LAAT's
label-wise attention (Mullenbach et al. 2018; Vu et al. 2020) with time in the scores, as in time-aware
attention for EHRs (e.g. Bai et al. 2018).

The keys are contextual encoder states, not hand-made features: with the wide path switched off the model
still learns presence, counts and recency from the tokens and their times.

Cost: the tokens of a visit share its elapsed time, so each visit's tokens are summed up once per patient
(a log-sum-exp of their scores and a score-weighed mean of their votes, ``B nh L T``) and each scored visit
then attends over ``V`` visits, not ``T`` tokens: ``N nh L V`` in chunks of scored visits to bound memory.
This is the same softmax, regrouped (a test checks it and its gradients against the token-by-token formula), at
about a quarter of the cost. The sink joins each patient's visits as a column 0, so the scored visits' tensors are
built in the softmax's layout, without concatenations, transposed copies or accumulating index writes in the
backward pass (``benchmarks/finetune_step.py``: fine-tuning steps 1.52x faster on long histories than session 54's).

Shapes: ``B`` patients, ``T`` tokens, ``V`` visits, ``N`` scored positions, ``L`` labels, ``nh`` heads,
``k`` key size, ``E`` elapsed-time features.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from behrt_rope.model.config import ModelConfig
from behrt_rope.model.encoder import DAYS_PER_YEAR, INIT_STD
from behrt_rope.model.label_codes import LabelCodeMaps
from behrt_rope.schema import N_SPECIAL

KEY_SIZE = 16
"""Size of each head's label queries and token keys: a query only has to pick out a few codes."""
ELAPSED_SIZE = 16
"""Width of the learned features of the time elapsed since a token was recorded."""
STEP_DAYS = (7, 14, 30, 61, 91, 122, 152, 183, 243, 365, 730, 1826)
"""With ``config.label_time_steps``, the days at which the elapsed-time steps start (one feature each)."""
STEP_VISITS = (1.5, 2.5, 4.5, 8.5)
"""... and the visits since (between whole counts, so that 1, 2, 3-4, 5-8 and more visits fall apart)."""
STEP_SLOPE = 16.0
"""Starting slope of each step per unit of log(1 + time): 10% to 90% within about 12% of the knot's time."""
CHUNK_SCORES = 4_000_000
"""Most ``N x nh x L x T`` scores computed at once; larger batches are split over scored positions."""


def label_id_tensor(num_labels: int, label_token_ids: Sequence[int] | torch.Tensor | None) -> torch.Tensor:
    """``(L,)`` long: the token id of each label's code, all -1 (matches no token) when not given yet (training
    sets them, a loaded state dict brings them)."""
    if label_token_ids is None:
        return torch.full((num_labels,), -1, dtype=torch.long)
    ids = torch.as_tensor(label_token_ids, dtype=torch.long).clone()
    if ids.shape != (num_labels,):
        raise ValueError(f"label_token_ids must hold {num_labels} ids, got shape {tuple(ids.shape)}")
    return ids


class LabelParameters(NamedTuple):
    """The per-label parameters of one forward pass (the free ones, plus label-code offsets when tied)."""

    query: torch.Tensor  # (nh, L, k)
    value: torch.Tensor  # (nh * L, H) vote weights, row h * L + l
    time_bias: torch.Tensor  # (nh, L, E)
    time_value: torch.Tensor  # (E, nh, L)
    sink_value: torch.Tensor  # (nh, L)
    own_score: torch.Tensor | None  # (nh, L)
    own_vote: torch.Tensor | None  # (nh, L)
    first_score: torch.Tensor | None = None  # (nh, L)
    first_vote: torch.Tensor | None = None  # (nh, L)


class TokenLabelAttention(nn.Module):
    """Hidden states of a visit-causal pass -> one extra logit per label at each scored [SEP]."""

    label_token_ids: torch.Tensor | None  # (L,) long buffer with config.label_own_code, else None

    def __init__(self, config: ModelConfig, num_labels: int, label_token_ids: torch.Tensor | None = None) -> None:
        super().__init__()
        nh, k, E = config.label_attention_heads, KEY_SIZE, ELAPSED_SIZE
        self.num_heads, self.num_labels = nh, num_labels
        self.query = nn.Parameter(torch.randn(nh, num_labels, k) * INIT_STD)
        self.key = nn.Linear(config.hidden_size, nh * k)
        self.sink_key = nn.Parameter(torch.zeros(nh, k))
        self.elapsed = step_features() if config.label_time_steps else nn.Sequential(nn.Linear(2, E), nn.GELU())
        self.time_bias = nn.Parameter(torch.zeros(nh, num_labels, E))
        # Votes start at zero, so the path starts silent and the rest of the model is undisturbed.
        self.value = nn.Linear(config.hidden_size, nh * num_labels, bias=False)
        self.time_value = nn.Parameter(torch.zeros(E, nh, num_labels))
        self.sink_value = nn.Parameter(torch.zeros(nh, num_labels))
        # Own-code prior (config.label_own_code): biases on the score and the vote of the tokens that are the
        # label's own code. The ids are part of the state dict (a trained model carries its label codes);
        # -1 (matches no token) until training sets them or a state dict is loaded.
        self.own_score = nn.Parameter(torch.zeros(nh, num_labels)) if config.label_own_code else None
        self.own_vote = nn.Parameter(torch.zeros(nh, num_labels)) if config.label_own_code else None
        # First-record biases (config.label_first_record): on the score and the vote of the tokens that are the
        # first record of their code, so a label can attend to when a condition was first recorded (how long it
        # has been on file) apart from when it last was (how recent it is).
        self.first_score = nn.Parameter(torch.zeros(nh, num_labels)) if config.label_first_record else None
        self.first_vote = nn.Parameter(torch.zeros(nh, num_labels)) if config.label_first_record else None
        ids = label_id_tensor(num_labels, label_token_ids) if config.label_own_code else None
        self.register_buffer("label_token_ids", ids)
        # Label-code tying (config.label_code_tie, ``label_codes.py``): shared maps from each label's code
        # embedding to offsets of every per-label parameter above.
        sizes = {"query": nh * k, "value": nh * config.hidden_size, "time": 2 * nh * E, "sink": nh}
        if config.label_own_code:
            sizes["own"] = 2 * nh
        if config.label_first_record:
            sizes["first"] = 2 * nh
        self.tie = LabelCodeMaps(config.hidden_size, sizes) if config.label_code_tie else None
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
        label_vectors: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Per-label logits at the scored positions.

        Args:
            hidden: ``(B, T, H)`` states of a visit-causal encoder pass.
            token_ids: ``(B, T)`` long ids; only code tokens (not [CLS], [SEP], [PAD]) are keys.
            visit_index: ``(B, T)`` long visit numbers; a [SEP] carries the number of the visit it closes.
            ages: ``(B, T)`` float ages in years, one per visit (the ETL writes the visit's age on each token).
            score_at: ``(B, T)`` bool, the ``N`` [SEP] positions to score.
            label_vectors: ``(L, H)`` the label codes' vectors (``label_codes.label_vectors``); required with
                ``config.label_code_tie``, ignored without it.

        Returns:
            ``(N, L)`` logits, rows in row-major order of ``score_at``.
        """
        B, T, _ = hidden.shape
        nh, L = self.num_heads, self.num_labels
        params = self.label_parameters(label_vectors)
        rows, cols = score_at.nonzero(as_tuple=True)  # (N,), (N,)
        keys = self.key(hidden).view(B, T, nh, KEY_SIZE)  # (B, T, nh, k)
        # What does not depend on the scored visit is computed once per patient, laid out (B, nh, L, T) like
        # the per-visit tensors, so the rest is elementwise work without permuted copies.
        match = torch.einsum("hlk,bthk->bhlt", params.query.to(hidden.dtype), keys) * KEY_SIZE**-0.5
        votes = F.linear(hidden, params.value.to(hidden.dtype)).view(B, T, nh, L).permute(0, 2, 3, 1)  # (B, nh, L, T)
        if self.label_token_ids is not None and params.own_score is not None and params.own_vote is not None:
            own = (token_ids[:, None, :] == self.label_token_ids[None, :, None]).to(match.dtype)  # (B, L, T)
            match = match + params.own_score.to(match.dtype)[None, :, :, None] * own[:, None]
            votes = votes + params.own_vote.to(votes.dtype)[None, :, :, None] * own[:, None]
        if params.first_score is not None and params.first_vote is not None:
            first = first_records(token_ids).to(match.dtype)[:, None, None, :]  # (B, 1, 1, T)
            match = match + params.first_score.to(match.dtype)[None, :, :, None] * first
            votes = votes + params.first_vote.to(votes.dtype)[None, :, :, None] * first
        visit_match, visit_votes, visit_age = _per_visit(match, votes, token_ids >= N_SPECIAL, visit_index, ages)
        visit_match, visit_votes = self._with_sink(params, visit_match, visit_votes)  # (B, nh, L, 1 + V)
        scored_visit = visit_index[rows, cols]  # (N,)
        scored_age = ages[rows, cols]  # (N,)
        chunk = max(1, CHUNK_SCORES // max(1, nh * L * visit_match.shape[-1]))
        # (nh L, E) each: the time features' weights in the scores and in the votes.
        time_maps = (params.time_bias.flatten(0, 1), params.time_value.permute(1, 2, 0).flatten(0, 1))
        time_maps = (time_maps[0].to(visit_votes.dtype), time_maps[1].to(visit_votes.dtype))
        out = []
        for s in range(0, len(rows), chunk):
            # index_select, not advanced indexing: its backward adds whole rows (index_add_), where the backward
            # of ``x[rows]`` is a generic accumulating index_put_ that took 15% of a step on long histories.
            part = rows[s : s + chunk]
            match_n, votes_n, age_n = (x.index_select(0, part) for x in (visit_match, visit_votes, visit_age))
            out.append(
                self._score(match_n, votes_n, age_n, scored_visit[s : s + chunk], scored_age[s : s + chunk], time_maps)
            )
        return torch.cat(out) if out else hidden.new_zeros(0, L)

    def _with_sink(
        self, params: LabelParameters, visit_match: torch.Tensor, visit_votes: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The sink as a visit 0 of every patient, before the visits: ``(B, nh, L, V)`` -> ``(B, nh, L, 1 + V)``.

        The sink's score (its key against each label's query) and vote do not depend on the patient; set once per
        patient here, they enter the softmax over ``1 + V`` columns with no per-scored-visit concatenation.
        """
        B, nh, L, _ = visit_match.shape
        dtype = visit_votes.dtype
        sink = torch.einsum("hlk,hk->hl", params.query.to(dtype), self.sink_key.to(dtype)) * KEY_SIZE**-0.5  # (nh, L)
        sink_match = sink.to(visit_match.dtype)[None, :, :, None].expand(B, nh, L, 1)
        sink_vote = params.sink_value.to(dtype)[None, :, :, None].expand(B, nh, L, 1)
        return torch.cat([sink_match, visit_match], dim=-1), torch.cat([sink_vote, visit_votes], dim=-1)

    def label_parameters(self, label_vectors: torch.Tensor | None = None) -> LabelParameters:
        """The per-label parameters, with the label-code offsets added when the head is tied."""
        nh, L = self.num_heads, self.num_labels
        own_score, own_vote = self.own_score, self.own_vote
        first_score, first_vote = self.first_score, self.first_vote
        params = LabelParameters(
            self.query,
            self.value.weight,
            self.time_bias,
            self.time_value,
            self.sink_value,
            own_score,
            own_vote,
            first_score,
            first_vote,
        )
        if self.tie is None:
            return params
        if label_vectors is None:
            raise ValueError("a head with label_code_tie needs label_vectors (label_codes.label_vectors)")
        offsets = self.tie(label_vectors)  # {name: (L, size)}
        time = offsets["time"].view(L, 2, nh, ELAPSED_SIZE)
        if own_score is not None and own_vote is not None:
            own = offsets["own"].view(L, 2, nh)
            own_score, own_vote = own_score + own[:, 0].T, own_vote + own[:, 1].T
        if first_score is not None and first_vote is not None:
            first = offsets["first"].view(L, 2, nh)
            first_score, first_vote = first_score + first[:, 0].T, first_vote + first[:, 1].T
        return LabelParameters(
            query=params.query + offsets["query"].view(L, nh, KEY_SIZE).transpose(0, 1),
            value=params.value + offsets["value"].view(L, nh, -1).transpose(0, 1).reshape(nh * L, -1),
            time_bias=params.time_bias + time[:, 0].permute(1, 0, 2),
            time_value=params.time_value + time[:, 1].permute(2, 1, 0),
            sink_value=params.sink_value + offsets["sink"].T,
            own_score=own_score,
            own_vote=own_vote,
            first_score=first_score,
            first_vote=first_vote,
        )

    def _score(
        self,
        visit_match: torch.Tensor,
        visit_votes: torch.Tensor,
        visit_age: torch.Tensor,
        scored_visit: torch.Tensor,
        scored_age: torch.Tensor,
        time_maps: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """``(n, L)`` logits at ``n`` scored visits, from their patients' per-visit aggregates.

        Args:
            visit_match: ``(n, nh, L, 1 + V)`` the sink's score, then the log-sum-exp of the query-key scores
                of each visit's code tokens (``-inf`` for a visit without codes).
            visit_votes: ``(n, nh, L, 1 + V)`` the sink's vote, then the mean vote of each visit's code tokens,
                weighed by those scores.
            visit_age: ``(n, V)`` each visit's age in years.
            scored_visit: ``(n,)`` long, the number of the scored visit; visits after it are not seen.
            scored_age: ``(n,)`` its age in years.
            time_maps: ``(nh L, E)`` twice, the time features' weights in the scores and in the votes.
        """
        n, nh, L, _ = visit_match.shape
        V = visit_age.shape[1]
        dtype = visit_votes.dtype
        number = torch.arange(V, device=visit_votes.device)
        days = ((scored_age[:, None] - visit_age) * DAYS_PER_YEAR).clamp(min=0.0)  # (n, V)
        visits = (scored_visit[:, None] - number).clamp(min=0).to(days.dtype)  # (n, V)
        e = self.elapsed(torch.stack([torch.log1p(days), torch.log1p(visits)], dim=-1).to(dtype))  # (n, V, E)
        e = F.pad(e, (0, 0, 1, 0))  # (n, 1 + V, E): no time term on the sink
        # Time's share of the scores and of the votes, each a batched matmul that writes the scores' layout:
        # (n, nh L, E) @ (n, E, 1 + V) -> (n, nh L, 1 + V), no transposed copies forward or backward.
        e = e.transpose(1, 2)  # (n, E, 1 + V)
        time_bias, time_votes = (torch.bmm(m.expand(n, -1, -1), e).view(n, nh, L, V + 1) for m in time_maps)
        later = F.pad(number[None, :] > scored_visit[:, None], (1, 0))  # (n, 1 + V), the sink always seen
        scores = torch.where(later[:, None, None, :], float("-inf"), visit_match + time_bias)  # (n, nh, L, 1 + V)
        weights = torch.softmax(scores, dim=-1)  # (n, nh, L, 1 + V)
        return (weights * (visit_votes + time_votes)).sum(-1).sum(1)  # (n, L)


def step_features() -> nn.Sequential:
    """``(..., 2)`` log(1 + days), log(1 + visits) -> ``(..., ELAPSED_SIZE)`` sigmoid steps starting at
    :data:`STEP_DAYS` and :data:`STEP_VISITS` with slope :data:`STEP_SLOPE` (weights and knots stay learned).

    >>> steps = step_features()
    >>> x = torch.log1p(torch.tensor([[10.0, 1.0], [200.0, 6.0]]))
    >>> (steps(x) > 0.5).int().tolist()
    [[1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 0]]
    """
    if len(STEP_DAYS) + len(STEP_VISITS) != ELAPSED_SIZE:
        raise ValueError(f"{len(STEP_DAYS)} + {len(STEP_VISITS)} steps must make ELAPSED_SIZE={ELAPSED_SIZE}")
    linear = nn.Linear(2, ELAPSED_SIZE)
    knots = torch.log1p(torch.tensor([*STEP_DAYS, *STEP_VISITS], dtype=torch.float32))
    reads = torch.tensor([0] * len(STEP_DAYS) + [1] * len(STEP_VISITS))
    with torch.no_grad():
        linear.weight.zero_()
        linear.weight[torch.arange(ELAPSED_SIZE), reads] = STEP_SLOPE
        linear.bias.copy_(-STEP_SLOPE * knots)
    return nn.Sequential(linear, nn.Sigmoid())


def first_records(token_ids: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` bool: the code tokens whose id occurs at no earlier position of their row.

    Depends only on earlier tokens, so a history cut at any visit marks its tokens as the whole row does.

    >>> first_records(torch.tensor([[1, 7, 9, 2, 7, 8, 2, 0]])).int().tolist()
    [[0, 1, 1, 0, 0, 1, 0, 0]]
    """
    sorted_ids, order = torch.sort(token_ids, dim=1, stable=True)  # equal ids keep their order
    first = torch.ones_like(sorted_ids, dtype=torch.bool)
    first[:, 1:] = sorted_ids[:, 1:] != sorted_ids[:, :-1]
    return torch.zeros_like(first).scatter(1, order, first) & (token_ids >= N_SPECIAL)


def _per_visit(
    match: torch.Tensor, votes: torch.Tensor, is_code: torch.Tensor, visit_index: torch.Tensor, ages: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each visit's code tokens summed up, once per patient: the exact form of the token-level softmax.

    A visit's tokens share its elapsed time, so in ``softmax_t(match_t + bias(visit of t))`` the tokens of a
    visit ``v`` enter only through ``log sum_{t in v} exp(match_t)`` and the ``exp(match_t)``-weighed mean of
    their votes. Scoring then costs ``V`` (visits) per scored visit instead of ``T`` (tokens).

    Args:
        match: ``(B, nh, L, T)`` query-key scores; votes: ``(B, nh, L, T)`` token votes.
        is_code: ``(B, T)`` bool, the code tokens (the only keys); visit_index: ``(B, T)`` long;
            ages: ``(B, T)`` float years.

    Returns:
        ``visit_match`` ``(B, nh, L, V)`` (``-inf`` where a visit has no code), ``visit_votes``
        ``(B, nh, L, V)``, in the dtype of ``votes``, and ``visit_age`` ``(B, V)`` float years.
    """
    B, nh, L, T = match.shape
    slot = visit_index.clamp(min=0)  # (B, T)
    V = int(slot.max()) + 1 if slot.numel() else 1
    # Sums of exponentials in float32, shifted by each row's largest score (a constant per softmax row).
    match32 = match.float().masked_fill(~is_code[:, None, None, :], float("-inf"))  # (B, nh, L, T)
    peak = match32.amax(dim=-1, keepdim=True).detach()  # (B, nh, L, 1)
    weight = torch.exp(match32 - peak.clamp(min=torch.finfo(torch.float32).min))  # (B, nh, L, T); 0 off codes
    index = slot[:, None, None, :].expand(B, nh, L, T)
    mass = match32.new_zeros(B, nh, L, V).scatter_add(-1, index, weight)  # (B, nh, L, V)
    weighted_votes = match32.new_zeros(B, nh, L, V).scatter_add(-1, index, weight * votes.float())
    codes_in_visit = is_code.float().new_zeros(B, V).scatter_add(1, slot, is_code.float())  # (B, V)
    tiny = torch.finfo(torch.float32).tiny
    visit_match = torch.where(
        codes_in_visit[:, None, None, :] > 0, peak + torch.log(mass.clamp(min=tiny)), float("-inf")
    )
    visit_votes = weighted_votes / mass.clamp(min=tiny)
    code_ages = torch.where(is_code, ages, torch.zeros_like(ages))
    visit_age = ages.new_zeros(B, V).scatter_reduce(1, slot, code_ages, reduce="amax")  # (B, V)
    return visit_match.to(votes.dtype), visit_votes.to(votes.dtype), visit_age
