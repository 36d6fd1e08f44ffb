"""Lightning modules: masked-language pre-training and multi-label fine-tuning.

Lightning appears only in this layer; the model code imports torch alone.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from sklearn.metrics import average_precision_score

from behrt_rope.model.config import ModelConfig
from behrt_rope.model.heads import BehrtForMaskedLM, BehrtForMultiLabel, multilabel_loss
from behrt_rope.training.config import TrainerConfig
from behrt_rope.training.optim import build_optimizer

INPUTS = ("token_ids", "ages", "segments", "visit_index", "attention_mask")


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The encoder's inputs from a batch dict."""
    return {name: batch[name] for name in INPUTS}


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
        out = self.model(**model_inputs(batch), labels=batch["labels"])
        n = out.labels.numel()
        if n == 0:
            return
        top5 = out.logits.topk(min(5, out.logits.shape[-1]), dim=-1).indices  # (N, 5)
        hits1 = (top5[:, 0] == out.labels).sum()
        hits5 = (top5 == out.labels[:, None]).any(dim=-1).sum()
        self._val.append(torch.stack([out.loss.detach().float() * n, hits1.float(), hits5.float(),
                                      torch.tensor(float(n), device=out.loss.device)]))

    def on_validation_epoch_end(self) -> None:
        totals = torch.stack(self._val).sum(0) if self._val else torch.zeros(4, device=self.device)
        totals = self.all_gather(totals)
        if totals.ndim > 1:
            totals = totals.sum(0)
        self._val.clear()
        n = max(float(totals[3]), 1.0)
        self.log("val/loss", totals[0] / n, prog_bar=True)
        self.log("val/top1_precision", totals[1] / n)
        self.log("val/top5_recall", totals[2] / n)
        self.log("val/masked_tokens", totals[3])


class MultiLabelTask(_Task):
    """Multi-label diagnosis prediction with BCE; validation reports loss and macro average precision."""

    def __init__(
        self,
        model_config: ModelConfig,
        trainer_config: TrainerConfig,
        num_labels: int,
        pooling: str = "cls",
        pos_weight: list[float] | None = None,
    ) -> None:
        super().__init__(model_config, trainer_config)
        self.model = BehrtForMultiLabel(model_config, num_labels, pooling)  # type: ignore[arg-type]
        self.register_buffer(
            "pos_weight", torch.tensor(pos_weight, dtype=torch.float32) if pos_weight is not None else None
        )
        self._scores: list[torch.Tensor] = []
        self._targets: list[torch.Tensor] = []

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(**model_inputs(batch))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = multilabel_loss(self(batch), batch["targets"], self.pos_weight)
        self._count_padding(batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=batch["token_ids"].shape[0])
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        logits = self(batch)
        loss = multilabel_loss(logits, batch["targets"], self.pos_weight)
        self.log("val/loss", loss, batch_size=batch["token_ids"].shape[0], sync_dist=True)
        self._scores.append(torch.sigmoid(logits.float()).detach())
        self._targets.append(batch["targets"].detach())

    def on_validation_epoch_end(self) -> None:
        if not self._scores:
            return
        scores = self.all_gather(torch.cat(self._scores)).reshape(-1, self.model.num_labels)
        targets = self.all_gather(torch.cat(self._targets)).reshape(-1, self.model.num_labels)
        self._scores.clear()
        self._targets.clear()
        self.log("val/macro_ap", macro_average_precision(targets.cpu().numpy(), scores.cpu().numpy()),
                 prog_bar=True)

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return torch.sigmoid(self(batch).float())


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
