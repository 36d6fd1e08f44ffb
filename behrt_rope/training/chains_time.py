"""How much of fine-tuning's time budget the first training of the deep part leaves to the state path's chains.

``finetune`` spends its budget (``trainer.max_minutes``) in a fixed order: the sparse time path, the first training
of the deep part, the chains (``state_path_fit.py``), maybe a second training. Where the budget binds, the first
training takes all it can plan for and the chains get what is left: that suits a cohort where the deep part and
the sparse time path carry the prediction, and starves one where the chains do (a progression of hidden stages
over many codes: docs/benchmarks.md, "Seventy-first round" and "Seventy-second round"). A fixed share held back
for the chains cannot tell the two apart; this rule asks the data first.

The chains depend on no other part of the model, so their first set can be paired, started from its codes'
record (``state_path_prefit.py``) and fitted one epoch before the deep part trains, then scored alone on the
tuning split (the start alone models the codes' record, not the next visit, and scores about chance: 0.035 macro
AP on a 200-code progression draw whose sparse time path scores 0.152). Where that one epoch already scores at
least what the sparse time path scores alone, the chains carry this cohort and get :data:`RIVAL_TIME_SHARE` of
the budget, the time their first set took included (the rest is held back for them); otherwise nothing is held
back. Either way the chains' fit later goes on from that epoch, so the time it took comes off the first training's
plan rather than the chains'.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from behrt_rope.model.heads import BehrtForMultiLabel
from behrt_rope.training.inference import score_parts
from behrt_rope.training.loaders import SplitData
from behrt_rope.training.state_path_fit import CROSS_EVIDENCE_L1, RECORD_WEIGHT, FirstSet, start_first_set
from behrt_rope.training.tasks import macro_average_precision

log = logging.getLogger("behrt_rope.finetune")

RIVAL_TIME_SHARE = 0.3
"""The share of ``trainer.max_minutes`` held back for the chains when their first set rivals the sparse time path:
216 of 720 seconds gave one set 7 epochs on a 200-code progression screening draw, +0.0073 tuning macro AP
(docs/benchmarks.md, "Seventy-second round")."""

PROBE_PREFIT_SHARE = 0.05
"""The share of the budget the first set's start from its codes' record may take before the first training: run to
convergence it took 205 s on a 200-code progression draw and 359 s on a long dense one (of 720), where the
epoch after it took 16-26 s; the chains' fit later goes on from this start, it is not fitted further."""


@dataclass
class ChainsTime:
    """What the rule decided: ``share`` of the budget held back for the chains, the first set when it was started
    here (None: not, and the chains' fit starts every set itself) and what ``metrics.json`` records."""

    share: float
    first_set: FirstSet | None
    report: dict[str, Any]


def chains_time(
    model: BehrtForMultiLabel,
    train: SplitData,
    tuning: SplitData,
    fixed_share: float | None,
    pair_correlation: float | None,
    prefit_epochs: int,
    seed: int,
    device: torch.device | None = None,
    deadline: float | None = None,
    l1: float = CROSS_EVIDENCE_L1,
    record_weight: float = RECORD_WEIGHT,
    budget_seconds: float | None = None,
) -> ChainsTime:
    """The share of the time budget the first training leaves to ``model``'s chains: ``fixed_share`` when given;
    else :data:`RIVAL_TIME_SHARE` when the chains' first set, started here from its codes' record and fitted one
    epoch (:func:`~behrt_rope.training.state_path_fit.start_first_set`, at ``pair_correlation``,
    ``prefit_epochs``, ``seed``, ``l1`` and ``record_weight``, none of it past ``deadline``, the start at most
    :data:`PROBE_PREFIT_SHARE` of ``budget_seconds``), scores at least the sparse time path's tuning macro AP
    alone, less the share of ``budget_seconds`` (the whole budget; None: none) that the first set already took
    (the chains' share counts it), 0 otherwise. Without chains, tuning samples
    or a sparse time path to compare with, 0 and nothing started. Deterministic (the start and the epoch draw
    from their own generators), so every DDP rank decides alike."""
    if fixed_share is not None:
        return ChainsTime(fixed_share, None, {"share": fixed_share, "chosen_by": "state_path_time_share"})
    if model.state_path is None or model.sparse_time is None or not len(tuning.y):
        reason = "no tuning samples" if model.state_path is not None and model.sparse_time is not None else "no paths"
        return ChainsTime(0.0, None, {"share": 0.0, "chosen_by": reason})
    modes = {name: module.training for name, module in model.named_modules()}
    prefit_seconds = None if budget_seconds is None else PROBE_PREFIT_SHARE * budget_seconds
    first = start_first_set(
        model, train, tuning, pair_correlation, prefit_epochs, seed, device, deadline, l1, record_weight, prefit_seconds
    )
    rows, cuts = tuning.samples.rows, tuning.samples.cuts
    path = score_parts(model, tuning.seqs, rows, cuts, device=device, parts=("path",))["path"]
    for name, module in model.named_modules():  # scoring left it in eval mode; the deep part trains next
        module.training = modes[name]
    path_macro_ap = macro_average_precision(tuning.y, path)
    rivals = first.tuning_macro_ap >= path_macro_ap
    taken = first.seconds / budget_seconds if budget_seconds else 0.0
    share = max(RIVAL_TIME_SHARE - taken, 0.0) if rivals else 0.0
    log.info(
        "finetune: the chains' first set, started from its codes' record and fitted an epoch in %.0f s, scores "
        "tuning macro AP %.4f alone, the sparse time path %.4f: %s",
        first.seconds,
        first.tuning_macro_ap,
        path_macro_ap,
        f"{RIVAL_TIME_SHARE:g} of the time budget for the chains, {share:.3f} held back besides what their first set "
        "took"
        if rivals
        else "nothing held back for the chains",
    )
    report = {
        "share": share,
        "chosen_by": "the chains' first set against the sparse time path",
        "chains_rival": rivals,
        "first_set_tuning_macro_ap": round(first.tuning_macro_ap, 5),
        "sparse_time_path_tuning_macro_ap": round(path_macro_ap, 5),
        "first_set_seconds": round(first.seconds, 1),
    }
    return ChainsTime(share, first, report)
