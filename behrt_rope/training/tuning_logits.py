"""The tuning split's logits of each part of a fine-tuned model, scored once for every choice made after training.

After the deep part's training ``finetune`` chooses on the tuning split: the distillation teacher
(:mod:`~behrt_rope.training.teacher`), whether that teacher leads the deep part and which run to keep
(:mod:`~behrt_rope.training.distillation_choice`), the sparse time path's share and the state path's share; then it
reports the kept model's tuning macro AP and loss. Each of these is a function of the parts' logits, and none of
them changes a part: the sparse time path is frozen once fitted, the chains once fitted, and each run's deep part
once trained. So one scoring pass over the tuning split per trained run serves them all. Scoring each choice on its
own (five passes and a validation loop) took about two minutes on long histories on 2 CPU cores, outside the
trainings' time budget (docs/benchmarks.md, "Fiftieth round").

Shapes: ``N`` tuning samples, ``L`` labels; logits are float32.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from behrt_rope.model.heads import BehrtForMultiLabel
from behrt_rope.training.inference import Part, score_parts
from behrt_rope.training.loaders import SplitData
from behrt_rope.training.tasks import macro_average_precision


@dataclass
class TuningLogits:
    """The tuning split's targets ``y`` ``(N, L)``, each sample's patient ``(N,)`` and ``(N, L)`` logits: each
    trained run's deep part (by its distillation weight), the sparse time path's and the state path's (None
    without the part, or for the chains when they were not fitted)."""

    y: np.ndarray
    patients: np.ndarray
    path: np.ndarray | None
    states: np.ndarray | None
    deep: dict[float, np.ndarray] = field(default_factory=dict)

    @classmethod
    def score(
        cls, model: BehrtForMultiLabel, tuning: SplitData, device: torch.device, weight: float, with_states: bool
    ) -> TuningLogits:
        """One pass over ``tuning``: ``model``'s deep part (stored under ``weight``), its sparse time path (when
        it has one) and, ``with_states``, its state path."""
        parts: list[Part] = ["deep"]
        if model.sparse_time is not None:
            parts.append("path")
        if with_states and model.state_path is not None:
            parts.append("states")
        logits = _logits(model, tuning, device, tuple(parts))
        return cls(tuning.y, tuning.samples.rows, logits.get("path"), logits.get("states"), {weight: logits["deep"]})

    def add_run(self, model: BehrtForMultiLabel, tuning: SplitData, device: torch.device, weight: float) -> None:
        """Score the deep part of the run trained at ``weight`` (its frozen paths are the first run's)."""
        if weight not in self.deep:
            self.deep[weight] = _logits(model, tuning, device, ("deep",))["deep"]

    def model_logits(self, model: BehrtForMultiLabel, weight: float) -> np.ndarray:
        """``(N, L)`` logits of the model as its shares now stand, its deep part the run at ``weight``'s (mixed
        on the model's device, where its shares are)."""
        device = model.classifier.weight.device

        def tensor(part: np.ndarray | None) -> torch.Tensor | None:
            return None if part is None else torch.from_numpy(part).to(device)

        deep = tensor(self.deep[weight])
        assert deep is not None
        return model.mix_logits(deep, tensor(self.path), tensor(self.states)).cpu().numpy()

    def report(self, model: BehrtForMultiLabel, weight: float, pos_weight: torch.Tensor | None) -> dict[str, float]:
        """The model's tuning macro AP and loss (binary cross-entropy, ``pos_weight`` ``(L,)`` on positives,
        averaged over samples and labels: what a validation epoch logs), rounded to 5 digits."""
        logits = torch.from_numpy(self.model_logits(model, weight))
        y = torch.from_numpy(np.asarray(self.y, dtype=np.float32))
        weights = None if pos_weight is None else pos_weight.detach().float().cpu()
        loss = F.binary_cross_entropy_with_logits(logits, y, pos_weight=weights)
        macro_ap = macro_average_precision(self.y, torch.sigmoid(logits).numpy())
        return {"tuning_macro_ap": round(float(macro_ap), 5), "tuning_loss": round(float(loss), 5)}


def _logits(
    model: BehrtForMultiLabel, tuning: SplitData, device: torch.device, parts: tuple[Part, ...]
) -> dict[Part, np.ndarray]:
    """``{part: (N, L) float32 logits}`` of ``parts`` on ``tuning``'s samples, in one pass."""
    samples = tuning.samples
    return score_parts(model, tuning.seqs, samples.rows, samples.cuts, device=device, parts=parts, logits=True)
