"""Fit the state path (``model/state_path.py``) apart from the deep part, then choose its share of the logit.

After the deep part is trained (and the sparse time path's share set), ``finetune`` trains the state path's
chains alone, on the same train samples and targets: Adam on their own binary cross-entropy plus an L1 penalty
on cross-code evidence (:meth:`StatePath.cross_evidence_l1`), an epoch at a time, keeping the weights of the
epoch with the best tuning macro AP of the chains alone and stopping :data:`PATIENCE` epochs after it, at
:data:`MAX_EPOCHS`, or when the next epoch would overrun the stage's time budget. Their share of the model's
logit is then the best of :data:`SHARE_GRID` on the tuning split, 0 (the model as it was) included, so a
cohort where the chains add nothing keeps its model. Without a tuning split nothing could choose either, and
the path is not fitted.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from behrt_rope.data.batching import BucketBatchSampler
from behrt_rope.model.heads import BehrtForMultiLabel, multilabel_loss
from behrt_rope.model.state_path import StatePath
from behrt_rope.training.inference import score_parts
from behrt_rope.training.loaders import SplitData
from behrt_rope.training.sparse_time_fit import logit
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
SHARE_GRID = (0.0, 0.2, 0.35, 0.5, 0.65, 0.8)
"""The state path's candidate shares of the model's logit; 0 leaves the model as it was."""


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
) -> dict[str, Any]:
    """Train ``model.state_path`` and set its share (``share``, or the best of :data:`SHARE_GRID` on the tuning
    split); ``seconds_left``: the time budget left (None: no budget). Returns what ``metrics.json`` records
    under ``state_path``. The rest of the model is not changed."""
    path = model.state_path
    assert path is not None, "fit_state_path needs a model with a state path (model.state_path)"
    if not len(tuning.y):
        path.set_share(0.0)
        log.info("finetune: state path not fitted: no tuning split to choose its epochs and share")
        return {"fitted": False, "reason": "no tuning split", "share": 0.0}
    device = device or torch.device("cpu")
    started = time.monotonic()
    best, epochs, stop = _train(path, train, tuning, model, seconds_left, l1, max_epochs, seed, progress, device)
    report: dict[str, Any] = {
        "fitted": best.epoch >= 0,
        "epochs": epochs,
        "best_epoch": best.epoch,
        "stopped_by": stop,
        "tuning_macro_ap_alone": round(best.macro_ap, 5),
        "cross_evidence_l1": l1,
    }
    if best.weights is None:
        path.set_share(0.0)
        log.info("finetune: state path not fitted: %s", stop)
        return {**report, "share": 0.0, "seconds": round(time.monotonic() - started, 1)}
    path.load_state_dict(best.weights)
    report.update(_set_share(model, tuning, share, device))
    report["seconds"] = round(time.monotonic() - started, 1)
    log.info(
        "finetune: state path fitted in %.0f s (%d epochs, best %d: tuning macro AP %.4f alone), share %.2f",
        report["seconds"],
        epochs,
        best.epoch,
        best.macro_ap,
        report["share"],
    )
    return report


@dataclass
class _Best:
    macro_ap: float = -1.0
    epoch: int = -1
    weights: dict[str, torch.Tensor] | None = None


def _train(
    path: StatePath,
    train: SplitData,
    tuning: SplitData,
    model: BehrtForMultiLabel,
    seconds_left: float | None,
    l1: float,
    max_epochs: int,
    seed: int,
    progress: bool,
    device: torch.device,
) -> tuple[_Best, int, str]:
    """Epochs of Adam on the chains alone; returns the best epoch's weights, epochs run and why it stopped."""
    # Length-sorted batches (shuffled in order): a step runs the chains over its longest history's visits, so
    # random batches of a cohort with a few long histories would spend most of it on padding.
    lengths = train.dataset.lengths  # type: ignore[attr-defined]
    sampler = BucketBatchSampler(lengths, BATCH_PATIENTS, bucket_size=len(lengths), seed=seed)  # one global sort
    path.to(device).train().requires_grad_(True)
    optimizer = torch.optim.Adam(path.parameters(), lr=LEARNING_RATE)
    started, best, epoch_seconds, stop = time.monotonic(), _Best(), 0.0, f"state_path_max_epochs ({max_epochs})"
    epoch = 0
    for epoch in range(max_epochs):
        elapsed = time.monotonic() - started
        if seconds_left is not None and elapsed + epoch_seconds > seconds_left:
            stop = "the time budget (trainer.max_minutes)"
            break
        if epoch - best.epoch > PATIENCE and best.epoch >= 0:
            stop = f"no better tuning macro AP for {PATIENCE} epochs"
            break
        sampler.set_epoch(epoch)
        for items in tqdm(sampler.batches(), desc=f"state path epoch {epoch}", disable=not progress, unit="step"):
            batch = train.collate([train.dataset[int(i)] for i in items])
            batch = {k: v.to(device) for k, v in batch.items()}
            logits = path(batch["token_ids"], batch["visit_index"], batch["ages"], batch["score_at"], batch.get("sex"))
            loss = multilabel_loss(logits, batch["targets"]) + l1 * path.cross_evidence_l1()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        path.eval()
        states = score_parts(
            model, tuning.seqs, tuning.samples.rows, tuning.samples.cuts, device=device, parts=("states",)
        )
        path.train()
        macro_ap = macro_average_precision(tuning.y, states["states"])
        if macro_ap > best.macro_ap:
            best = _Best(macro_ap, epoch, copy.deepcopy(path.state_dict()))
        epoch_seconds = (time.monotonic() - started) / (epoch + 1)
        log.info(
            "finetune: state path epoch %d: tuning macro AP %.4f alone (%.1f s an epoch)",
            epoch,
            macro_ap,
            epoch_seconds,
        )
    else:
        epoch = max_epochs
    path.eval().requires_grad_(False)
    return best, epoch, stop


def _set_share(
    model: BehrtForMultiLabel, tuning: SplitData, share: float | None, device: torch.device
) -> dict[str, Any]:
    """Set the state path's share: ``share``, or the best of :data:`SHARE_GRID` by tuning macro AP (ties: the
    smaller share)."""
    assert model.state_path is not None
    if share is not None:
        model.state_path.set_share(share)
        return {"share": share}
    model.state_path.set_share(0.0)
    probs = score_parts(
        model, tuning.seqs, tuning.samples.rows, tuning.samples.cuts, device=device, parts=("model", "states")
    )
    base, states = logit(probs["model"]), logit(probs["states"])
    scores = {w: round(macro_average_precision(tuning.y, (1 - w) * base + w * states), 5) for w in SHARE_GRID}
    chosen = max(scores, key=lambda w: (scores[w], -w))
    model.state_path.set_share(chosen)
    return {"share": chosen, "tuning_macro_ap_by_share": scores}
