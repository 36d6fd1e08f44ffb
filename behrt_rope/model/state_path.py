"""The state path: per-label hidden-state chains fitted apart from the deep part, and their share of the logit.

:class:`~behrt_rope.model.state_filter.HiddenStateFilter` gives each label a learned continuous-time hidden
Markov chain read visit by visit. Trained *inside* the deep part it slowed every step and cost the dense
cohorts epochs (docs/benchmarks.md, "Forty-fourth round"). Here the same chains are a path of their own, like
the sparse time path: ``finetune`` fits them after the deep part, on the same train samples, by gradient
descent on their own logits (``training/state_path_fit.py``), then sets their ``share`` of the model's logit on
the tuning split (0 keeps the model as it was). The model's logit becomes
``(1 - share) * (deep part and sparse time path) + share * state path``.

A label's chain reads evidence from every code. An L1 penalty on the evidence of codes other than the label's
own (:meth:`StatePath.cross_evidence_l1`) keeps the chains sparse: each label then reads its own code and the
few others that move its state, the shape of a condition whose symptom and diagnosis codes share one hidden
stage, from 4,000 patients rather than tens of thousands.

With ``copies`` > 1 the path holds that many sets of chains, initialised apart and fitted one after another
(each on its own batch order, with its own best epoch); the path's logit is the mean of the fitted sets', an
ensemble of seeds. ``copy_weight`` holds each set's weight in that mean (0 for a set the time budget left
unfitted).

Shapes: ``B`` patients, ``T`` tokens, ``N`` scored positions, ``L`` labels, ``C`` the vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn

from behrt_rope.model.path_share import SharedPath
from behrt_rope.model.state_filter import HiddenStateFilter
from behrt_rope.model.token_label_attention import label_id_tensor


class StatePath(SharedPath):
    """``(B, T)`` token stream -> ``(N, L)`` logits from ``L`` hidden-state chains; ``share`` is their weight in
    the model's logit (0 until ``finetune`` sets it)."""

    label_token_ids: torch.Tensor  # (L,) long: the token id of each label's code (-1: none)
    copy_weight: torch.Tensor  # (copies,) float32: each set of chains' weight in the path's logit (sums to 1)
    path_name = "state path"

    def __init__(
        self,
        vocab_size: int,
        num_labels: int,
        num_states: int,
        label_token_ids: Sequence[int] | torch.Tensor | None = None,
        copies: int = 1,
        reach: int = 0,
    ) -> None:
        super().__init__(share=0.0)
        self.chains = nn.ModuleList(HiddenStateFilter(vocab_size, num_labels, num_states, reach) for _ in range(copies))
        self.register_buffer("label_token_ids", label_id_tensor(num_labels, label_token_ids))
        self.register_buffer("copy_weight", torch.full((copies,), 1.0 / copies))
        self._register_load_state_dict_pre_hook(_one_set_bundles)

    @property
    def copies(self) -> int:
        return len(self.chains)

    def forward(
        self,
        token_ids: torch.Tensor,
        visit_index: torch.Tensor,
        ages: torch.Tensor,
        score_at: torch.Tensor,
        sex: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Arguments as :meth:`HiddenStateFilter.forward` -> ``(N, L)`` float32 logits: the sets' weighted mean
        (a set of weight 0 is not run)."""
        where = (token_ids, visit_index, ages, score_at, sex)
        weights = self.copy_weight.tolist()
        used = [w * chains(*where) for w, chains in zip(weights, self.chains, strict=True) if w > 0]
        return torch.stack(used).sum(0)

    def use_copies(self, used: Sequence[bool]) -> None:
        """Weigh the sets of chains flagged in ``used`` ``(copies,)`` equally, the others 0."""
        flags = torch.tensor(used, dtype=torch.float32, device=self.copy_weight.device)
        if flags.shape != self.copy_weight.shape or not flags.any():
            raise ValueError(f"use_copies needs {self.copies} flags, at least one set, got {list(used)}")
        self.copy_weight.copy_(flags / flags.sum())

    def share_chains(self, chain_of_label: torch.Tensor) -> None:
        """Let labels share chains in every set (:meth:`HiddenStateFilter.share_chains`); ``chain_of_label``
        ``(L,)``: the label whose chain each label reads. Chains no label reads are dropped."""
        for chains in self.chains:
            cast(HiddenStateFilter, chains).share_chains(chain_of_label)

    def cross_evidence_l1(self, copy: int = 0) -> torch.Tensor:
        """``()``: the summed absolute evidence weights of every code on set ``copy``'s chains, except each
        label's own code on the chain that label reads, divided by ``L`` (so that one strength suits label sets
        of any size: the loss is a mean over labels). A chain shared by several labels reads all their codes
        free."""
        chains = cast(HiddenStateFilter, self.chains[copy])
        weight = chains.evidence.view(chains.vocab_size, chains.num_chains, chains.num_states).abs().sum(-1)  # (C, G)
        own = self.label_token_ids
        known = own >= 0
        own_total = weight[own[known], chains.chain_of_label[known]].sum()
        return (weight.sum() - own_total) / chains.num_labels


def _one_set_bundles(state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    """A bundle saved before ``copies`` (session 49) holds one set as ``chains.<name>``: it is set 0, weight 1."""
    head = prefix + "chains."
    old = [k for k in state_dict if k.startswith(head) and not k[len(head) :].split(".")[0].isdigit()]
    for key in old:
        state_dict[head + "0." + key[len(head) :]] = state_dict.pop(key)
    if old and prefix + "copy_weight" not in state_dict:
        state_dict[prefix + "copy_weight"] = torch.ones(1)
