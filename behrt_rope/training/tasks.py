"""Lightning modules: masked-language pre-training and multi-label fine-tuning.

Lightning appears only in this layer; the model code imports torch alone.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from sklearn.metrics import average_precision_score
from torch.nn import functional as F

from behrt_rope.data.batching import model_inputs
from behrt_rope.model.config import ModelConfig
from behrt_rope.model.heads import BehrtForMaskedLM, BehrtForMultiLabel, multilabel_loss
from behrt_rope.training.config import TrainerConfig
from behrt_rope.training.optim import build_optimizer


def batch_key(batch: dict[str, torch.Tensor]) -> float:
    """The smallest dataset index in the batch (-1 when the batch carries no ``index``).

    Batches of one epoch partition the dataset, so the key identifies a batch; a batch that DDP sharding
    repeats (see ``BucketBatchSampler``) has the key of its original, and evaluation drops it.
    """
    index = batch.get("index")
    return float(index.min()) if index is not None and index.numel() else -1.0


def first_occurrences(keys: torch.Tensor) -> torch.Tensor:
    """Bool mask over ``keys`` (N,): True at the first occurrence of each key; negative keys are always kept.

    >>> first_occurrences(torch.tensor([3.0, 0.0, 3.0, -1.0, -1.0])).tolist()
    [True, True, False, True, True]
    """
    keep = torch.ones(len(keys), dtype=torch.bool, device=keys.device)
    seen: set[float] = set()
    for i, key in enumerate(keys.tolist()):
        if key >= 0:
            keep[i] = key not in seen
            seen.add(key)
    return keep


class _Task(pl.LightningModule):
    """Shared optimiser set-up and padding bookkeeping."""

    def __init__(self, model_config: ModelConfig, trainer_config: TrainerConfig) -> None:
        super().__init__()
        self.model_config = model_config
        self.trainer_config = trainer_config
        self._real_tokens = 0
        self._slots = 0

    def configure_optimizers(self) -> Any:
        total = int(self.trainer.estimated_stepping_batches)
        optimizer, scheduler = build_optimizer(self, self.trainer_config, max(total, 1))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _gather_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``(n_rank, ...)`` rows, in rank order; ranks may hold different counts.

        ``all_gather`` needs equal shapes, so the rows are padded to the largest count and trimmed after.
        """
        if self.trainer.world_size == 1:
            return rows
        counts = self.all_gather(torch.tensor(len(rows), device=rows.device))
        assert isinstance(counts, torch.Tensor)
        counts = counts.reshape(-1)  # (world,)
        longest = int(counts.max())
        padded = rows.new_zeros((longest, *rows.shape[1:]))
        padded[: len(rows)] = rows
        gathered = self.all_gather(padded)  # (world, longest, ...)
        assert isinstance(gathered, torch.Tensor)
        return torch.cat([gathered[r, : int(n)] for r, n in enumerate(counts.tolist())])

    def _count_padding(self, batch: dict[str, torch.Tensor]) -> None:
        mask = batch["attention_mask"]
        self._real_tokens += int(mask.sum())
        self._slots += mask.numel()

    def on_train_epoch_end(self) -> None:
        if self._slots:
            self.log("train/padding_share", 1.0 - self._real_tokens / self._slots, sync_dist=True)
            self.log("train/real_tokens", float(self._real_tokens), reduce_fx="sum", sync_dist=True)
        self._real_tokens = self._slots = 0


class MaskedLMTask(_Task):
    """BEHRT's masked-language objective; validation reports loss, top-1 precision and top-5 recall."""

    def __init__(self, model_config: ModelConfig, trainer_config: TrainerConfig) -> None:
        super().__init__(model_config, trainer_config)
        self.model = BehrtForMaskedLM(model_config)
        self._val: list[torch.Tensor] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        out = self.model(**model_inputs(batch), labels=batch["labels"])
        self._count_padding(batch)
        self.log("train/loss", out.loss, prog_bar=True, batch_size=batch["token_ids"].shape[0])
        return out.loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        """Per batch: [key, summed loss, top-1 hits, top-5 hits, masked tokens] (a batch with none too)."""
        out = self.model(**model_inputs(batch), labels=batch["labels"])
        n = out.labels.numel()
        top5 = out.logits.topk(min(5, out.logits.shape[-1]), dim=-1).indices  # (N, 5)
        hits1 = (top5[:, 0] == out.labels).sum()
        hits5 = (top5 == out.labels[:, None]).any(dim=-1).sum()
        device = out.loss.device
        self._val.append(
            torch.stack(
                [
                    torch.tensor(batch_key(batch), device=device),
                    out.loss.detach().float() * n,
                    hits1.float(),
                    hits5.float(),
                    torch.tensor(float(n), device=device),
                ]
            )
        )

    def on_validation_epoch_end(self) -> None:
        """Sum the batches of all ranks, each batch once: a batch repeated to even out DDP shards is dropped."""
        rows = torch.stack(self._val) if self._val else torch.zeros(0, 5, device=self.device)  # (batches, 5)
        self._val.clear()
        rows = self._gather_rows(rows)
        totals = rows[first_occurrences(rows[:, 0])][:, 1:].sum(0)  # (4,)
        n = max(float(totals[3]), 1.0)
        # identical on every rank after the gather; sync_dist only averages equal values (and keeps Lightning quiet)
        self.log("val/loss", totals[0] / n, prog_bar=True, sync_dist=True)
        self.log("val/top1_precision", totals[1] / n, sync_dist=True)
        self.log("val/top5_recall", totals[2] / n, sync_dist=True)
        self.log("val/masked_tokens", totals[3], sync_dist=True)


class MultiLabelTask(_Task):
    """Multi-label diagnosis prediction with BCE; validation reports loss and macro average precision."""

    pos_weight: torch.Tensor | None  # (L,) buffer, or None

    def __init__(
        self,
        model_config: ModelConfig,
        trainer_config: TrainerConfig,
        num_labels: int,
        pooling: str = "visit",
        pos_weight: list[float] | None = None,
        label_token_ids: list[int] | None = None,
        path_distillation: float = 0.0,
    ) -> None:
        super().__init__(model_config, trainer_config)
        self.model = BehrtForMultiLabel(model_config, num_labels, pooling, label_token_ids)  # type: ignore[arg-type]
        if not 0.0 <= path_distillation <= 1.0:
            raise ValueError(f"path_distillation must lie in [0, 1], got {path_distillation}")
        # the path's probabilities as soft targets of the deep part; nothing to learn from without the path
        self.path_distillation = path_distillation if self.model.sparse_time is not None else 0.0
        self.register_buffer(
            "pos_weight", torch.tensor(pos_weight, dtype=torch.float32) if pos_weight is not None else None
        )
        self._rows: list[torch.Tensor] = []  # validation, per sample (see validation_step)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Logits (B, L), or (N, L) at the batch's ``score_at`` positions with visit pooling."""
        return self.model(**model_inputs(batch), score_at=batch.get("score_at"))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        # the trained parts learn on their own logits; the frozen sparse time path joins them at scoring
        inputs = model_inputs(batch)
        logits = self.model.deep_logits(**inputs, score_at=batch.get("score_at"))
        loss = multilabel_loss(logits, batch["targets"], self.pos_weight)
        if self.path_distillation > 0:
            teacher = batch.get("teacher")  # the frozen paths' logits, computed once (training/teacher.py)
            if teacher is None:
                with torch.no_grad():
                    teacher = self.model.path_logits(
                        inputs["token_ids"], inputs["visit_index"], inputs["ages"], batch["score_at"], inputs.get("sex")
                    )
            loss = distillation_loss(loss, logits, teacher, self.path_distillation)
        self._count_padding(batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=batch["token_ids"].shape[0])
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        """Per sample: [batch key, rank, batch number, loss, L probabilities, L targets]."""
        logits = self(batch).float()  # (B, L)
        targets = batch["targets"].float()  # (B, L)
        weight = None if self.pos_weight is None else self.pos_weight.float()
        # per-sample mean over labels; the mean of these is multilabel_loss (every sample has L terms)
        losses = F.binary_cross_entropy_with_logits(logits, targets, pos_weight=weight, reduction="none").mean(1)
        ident = torch.tensor([batch_key(batch), float(self.global_rank), float(len(self._rows))], device=logits.device)
        self._rows.append(
            torch.cat([ident.expand(len(logits), 3), losses[:, None], torch.sigmoid(logits), targets], dim=1).detach()
        )

    def on_validation_epoch_end(self) -> None:
        """Loss and macro AP over every rank's samples, each sample once (DDP repeats dropped)."""
        labels = self.model.num_labels
        rows = torch.cat(self._rows) if self._rows else torch.zeros(0, 4 + 2 * labels, device=self.device)
        self._rows.clear()
        rows = self._gather_rows(rows)  # (N, 4 + 2L), identical on every rank
        rows = rows[_first_rows_of_batches(rows[:, 0], rows[:, 1:3])]
        if not len(rows):
            return
        scores, targets = rows[:, 4 : 4 + labels], rows[:, 4 + labels :]
        self.log("val/loss", rows[:, 3].mean(), sync_dist=True)
        self.log(
            "val/macro_ap",
            macro_average_precision(targets.cpu().numpy(), scores.cpu().numpy()),
            prog_bar=True,
            sync_dist=True,
        )

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return torch.sigmoid(self(batch).float())


def distillation_loss(
    label_loss: torch.Tensor, logits: torch.Tensor, teacher: torch.Tensor, weight: float
) -> torch.Tensor:
    """``(1 - weight) x label_loss + weight x BCE(logits, sigmoid(teacher))``, a scalar in float32.

    ``logits``, ``teacher``: ``(N, L)``, the student's and the teacher's logits; the teacher's probabilities are
    soft targets (Hinton et al. 2015), which carry how likely each label is rather than whether it occurred.

    >>> z = torch.zeros(1, 2)
    >>> round(float(distillation_loss(torch.tensor(1.0), z, z, 0.25)), 4)  # 0.75 x 1 + 0.25 x ln 2
    0.9233
    """
    soft = F.binary_cross_entropy_with_logits(logits.float(), torch.sigmoid(teacher.float()))
    return (1.0 - weight) * label_loss + weight * soft


def _first_rows_of_batches(keys: torch.Tensor, batches: torch.Tensor) -> torch.Tensor:
    """Bool mask over samples: drop every sample of a batch whose key was seen before (a DDP repeat).

    ``keys`` ``(N,)``: each sample's batch key (negative: no index, always kept); ``batches`` ``(N, k)``:
    which processed batch each sample came from (e.g. rank and step); a batch's samples are consecutive.

    >>> keys = torch.tensor([0.0, 0.0, 4.0, 0.0, 0.0])
    >>> _first_rows_of_batches(keys, torch.tensor([[0.0], [0.0], [1.0], [2.0], [2.0]])).tolist()
    [True, True, True, False, False]
    """
    if not len(keys):
        return torch.zeros(0, dtype=torch.bool, device=keys.device)
    starts = torch.ones(len(keys), dtype=torch.bool, device=keys.device)
    starts[1:] = (batches[1:] != batches[:-1]).any(dim=-1)  # (N,): first sample of each processed batch
    run = torch.cumsum(starts.long(), 0) - 1  # (N,): processed-batch number of each sample
    return first_occurrences(keys[starts])[run]


def macro_average_precision(y_true: np.ndarray, y_score: np.ndarray) -> float:
    """Mean AP over labels with at least one positive and one negative (0.0 when none qualifies).

    >>> macro_average_precision(np.array([[1, 0], [0, 0]]), np.array([[0.9, 0.1], [0.2, 0.3]]))
    1.0
    """
    positives = y_true.sum(0)
    usable = (positives > 0) & (positives < len(y_true))
    if not usable.any():
        return 0.0
    return float(average_precision_score(y_true[:, usable], y_score[:, usable], average="macro"))
