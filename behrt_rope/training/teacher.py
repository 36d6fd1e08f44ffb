"""The distillation teacher of the deep part: the frozen paths' logits, the state path's share chosen on tuning.

``finetune`` distills the frozen paths into the deep part when they lead it on the tuning split
(``training/distillation_choice.py``). The sparse time path alone was that teacher; on histories whose codes
follow hidden stages the state path's chains predict better than both (docs/benchmarks.md, "Forty-eighth
round"), and a deep part distilled from them learns what they found, from the same raw token streams. The
teacher is ``(1 - t) * sparse time path + t * state path`` in logits, ``t`` on :data:`SHARE_GRID` and 0 (the
sparse time path alone) unless another share is clearly better on the tuning split
(:func:`~behrt_rope.training.clear_gain.choose_clearly_better`). Its logits are computed once per split, so a
training step costs what it cost with the sparse time path alone.

Shapes: ``N`` samples of a split, ``L`` labels.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from scipy.special import expit

from behrt_rope.model.heads import BehrtForMultiLabel
from behrt_rope.training.clear_gain import choose_clearly_better
from behrt_rope.training.inference import Part, score_parts
from behrt_rope.training.loaders import SplitData
from behrt_rope.training.state_path_fit import SHARE_GRID
from behrt_rope.training.tuning_logits import TuningLogits

log = logging.getLogger("behrt_rope.finetune")


@dataclass(frozen=True, eq=False)
class Teacher:
    """The teacher's state path share ``t``, what ``metrics.json`` records of its choice and its ``(N, L)``
    probabilities on the tuning split it was chosen on."""

    share: float
    report: dict[str, Any]
    tuning_probs: np.ndarray

    def logits(self, model: BehrtForMultiLabel, split: SplitData, device: torch.device) -> np.ndarray:
        """``(N, L)`` float32 teacher logits of ``split``'s samples, in their order."""
        path, states = _path_logits(model, split, device, with_states=self.share > 0)
        return path if states is None else ((1 - self.share) * path + self.share * states).astype(np.float32)


def choose_teacher(tuning: TuningLogits, with_states: bool) -> Teacher:
    """The teacher from the tuning split's logits of the frozen paths: the sparse time path and, ``with_states``
    (the state path fitted and scored in ``tuning``), the state path at the share chosen on them."""
    path, states = tuning.path, tuning.states if with_states else None
    if path is None:
        raise ValueError("the distillation teacher needs the sparse time path's tuning logits (model.sparse_time)")
    if states is None or not len(tuning.y):
        return Teacher(0.0, {"state_path_share": 0.0}, expit(path))
    mixes = {t: expit((1 - t) * path + t * states) for t in SHARE_GRID}
    choice = choose_clearly_better(tuning.y, mixes, tuning.patients, reference=0.0)
    log.info(
        "finetune: distillation teacher: sparse time path with the state path at share %g (tuning macro AP %.4f; "
        "the sparse time path alone %.4f)",
        choice.chosen,
        choice.macro_ap[choice.chosen],
        choice.macro_ap[0.0],
    )
    report = {
        "state_path_share": choice.chosen,
        "tuning_macro_ap_by_share": choice.macro_ap,
        "over_share_0": choice.intervals(),
    }
    return Teacher(choice.chosen, report, mixes[choice.chosen])


def _path_logits(
    model: BehrtForMultiLabel, split: SplitData, device: torch.device, with_states: bool
) -> tuple[np.ndarray, np.ndarray | None]:
    """``(N, L)`` float32 logits of the sparse time path and (``with_states``) of the state path."""
    parts: tuple[Part, ...] = ("path", "states") if with_states else ("path",)
    samples = split.samples
    logits = score_parts(model, split.seqs, samples.rows, samples.cuts, device=device, parts=parts, logits=True)
    return logits["path"], logits.get("states")
