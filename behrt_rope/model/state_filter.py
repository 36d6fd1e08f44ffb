"""Per-label hidden-state filter: a learned continuous-time hidden Markov model, read visit by visit.

Many conditions behave like a hidden state that moves in time (absent, early, established, treated, ...)
and shows only through what visits record: a symptom code now and then early on, the diagnosis once it is
established, little once it resolves. What a record says about the next visit then depends on the *order*
and *spacing* of what was recorded, in a way that counts and recencies only approximate. This path gives
each label ``l`` its own ``K``-state chain and runs its forward filter over the visits:

* at the first visit, the state distribution is a learned function of age and sex
  (``softmax_k(prior_l . [1, a, a^2, female, male])``, ``a = (age - 50) / 20``);
* between visits ``t - 1`` and ``t``, ``g`` years apart, it moves by the chain's transition matrix
  ``expm(Q_l g)``, where ``Q_l`` has off-diagonal rates per year ``softplus(r_l + r_age_l a + r_sex_l female)``
  (a proportional-hazards-like dependence on the age at ``t - 1``); with a ``reach`` only states at most that
  many apart in the states' order have a rate between them (1: a birth-death chain), an ordered chain in fewer
  numbers (:func:`allowed_moves`). The matrices are exact at a grid (ages
  every 10 years, both sexes, gaps 0 and ``2^j / 64`` years, one batched matrix exponential and its squares
  per forward pass) and mixed bilinearly in between, every visit's matrix in one weighted gather
  (``embedding_bag``): 7-17x cheaper than a matrix exponential per visit (``benchmarks/state_filter_speed.py``);
* at each visit it is reweighed by that visit's evidence, a learned log-potential per state from the codes
  recorded there (``sum_c W[c, l, k]`` over the visit's distinct codes, plus a per-state bias for a visit
  as such) and renormalised;
* label ``l``'s logit at a scored visit is ``logit(sum_k pi_k sigmoid(e_lk))``: each state's chance of
  recording ``l`` at the next visit, weighed by the filtered state ``pi`` of the label's chain
  (``chain_of_label[l]``: its own by default; labels can share one, see :meth:`share_chains`).

This is the forward filter of a continuous-time HMM, as in disease-progression models (e.g. Liu et al. 2015,
"Efficient learning of continuous-time hidden Markov models for disease progression"), with the emission
likelihood replaced by discriminatively trained potentials (a visit's log-likelihood under independent code
emissions is linear in its multi-hot codes, so nothing is lost for that family). Everything is learned by
gradient descent with the rest of the head; nothing is computed outside the model. The states carry no names:
``K`` is a capacity, not a claim about any disease.

Shapes: ``B`` patients, ``T`` tokens, ``V`` visits (the largest visit index + 1), ``N`` scored positions,
``L`` labels, ``G`` chains (``L`` unless labels share them), ``K`` states, ``C`` the vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from behrt_rope.model.visit_gap import visit_ages
from behrt_rope.schema import N_SPECIAL, SEP_ID, SEX_VALUES

AGE_CENTRE = 50.0
"""Years: the age at which the rates' age term is zero."""
AGE_SCALE = 20.0
"""Years per unit of the age term."""
FEMALE, MALE = SEX_VALUES.index("female"), SEX_VALUES.index("male")
"""Sex ids (``schema.SEX_VALUES`` positions)."""
PRIOR_FEATURES = 5
"""1, a, a^2, female, male."""
INITIAL_RATE = -2.0
"""Initial pre-softplus rate: about 0.13 moves a year between any two states."""
AGE_STEP = 10.0
"""Years between the age grid's points, from 0 to 110; rates at ages in between are interpolated."""
AGE_GRID = tuple(AGE_STEP * i for i in range(12))
SMALLEST_GAP = 1.0 / 64.0
"""Years (about 5.7 days): the gap grid is 0, then ``SMALLEST_GAP x 2^j``."""
GAP_POINTS = 14
"""Grid points: 0 and ``2^j / 64`` years for ``j = 0 .. 12`` (up to 64 years)."""
PROBABILITY_FLOOR = 1e-6
"""Chances are kept in [floor, 1 - floor] before the logit."""


class HiddenStateFilter(nn.Module):
    """``(B, T)`` token stream -> ``(N, L)`` logits of each label at the next visit, from ``L`` learned chains."""

    move_from: torch.Tensor  # (moves,) long: the state each rate leaves (K (K - 1) moves unless a reach is set)
    move_to: torch.Tensor  # (moves,) long: the state it enters
    chain_of_label: torch.Tensor  # (L,) long: the chain each label reads (saved; its own unless shared)

    def __init__(self, vocab_size: int, num_labels: int, num_states: int = 4, reach: int = 0) -> None:
        super().__init__()
        if num_states < 2:
            raise ValueError(f"a hidden-state filter needs at least 2 states, got {num_states}")
        if reach < 0:
            raise ValueError(f"reach (how many states a move may cross; 0: any) must be >= 0, got {reach}")
        L, K = num_labels, num_states
        self.vocab_size, self.num_labels, self.num_states = vocab_size, L, K
        self.num_chains = L  # until labels share chains (share_chains)
        from_to = allowed_moves(K, reach)  # (moves, 2)
        moves = len(from_to)
        # Symmetry breaking: chains start a little apart, so their states can take different roles.
        self.rate = nn.Parameter(INITIAL_RATE + 0.1 * torch.randn(L, moves))
        self.rate_age = nn.Parameter(torch.zeros(L, moves))
        self.rate_sex = nn.Parameter(torch.zeros(L, moves))
        self.prior = nn.Parameter(0.1 * torch.randn(L, K, PRIOR_FEATURES))
        self.evidence = nn.Parameter(0.01 * torch.randn(vocab_size, L * K))
        self.visit_evidence = nn.Parameter(torch.zeros(L, K))
        self.emission = nn.Parameter(-2.0 + 0.5 * torch.randn(L, K))
        self.register_buffer("move_from", from_to[:, 0].clone(), persistent=False)
        self.register_buffer("move_to", from_to[:, 1].clone(), persistent=False)
        self.register_buffer("chain_of_label", torch.arange(L))
        self._register_load_state_dict_pre_hook(self._saved_chains)

    def forward(
        self,
        token_ids: torch.Tensor,
        visit_index: torch.Tensor,
        ages: torch.Tensor,
        score_at: torch.Tensor,
        sex: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``(B, T)`` ids, visit numbers, ages in years, the scored [SEP] mask and sex ids -> ``(N, L)``
        float32 logits (rows in row-major order of ``score_at``). Always in float32, also under autocast."""
        with torch.autocast(token_ids.device.type, enabled=False):
            at_visit = visit_ages(token_ids, visit_index, ages)  # (B, V)
            female, male = _sex_flags(token_ids, sex)  # (B,)
            evidence = self._visit_evidence(token_ids, visit_index, at_visit.shape[1])  # (B, V, G, K)
            scored_rows, scored_cols = score_at.nonzero(as_tuple=True)
            scored_visits = visit_index[scored_rows, scored_cols]  # (N,)
            last = int(scored_visits.max()) + 1 if len(scored_visits) else 0
            emission = torch.sigmoid(self.emission)  # (L, K)
            state = self._first_state(at_visit[:, 0], female, male)  # (B, G, K)
            # unbound once: a slice per visit would cost a whole-tensor gradient per visit in the backward
            moves = self._transitions(at_visit[:, :last], female).unbind(1)  # last - 1 x (B, G, K, K)
            # Reweighing by exp(evidence), scaled per (visit, label) so that its largest factor is 1: the same
            # as a softmax of log(state) + evidence, without a log, exp and softmax at every visit.
            weigh = torch.exp(evidence - evidence.amax(-1, keepdim=True))[:, :last].unbind(1)  # last x (B, G, K)
            chances = []
            for t in range(last):
                if t > 0:
                    state = (state.unsqueeze(-1) * moves[t - 1]).sum(-2)
                state = state.clamp(min=1e-30) * weigh[t]
                state = state / state.sum(-1, keepdim=True)
                chances.append((state[:, self.chain_of_label] * emission).sum(-1))  # (B, L)
            if not chances:
                return torch.zeros(0, self.num_labels, device=token_ids.device)
            chance = torch.stack(chances, dim=1)[scored_rows, scored_visits]  # (N, L)
            chance = chance.clamp(PROBABILITY_FLOOR, 1.0 - PROBABILITY_FLOOR)
            return torch.log(chance) - torch.log1p(-chance)

    def code_log_likelihood(
        self,
        token_ids: torch.Tensor,
        visit_index: torch.Tensor,
        ages: torch.Tensor,
        codes: torch.Tensor,
        log_odds: torch.Tensor,
        sex: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The chains read as hidden Markov models of their own codes: ``codes`` ``(G, J)`` the token ids each
        chain emits (-1: a free slot), each recorded at a visit independently with chance ``sigmoid(log_odds)``
        ``(G, J, K)`` in state ``k`` (and not recorded otherwise); the moves and the first visit's law are the
        filter's own. ``(B, T)`` stream -> ``()`` the summed log-likelihood (nats) of every visit's record of
        those codes, present or absent, and ``()`` the number of visits it sums over. The forward algorithm,
        in float32: the log of each visit's normaliser, before the state is reweighed by that visit."""
        with torch.autocast(token_ids.device.type, enabled=False):
            at_visit = visit_ages(token_ids, visit_index, ages)  # (B, V)
            V = at_visit.shape[1]
            real = _visited(token_ids, visit_index, V)  # (B, V)
            slot = codes >= 0  # (G, J)
            recorded = self._recorded(token_ids, visit_index, V)[:, :, codes.clamp(min=0)]  # (B, V, G, J)
            emitted = recorded[..., None] * log_odds - F.softplus(log_odds)  # (B, V, G, J, K)
            per_state = (emitted * slot[..., None]).sum(-2).unbind(1)  # V x (B, G, K)
            female, male = _sex_flags(token_ids, sex)
            state = self._first_state(at_visit[:, 0], female, male)  # (B, G, K)
            moves = self._transitions(at_visit, female).unbind(1)  # V - 1 x (B, G, K, K)
            total = at_visit.new_zeros(())
            for t in range(V):
                ahead = state if t == 0 else (state.unsqueeze(-1) * moves[t - 1]).sum(-2)
                top = per_state[t].amax(-1, keepdim=True)
                joint = ahead.clamp(min=1e-30) * torch.exp(per_state[t] - top)
                norm = joint.sum(-1, keepdim=True)
                here = real[:, t]
                total = total + ((torch.log(norm) + top).squeeze(-1).sum(-1) * here).sum()
                state = torch.where(here[:, None, None], joint / norm, ahead)
            return total, real.sum()

    def own_code_log_odds(self, codes: torch.Tensor) -> torch.Tensor:
        """``(G, J)`` the label codes each chain emits (-1: a free slot) -> ``(G, J, K)`` their evidence on their
        own chain, read as each code's log-odds of being recorded in each state: the hidden Markov model
        :meth:`adopt_emissions` started the chains from, as the fit has moved it since. Free slots read code
        0's evidence, which :meth:`code_log_likelihood` leaves out."""
        G, J = codes.shape
        chain = torch.arange(G, device=codes.device)[:, None].expand(G, J)
        return self.evidence.view(self.vocab_size, self.num_chains, self.num_states)[codes.clamp(min=0), chain]

    def adopt_emissions(self, codes: torch.Tensor, log_odds: torch.Tensor, label_codes: torch.Tensor) -> None:
        """Make the filter the hidden Markov model :meth:`code_log_likelihood` scores (``codes`` ``(G, J)``,
        ``log_odds`` ``(G, J, K)``): each code's evidence on its chain is its log-odds (the chance of its absence
        goes to the visit bias), and each label whose code ``label_codes`` ``(L,)`` its chain emits starts its
        chance at the next visit at that code's chance at this one. Other codes' evidence is left as it is: the
        exact model where it is zero, a small random start for the discriminative fit as initialised (which keeps
        patients with the same own codes from tying exactly)."""
        G, J, K = log_odds.shape
        if codes.shape != (G, J) or (self.num_chains, self.num_states) != (G, K):
            raise ValueError(f"codes {tuple(codes.shape)} and log-odds {tuple(log_odds.shape)} do not fit the filter")
        slot = codes >= 0
        chain = torch.arange(G, device=codes.device)[:, None].expand(G, J)
        with torch.no_grad():
            self.evidence.view(self.vocab_size, G, K)[codes[slot], chain[slot]] = log_odds[slot]
            self.visit_evidence.copy_(-(F.softplus(log_odds) * slot[..., None]).sum(1))
            own = codes[self.chain_of_label] == label_codes[:, None]  # (L, J): the slot of each label's code
            has = own.any(-1) & (label_codes >= 0)
            slot_of_label = own.float().argmax(-1)
            self.emission[has] = log_odds[self.chain_of_label[has], slot_of_label[has]]

    def share_chains(self, chain_of_label: torch.Tensor) -> None:
        """Let labels share chains: label ``l`` reads from now on the chain that label ``chain_of_label[l]``
        ``(L,)`` reads now (each label keeps its own emission chances of the shared states). Chains no label reads
        any more are dropped (they would run unread) and the others keep their parameters, renumbered in order:
        call it before training. Labels name the chains, so sharing by the same pairs again changes nothing."""
        chain_of_label = torch.as_tensor(chain_of_label, dtype=torch.long, device=self.chain_of_label.device)
        if chain_of_label.shape != (self.num_labels,) or not (
            (chain_of_label >= 0).all() and (chain_of_label < self.num_labels).all()
        ):
            raise ValueError(f"chain_of_label must hold {self.num_labels} label numbers in [0, {self.num_labels})")
        kept, renumbered = torch.unique(self.chain_of_label[chain_of_label], return_inverse=True)
        self._keep_chains(kept)
        self.chain_of_label.copy_(renumbered)

    def _keep_chains(self, kept: torch.Tensor) -> None:
        """Keep only chains ``kept`` ``(G,)`` (ascending chain numbers): every per-chain parameter is cut to them."""
        C, K = self.vocab_size, self.num_states
        for name in _CHAIN_PARAMETERS:
            value = getattr(self, name)
            cut = value.view(C, self.num_chains, K)[:, kept].reshape(C, -1) if name == "evidence" else value[kept]
            setattr(self, name, nn.Parameter(cut.detach().clone(), requires_grad=value.requires_grad))
        self.num_chains = len(kept)

    def _saved_chains(self, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
        """Load a filter whatever its chains: one saved with shared chains has fewer chains than labels; one saved
        before chains could be shared (session 51) has no ``chain_of_label``: each label its own."""
        rate = state_dict.get(prefix + "rate")
        if rate is not None and len(rate) != self.num_chains:  # sized as saved; the values are loaded next
            for name in _CHAIN_PARAMETERS:
                value = getattr(self, name)
                saved = state_dict[prefix + name]
                setattr(self, name, nn.Parameter(value.new_empty(saved.shape), requires_grad=value.requires_grad))
            self.num_chains = len(rate)
        emission = state_dict.get(prefix + "emission")
        if prefix + "chain_of_label" not in state_dict and emission is not None:
            state_dict[prefix + "chain_of_label"] = torch.arange(emission.shape[0])

    def generator(self, age: torch.Tensor, female: torch.Tensor) -> torch.Tensor:
        """``(B,)`` ages in years and female flags -> ``(B, G, K, K)`` rate matrices per year (rows sum to 0) of
        the ``G`` chains."""
        a = ((age - AGE_CENTRE) / AGE_SCALE)[:, None, None]  # (B, 1, 1)
        rates = F.softplus(self.rate + self.rate_age * a + self.rate_sex * female[:, None, None])  # (B, G, moves)
        q = rates.new_zeros(len(age), self.num_chains, self.num_states, self.num_states)
        q[:, :, self.move_from, self.move_to] = rates
        return q - torch.diag_embed(q.sum(-1))

    def _first_state(self, age: torch.Tensor, female: torch.Tensor, male: torch.Tensor) -> torch.Tensor:
        """``(B, G, K)`` state distribution of each chain before the first visit's evidence."""
        a = (age - AGE_CENTRE) / AGE_SCALE
        features = torch.stack([torch.ones_like(a), a, a * a, female, male], dim=-1)  # (B, 5)
        return torch.softmax(torch.einsum("lkf,bf->blk", self.prior, features), dim=-1)

    def transition_table(self) -> torch.Tensor:
        """``(2, A, P, G, K, K)``: the transition matrix of every chain at each grid point of (female, age,
        gap): the identity at gap 0, ``expm(Q_l(age, sex) g0)`` at the smallest gap and its repeated squares
        (``P(2 g) = P(g)^2``, exact) above, so one small batched matrix exponential per forward pass."""
        female = torch.tensor([0.0, 1.0], device=self.rate.device)
        ages = torch.tensor(AGE_GRID, device=self.rate.device)
        female, ages = (grid.reshape(-1) for grid in torch.meshgrid(female, ages, indexing="ij"))  # (2 A,)
        step = torch.linalg.matrix_exp(self.generator(ages, female) * SMALLEST_GAP)  # (2 A, G, K, K)
        powers = [torch.eye(self.num_states, device=step.device).expand_as(step), step]
        for _ in range(GAP_POINTS - 2):
            square = powers[-1] @ powers[-1]
            powers.append(square / square.sum(-1, keepdim=True))  # float32 rounding would drift off 1
        table = torch.stack(powers, dim=1)  # (2 A, P, G, K, K)
        return table.view(2, len(AGE_GRID), GAP_POINTS, self.num_chains, self.num_states, self.num_states)

    def _transitions(self, at_visit: torch.Tensor, female: torch.Tensor) -> torch.Tensor:
        """``(B, V)`` ages at each visit in years and ``(B,)`` female flags -> ``(B, V - 1, G, K, K)``: the
        transition matrix from each visit to the next, at the rates of the earlier visit's age. Each is read
        off :meth:`transition_table` bilinearly in age and in the gap's grid position (:func:`_gap_position`),
        all visits in one weighted gather (``embedding_bag``: four table rows and their weights per move); a
        convex mix of transition matrices is one too."""
        B, V = at_visit.shape
        G, K = self.num_chains, self.num_states
        table = self.transition_table().reshape(-1, G * K * K)  # (2 A P, G K K)
        age, gap = at_visit[:, :-1], (at_visit[:, 1:] - at_visit[:, :-1]).clamp(min=0.0)  # (B, V - 1) years
        a = (age / AGE_STEP).clamp(0.0, len(AGE_GRID) - 1.0)
        u = _gap_position(gap)
        a0, u0 = a.floor().long().clamp(max=len(AGE_GRID) - 2), u.floor().long().clamp(max=GAP_POINTS - 2)
        wa, wu = a - a0, u - u0
        corner = (female.long()[:, None] * len(AGE_GRID) + a0) * GAP_POINTS + u0  # (B, V - 1) row of (a0, u0)
        rows = torch.stack([corner, corner + 1, corner + GAP_POINTS, corner + GAP_POINTS + 1], dim=-1)
        weights = torch.stack([(1 - wa) * (1 - wu), (1 - wa) * wu, wa * (1 - wu), wa * wu], dim=-1)
        moves = F.embedding_bag(rows.reshape(-1, 4), table, per_sample_weights=weights.reshape(-1, 4), mode="sum")
        return moves.view(B, V - 1, G, K, K)

    def _visit_evidence(self, token_ids: torch.Tensor, visit_index: torch.Tensor, visits: int) -> torch.Tensor:
        """``(B, V, G, K)``: each visit's log-potentials on each chain, from its distinct codes (special tokens
        and padding carry none) plus the per-visit bias."""
        recorded = self._recorded(token_ids, visit_index, visits)
        evidence = (recorded @ self.evidence).view(len(token_ids), visits, self.num_chains, self.num_states)
        return evidence + self.visit_evidence

    def _recorded(self, token_ids: torch.Tensor, visit_index: torch.Tensor, visits: int) -> torch.Tensor:
        """``(B, visits, C)`` float32: 1 where a visit records a code (once, however often it is listed)."""
        B = len(token_ids)
        codes = token_ids >= N_SPECIAL  # (B, T)
        recorded = torch.zeros(B, visits, self.vocab_size, device=token_ids.device)
        rows = torch.arange(B, device=token_ids.device)[:, None].expand_as(token_ids)
        recorded[rows[codes], visit_index[codes], token_ids[codes]] = 1.0
        return recorded


def allowed_moves(num_states: int, reach: int = 0) -> torch.Tensor:
    """``(moves, 2)`` long: the ``(from, to)`` states a chain of ``num_states`` states may move between, in
    row-major order: any two distinct states (``reach`` 0), or states at most ``reach`` apart in the states'
    order (1: neighbours only, a birth-death chain).

    >>> allowed_moves(3).tolist()
    [[0, 1], [0, 2], [1, 0], [1, 2], [2, 0], [2, 1]]
    >>> allowed_moves(4, reach=1).tolist()
    [[0, 1], [1, 0], [1, 2], [2, 1], [2, 3], [3, 2]]
    """
    states = torch.arange(num_states)
    apart = (states[:, None] - states[None, :]).abs()  # (K, K)
    return ((apart > 0) & (apart <= (reach or num_states))).nonzero()


def _sex_flags(token_ids: torch.Tensor, sex: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B,)`` float female and male flags from the ``(B, T)`` sex ids (none: neither)."""
    sex_ids = sex[:, 0] if sex is not None else torch.zeros_like(token_ids[:, 0])
    return (sex_ids == FEMALE).float(), (sex_ids == MALE).float()


def _visited(token_ids: torch.Tensor, visit_index: torch.Tensor, visits: int) -> torch.Tensor:
    """``(B, visits)`` bool: the visits a row has (those whose [SEP] it holds)."""
    column = torch.where(token_ids == SEP_ID, visit_index, torch.full_like(visit_index, visits))
    out = torch.zeros(len(token_ids), visits + 1, dtype=torch.bool, device=token_ids.device)
    return out.scatter(1, column, True)[:, :visits]


_CHAIN_PARAMETERS = ("rate", "rate_age", "rate_sex", "prior", "evidence", "visit_evidence")
"""Parameters with one entry per chain (``evidence``: a ``K``-column block per chain); ``emission`` is per label."""


def _gap_position(gap: torch.Tensor) -> torch.Tensor:
    """``(B,)`` gaps in years -> their fractional position on the gap grid: linear between 0 and the smallest
    gap, then in ``log2`` between its doublings; clamped to the grid."""
    doublings = torch.log2(gap.clamp(min=SMALLEST_GAP) / SMALLEST_GAP)
    position = torch.where(gap < SMALLEST_GAP, gap / SMALLEST_GAP, 1.0 + doublings)
    return position.clamp(0.0, GAP_POINTS - 1.0)
