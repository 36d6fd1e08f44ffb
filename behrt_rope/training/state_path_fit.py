"""Fit the state path (``model/state_path.py``) apart from the deep part, then choose its share of the logit.

After the deep part is trained (and the sparse time path's share set), ``finetune`` trains the state path's
sets of chains alone, one after another, on the same train samples and targets: Adam on their own binary
cross-entropy plus an L1 penalty on cross-code evidence (:meth:`StatePath.cross_evidence_l1`) and, at
:data:`RECORD_WEIGHT`, the negative log-likelihood per visit of their own codes' record (below), an epoch at a
time over length-sorted batches, keeping the weights of the epoch with the best tuning macro AP of the set alone
and stopping :data:`PATIENCE` epochs after it, at :data:`MAX_EPOCHS`, or when the next epoch would overrun the
stage's time budget (sets the budget leaves unfitted get no weight). Their share of the model's logit is 0 (the
model as it was) unless a share of :data:`SHARE_GRID` is clearly better on the tuning split (a paired bootstrap
over its patients), so a cohort where the chains add nothing keeps its model; where the chains alone are not
clearly worse than the model, the reference is an equal mix (:data:`EQUAL_SHARE`) instead of 0. Without a
tuning split nothing could choose either, and the path is not fitted.

The record term (opt-in) keeps each chain a model of its codes' whole record while it learns the next visit. The chains
start from a hidden Markov model of that record (``state_path_prefit.py``), in which a code's evidence on its
chain is its log-odds of being recorded in each state; the next-visit loss alone then moves that evidence, the
moves and the first-visit law wherever they predict the next visit best, and lets go of what every other visit
says. Read the same way throughout the fit, the evidence of a chain's own codes keeps scoring the record
(:meth:`~behrt_rope.model.state_filter.HiddenStateFilter.own_code_log_odds`), and that likelihood joins the loss:
a hybrid of generative and discriminative training of one model, as the learner told the progression structure
(fitted on the record alone) closes the whole gap the chains close 64-87% of (docs/benchmarks.md, "Forty-third
round" and "Sixty-seventh round").
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
from scipy.special import expit
from tqdm.auto import tqdm

from behrt_rope.data.batching import BucketBatchSampler
from behrt_rope.model.heads import BehrtForMultiLabel, multilabel_loss
from behrt_rope.model.state_filter import HiddenStateFilter
from behrt_rope.training.chain_pairs import PAIR_CORRELATION, paired_chains
from behrt_rope.training.clear_gain import ClearChoice, ScoredCandidates
from behrt_rope.training.inference import score_parts
from behrt_rope.training.loaders import SplitData
from behrt_rope.training.state_path_prefit import PREFIT_EPOCHS, emitted_codes, prefit_chains
from behrt_rope.training.tasks import macro_average_precision

log = logging.getLogger("behrt_rope.finetune")

LEARNING_RATE = 0.03
"""Adam's step size for the chains (patients per step: ``BATCH_PATIENTS``)."""
BATCH_PATIENTS = 256
"""Patients per step; each brings every scored visit of its history."""
MAX_EPOCHS = 40
"""Default epochs at most (``finetune`` ``state_path_max_epochs``)."""
PATIENCE = 4
"""Epochs without a better tuning macro AP before the fit stops."""
CROSS_EVIDENCE_L1 = 2e-4
"""Default strength of the L1 penalty on the evidence a code gives the chains of labels it is not the code
of (per label; the loss is a mean over labels): about 3e-6 per weight at 64 labels, where it lifted the
chains' own tuning macro AP on a progression draw from 0.1483 to 0.1530 (docs/benchmarks.md, "Forty-fifth
round")."""
RECORD_WEIGHT = 0.0
"""Default weight of the record term in the chains' loss (``finetune`` ``state_path_record_weight``): the negative
log-likelihood per visit of the chains' own codes' record, beside the next-visit binary cross-entropy (a mean over
labels). Off by default: on screening cohorts' tuning splits (one set of chains alone) 0.05 lifted progression by
+0.0005 macro AP (three seeds, each up; 0.01-1 all +0.0002 to +0.0005) but lowered recurrence_sparse by 0.0023-0.0034
(three seeds) and the clinical cohort by 0.0004 and 0.0055 (two), whose records no small hidden Markov model writes,
at a second pass of the forward algorithm a step (docs/benchmarks.md, "Sixty-seventh round")."""
SHARE_GRID = (0.0, 0.2, 0.35, 0.5, 0.65, 0.8, 0.9, 1.0)
"""The state path's candidate shares of the model's logit; 0 leaves the model as it was, 1 is the chains alone.
0.9 and 1 since session 50: on progression draws the chains alone beat every mix (their logits spread less than
the model's, so even a fifth of the model's sets the ranking of some labels); with them, share chosen on one
half of the tuning patients and scored on the other, +0.0064 / +0.0040 on two progression draws against
+0.0043 / -0.0004 without, the same on a recurrence_sparse and a clinical draw (docs/benchmarks.md,
"Forty-sixth round")."""
EQUAL_SHARE = 0.5
"""The reference share when the chains alone are not clearly worse than the model without them
(:func:`chains_comparable`): two learners of comparable strength and different form, averaged with equal weights,
rather than weights estimated on a few hundred tuning patients (which, on progression draws, kept 0-0.2 where
0.65-1 scored 0.001-0.002 better held out; docs/benchmarks.md, "Fifty-third round")."""


def fit_state_path(
    model: BehrtForMultiLabel,
    train: SplitData,
    tuning: SplitData,
    seconds_left: float | None,
    l1: float = CROSS_EVIDENCE_L1,
    share: float | None = None,
    max_epochs: int = MAX_EPOCHS,
    seed: int = 0,
    progress: bool = False,
    device: torch.device | None = None,
    pair_correlation: float | None = PAIR_CORRELATION,
    choose_share: bool = True,
    prefit_epochs: int = PREFIT_EPOCHS,
    record_weight: float = RECORD_WEIGHT,
    first_set: FirstSet | None = None,
) -> dict[str, Any]:
    """Train ``model.state_path``'s sets of chains one after another and set its share (``share``, or as
    :func:`set_state_path_share` chooses on the tuning split);
    ``seconds_left``: the time budget left (None: no budget), shared by the sets: those it leaves unfitted get no
    weight. Label codes that travel together in the train patients share a chain
    (:func:`~behrt_rope.training.chain_pairs.paired_chains` at ``pair_correlation``; None: each label its own).
    With ``choose_share`` false the share stays 0, for :func:`set_state_path_share` to set once the deep part is
    final, and the chains' tuning macro AP alone (``tuning_macro_ap_alone``) is left to the caller, who scores the
    tuning split once for every part (``training/tuning_logits.py``). Each set starts from a hidden Markov model
    of its label codes' record fitted for at most ``prefit_epochs`` epochs (``training/state_path_prefit.py``;
    0: from its random start), and is fitted with the record term at ``record_weight`` (0: none); ``first_set``:
    the first set's chains already paired and started (:func:`start_first_set`, before the deep part trained),
    which this fit goes on from. Returns what ``metrics.json`` records under ``state_path``. The rest of the
    model is not changed."""
    path = model.state_path
    assert path is not None, "fit_state_path needs a model with a state path (model.state_path)"
    if not len(tuning.y):
        path.set_share(0.0)
        log.info("finetune: state path not fitted: no tuning split to choose its epochs and share")
        return {"fitted": False, "reason": "no tuning split", "share": 0.0}
    device = device or torch.device("cpu")
    started, weights_before = time.monotonic(), path.copy_weight.clone()
    shared = _share_chains(model, train, pair_correlation) if first_set is None else first_set.shared
    deadline = None if seconds_left is None else started + seconds_left
    sets: list[dict[str, Any]] = []
    epoch_seconds = 0.0  # a set's epochs take about as long as the last set's: its first epoch must fit too
    for number in range(path.copies):
        fit = _train(
            model,
            number,
            train,
            tuning,
            deadline,
            epoch_seconds,
            l1,
            max_epochs,
            seed + number,
            progress,
            device,
            prefit_epochs,
            record_weight,
            first_set.fit if number == 0 and first_set is not None else None,
        )
        best, epoch_seconds = fit.best, fit.epoch_seconds
        sets.append(
            {
                "epochs": fit.epochs,
                "best_epoch": best.epoch,
                "stopped_by": fit.stopped_by,
                "tuning_macro_ap": best.macro_ap,
                "prefit": fit.prefit,
            }
        )
        if best.weights is None:
            break
        path.chains[number].load_state_dict(best.weights)
    fitted = [s["best_epoch"] >= 0 for s in sets] + [False] * (path.copies - len(sets))
    report: dict[str, Any] = {
        "fitted": any(fitted),
        "sets_fitted": sum(fitted),
        "epochs": sum(s["epochs"] for s in sets),
        "stopped_by": sets[-1]["stopped_by"],
        "sets": [{**s, "tuning_macro_ap": round(s["tuning_macro_ap"], 5)} for s in sets],
        "cross_evidence_l1": l1,
        "record_weight": record_weight,
        "shared_chains": shared,
    }
    if not any(fitted):
        path.copy_weight.copy_(weights_before)
        path.set_share(0.0)
        log.info("finetune: state path not fitted: %s", report["stopped_by"])
        return {**report, "share": 0.0, "seconds": round(time.monotonic() - started, 1)}
    path.use_copies(fitted)
    if choose_share:
        report["tuning_macro_ap_alone"] = round(_states_macro_ap(model, tuning, device), 5)
        report.update(_choose_share(model, tuning, share, device))
    else:
        report["share"] = 0.0
    report["seconds"] = round(time.monotonic() - started, 1)
    log.info(
        "finetune: state path fitted in %.0f s (%d of %d sets, %d epochs), share %.2f",
        report["seconds"],
        report["sets_fitted"],
        path.copies,
        report["epochs"],
        report["share"],
    )
    return report


def _share_chains(model: BehrtForMultiLabel, train: SplitData, pair_correlation: float | None) -> int:
    """Pair the state path's labels whose codes travel together (None: none); returns the chains shared."""
    path = model.state_path
    assert path is not None
    label_codes = path.label_token_ids.cpu().numpy()
    if pair_correlation is None:
        chains = torch.arange(len(label_codes))
    else:
        chains = torch.from_numpy(paired_chains(train.seqs, label_codes, pair_correlation))
    path.share_chains(chains)
    shared = len(chains) - len(torch.unique(chains))
    if shared:
        log.info("finetune: state path: %d pairs of label codes share a chain", shared)
    return shared


@dataclass
class FirstSet:
    """The state path's first set of chains, paired, started from its codes' record and fitted one epoch before
    the deep part trains (:func:`start_first_set`): the chains shared, the set's fit so far, its tuning macro AP
    alone after that epoch (-1: the budget left no epoch) and the seconds it took."""

    shared: int
    fit: _SetFit
    seconds: float

    @property
    def tuning_macro_ap(self) -> float:
        return self.fit.best.macro_ap


def start_first_set(
    model: BehrtForMultiLabel,
    train: SplitData,
    tuning: SplitData,
    pair_correlation: float | None = PAIR_CORRELATION,
    prefit_epochs: int = PREFIT_EPOCHS,
    seed: int = 0,
    device: torch.device | None = None,
    deadline: float | None = None,
    l1: float = CROSS_EVIDENCE_L1,
    record_weight: float = RECORD_WEIGHT,
    prefit_seconds: float | None = None,
) -> FirstSet:
    """Pair ``model.state_path``'s label codes (as :func:`fit_state_path` would), start its first set of chains
    from their codes' record (``state_path_prefit.py``, at most ``prefit_epochs`` epochs and ``prefit_seconds``
    seconds, None: until it converges) and fit it one epoch (as :func:`fit_state_path` would, at ``l1`` and
    ``record_weight``), none of it past ``deadline`` (``time.monotonic()``), scored alone on ``tuning`` (which
    must hold samples). The chains depend on no other part of the model, so this can run before the deep part
    trains: ``finetune`` uses the score to tell whether the chains will carry the cohort (the start alone cannot:
    it models the codes' record, not the next visit, and scores about chance). Leaves the chains frozen (the deep
    part's optimizer does not see them), the path's share at 0 and its sets' weights as they were;
    :func:`fit_state_path` with the returned :class:`FirstSet` goes on from here."""
    path = model.state_path
    assert path is not None, "start_first_set needs a model with a state path (model.state_path)"
    assert len(tuning.y), "start_first_set scores the chains on the tuning split, which has no samples"
    device = device or torch.device("cpu")
    started, weights_before = time.monotonic(), path.copy_weight.clone()
    shared = _share_chains(model, train, pair_correlation)
    prefit_deadline = None if prefit_seconds is None else started + prefit_seconds
    fit = _train(
        model,
        0,
        train,
        tuning,
        deadline,
        0.0,
        l1,
        1,
        seed,
        False,
        device,
        prefit_epochs,
        record_weight,
        None,
        prefit_deadline,
    )
    path.copy_weight.copy_(weights_before)
    return FirstSet(shared, fit, time.monotonic() - started)


@dataclass
class _Best:
    macro_ap: float = -1.0
    epoch: int = -1
    weights: dict[str, torch.Tensor] | None = None


@dataclass
class _SetFit:
    best: _Best
    epochs: int
    stopped_by: str
    epoch_seconds: float
    prefit: dict[str, Any] | None = None


def _train(
    model: BehrtForMultiLabel,
    number: int,
    train: SplitData,
    tuning: SplitData,
    deadline: float | None,
    epoch_seconds: float,
    l1: float,
    max_epochs: int,
    seed: int,
    progress: bool,
    device: torch.device,
    prefit_epochs: int = 0,
    record_weight: float = 0.0,
    so_far: _SetFit | None = None,
    prefit_deadline: float | None = None,
) -> _SetFit:
    """Epochs of Adam on set ``number`` of the chains alone (the path scores it alone meanwhile), none that would
    end past ``deadline`` (``time.monotonic()``; None: no budget), ``epoch_seconds`` the time an epoch is expected
    to take until one has run here; returns the best epoch's weights, epochs run, why it stopped and the
    seconds an epoch took. With ``prefit_epochs``, the set first starts from its codes' hidden Markov model
    (:func:`~behrt_rope.training.state_path_prefit.prefit_chains`). With ``so_far`` (the set's fit up to now,
    its chains as they stand), the fit goes on from it: no new start, its epochs counted on and its best kept
    unless beaten (Adam's moments start afresh). ``prefit_deadline``: an earlier end for the start alone."""
    path = model.state_path
    assert path is not None
    chains = path.chains[number]
    # Length-sorted batches (shuffled in order): a step runs the chains over its longest history's visits, so
    # random batches of a cohort with a few long histories would spend most of it on padding.
    lengths = train.dataset.lengths  # type: ignore[attr-defined]
    sampler = BucketBatchSampler(lengths, BATCH_PATIENTS, bucket_size=len(lengths), seed=seed)  # one global sort
    path.to(device).use_copies([c == number for c in range(path.copies)])
    chains.train().requires_grad_(True)
    prefit, chain_filter = None, cast(HiddenStateFilter, chains)
    codes = emitted_codes(chain_filter, path.label_token_ids)  # (G, J) each chain's own label codes
    if so_far is not None:
        prefit, epoch_seconds = so_far.prefit, so_far.epoch_seconds
    elif prefit_epochs > 0:
        name = f"state path set {number}'s chains"
        ends = deadline if prefit_deadline is None else min(prefit_deadline, deadline or prefit_deadline)
        prefit = prefit_chains(chain_filter, path.label_token_ids, train, prefit_epochs, seed, ends, device, name=name)
    optimizer = torch.optim.Adam(chains.parameters(), lr=LEARNING_RATE)
    started, stop = time.monotonic(), f"state_path_max_epochs ({max_epochs})"
    best, first = (so_far.best, so_far.epochs) if so_far is not None else (_Best(), 0)
    epoch = first
    for epoch in range(first, max_epochs):
        if deadline is not None and time.monotonic() + epoch_seconds > deadline:
            stop = "the time budget (trainer.max_minutes)"
            break
        if epoch - best.epoch > PATIENCE and best.epoch >= 0:
            stop = f"no better tuning macro AP for {PATIENCE} epochs"
            break
        sampler.set_epoch(epoch)
        steps = tqdm(
            sampler.batches(), desc=f"state path set {number} epoch {epoch}", disable=not progress, unit="step"
        )
        for items in steps:
            batch = train.collate([train.dataset[int(i)] for i in items])
            batch = {k: v.to(device) for k, v in batch.items()}
            logits = chains(
                batch["token_ids"], batch["visit_index"], batch["ages"], batch["score_at"], batch.get("sex")
            )
            loss = multilabel_loss(logits, batch["targets"]) + l1 * path.cross_evidence_l1(number)
            if record_weight > 0:
                loss = loss + record_weight * _record_nll(chain_filter, batch, codes)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        chains.eval()
        macro_ap = _states_macro_ap(model, tuning, device)
        chains.train()
        if macro_ap > best.macro_ap:
            best = _Best(macro_ap, epoch, copy.deepcopy(chains.state_dict()))
        epoch_seconds = (time.monotonic() - started) / (epoch + 1 - first)
        log.info(
            "finetune: state path set %d epoch %d: tuning macro AP %.4f alone (%.1f s an epoch)",
            number,
            epoch,
            macro_ap,
            epoch_seconds,
        )
    else:
        epoch = max_epochs
    chains.eval().requires_grad_(False)
    return _SetFit(best, epoch, stop, epoch_seconds, prefit)


def _choose_share(
    model: BehrtForMultiLabel, tuning: SplitData, share: float | None, device: torch.device
) -> dict[str, Any]:
    """:func:`set_state_path_share` on ``tuning``, scored here (the model's logit without the chains, and theirs)."""
    assert model.state_path is not None
    model.state_path.set_share(0.0)
    rows, cuts = tuning.samples.rows, tuning.samples.cuts
    logits = score_parts(model, tuning.seqs, rows, cuts, device=device, parts=("model", "states"), logits=True)
    return set_state_path_share(model, share, tuning.y, rows, logits["model"], logits["states"])


def _states_macro_ap(model: BehrtForMultiLabel, tuning: SplitData, device: torch.device) -> float:
    """Tuning macro AP of the state path alone, as its ``copy_weight`` stands."""
    states = score_parts(model, tuning.seqs, tuning.samples.rows, tuning.samples.cuts, device=device, parts=("states",))
    return macro_average_precision(tuning.y, states["states"])


def set_state_path_share(
    model: BehrtForMultiLabel,
    share: float | None,
    y: np.ndarray,
    patients: np.ndarray,
    base: np.ndarray | None = None,
    states: np.ndarray | None = None,
) -> dict[str, Any]:
    """Set the state path's share: ``share``, or the reference share unless another of :data:`SHARE_GRID` is
    clearly better on the tuning split (:func:`~behrt_rope.training.clear_gain.choose_clearly_better`; ``y`` its
    ``(N, L)`` targets, ``patients`` ``(N,)`` each sample's patient, ``base`` and ``states`` the ``(N, L)`` logits
    there of the model without the state path and of the state path alone). The reference is
    :data:`EQUAL_SHARE` when the chains alone are not clearly worse than the model without them
    (:func:`chains_comparable`), else 0. Macro AP ranks each label's samples only, so a path that adds nothing
    can still win the point estimates by noise while its share pulls the model's logits toward its own (a
    calibration cost AP does not see): hence 0 unless the chains hold their own."""
    assert model.state_path is not None
    if share is not None:
        model.state_path.set_share(share)
        return {"share": share}
    if base is None or states is None:
        raise ValueError("choosing the state path's share needs the tuning logits of the model and the state path")
    model.state_path.set_share(0.0)
    mixes = {w: expit((1 - w) * base + w * states) for w in SHARE_GRID}  # (N, L) probabilities
    scored = ScoredCandidates.score(y, mixes, patients)  # once for both references
    against_model = scored.choose(0.0)
    comparable = chains_comparable(against_model)
    reference = EQUAL_SHARE if comparable else 0.0
    choice = scored.choose(reference) if comparable else against_model
    model.state_path.set_share(choice.chosen)
    log.info(
        "finetune: state path share %g (the chains alone %s the model without them on the tuning split, so the "
        "reference is %g; macro AP by share: %s)",
        choice.chosen,
        "hold their own against" if comparable else "are clearly worse than",
        reference,
        against_model.macro_ap,
    )
    report: dict[str, Any] = {
        "share": choice.chosen,
        "tuning_macro_ap_by_share": against_model.macro_ap,
        "chains_comparable": comparable,
        "reference_share": reference,
        "over_share_0": against_model.intervals(),
    }
    if comparable:
        report[f"over_share_{EQUAL_SHARE:g}"] = choice.intervals()
    return report


def chains_comparable(against_model: ClearChoice) -> bool:
    """Whether the chains alone (share 1) are *not clearly worse* than the model without them (share 0): the
    upper end of their paired :data:`~behrt_rope.training.clear_gain.CHOICE_LEVEL` interval of the tuning macro AP
    difference, in ``against_model`` (candidates scored against share 0), is at least 0.

    >>> chains_comparable(ClearChoice(0.0, {0.0: 0.14, 1.0: 0.142}, {1.0: (0.002, -0.002, 0.006)}))
    True
    >>> chains_comparable(ClearChoice(0.0, {0.0: 0.26, 1.0: 0.19}, {1.0: (-0.075, -0.09, -0.06)}))
    False
    """
    return against_model.over_reference[1.0][2] >= 0.0


def _record_nll(chains: HiddenStateFilter, batch: dict[str, torch.Tensor], codes: torch.Tensor) -> torch.Tensor:
    """``()`` the negative log-likelihood per visit (nats) of the batch's record of each chain's own ``codes``
    ``(G, J)``, their evidence read as their log-odds of being recorded in each state."""
    loglik, visits = chains.code_log_likelihood(
        batch["token_ids"],
        batch["visit_index"],
        batch["ages"],
        codes,
        chains.own_code_log_odds(codes),
        batch.get("sex"),
    )
    return -loglik / visits.clamp(min=1)
