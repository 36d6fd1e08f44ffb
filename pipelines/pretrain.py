"""``behrt-rope pretrain``: masked-language pre-training on the train split, validated on tuning."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytorch_lightning as pl

from behrt_rope import schema as S
from behrt_rope.data.datasets import MlmCollator, PatientDataset
from behrt_rope.data.sequences import load_tokens, load_vocabulary
from behrt_rope.errors import UserError
from behrt_rope.model.config import HEAD_FIELDS, ModelConfig
from behrt_rope.stage import is_done, require_done, stage, write_json
from behrt_rope.training.bundle import save_bundle, task_state_dict
from behrt_rope.training.checkpoints import load_task_weights
from behrt_rope.training.config import TrainerConfig
from behrt_rope.training.loaders import make_loader, padding_report
from behrt_rope.training.tasks import MaskedLMTask
from behrt_rope.training.trainer import build_trainer, resume_path, time_budget

log = logging.getLogger("behrt_rope.pretrain")


@dataclass
class Config:
    data: str = ""
    """ETL output directory."""
    out: str = ""
    """Output directory (checkpoints, logs, model.safetensors + model.json, metrics.json)."""
    resume: str = ""
    """Checkpoint to resume from: a path, or 'last' for OUT/checkpoints/last.ckpt."""
    overwrite: bool = False
    """Redo the work even if OUT already holds a finished run of the same configuration."""
    mask_prob: float = 0.15
    """Share of non-special tokens chosen for prediction (BEHRT: 0.15)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(max_epochs=4, max_minutes=2.5))
    """Pre-training defaults: 4 passes over the train split at a peak learning rate of 1e-3. The fine-tuned
    model's tuning macro AP did not depend on the length between 4 and 24 epochs on any tuning cohort we
    measured, so the shortest leaves the most of the 15-minute budget to fine-tuning (docs/benchmarks.md,
    "Quality", twenty-fifth and twenty-sixth rounds). At most 2.5 minutes of wall-clock time (``max_minutes``,
    ``training.time_budget``), the pre-training share of the 15-minute budget; ``trainer.max_minutes=0`` lifts
    it."""


def run(config: Config) -> Path:
    """Pre-train; returns the output directory."""
    stage_started = time.monotonic()  # the time budget (trainer.max_minutes) counts from here
    if not config.data or not config.out:
        raise UserError("pretrain needs --data ETL_DIR and --out DIR")
    out_dir = Path(config.out)
    require_done(config.data, "etl")
    head = [f"model.{name}" for name in HEAD_FIELDS]  # fine-tuning settings: pre-training does not use them
    if not config.overwrite and not config.resume and is_done(out_dir, config, ignore=head, inputs=[config.data]):
        log.info("pretrain: %s already holds this run; skipping (overwrite=true to redo)", out_dir)
        return out_dir
    seqs, vocab = load_tokens(config.data), load_vocabulary(config.data)
    train, tuning = seqs.split(S.TRAIN), seqs.split(S.TUNING)
    if len(train) == 0:
        raise UserError(f"{config.data}: the train split has no patients")
    model_config = dataclasses.replace(config.model, vocab_size=len(vocab))
    tc = config.trainer
    with stage(out_dir, config, "pretrain", inputs=[config.data]) as out:
        pl.seed_everything(tc.seed, workers=True, verbose=False)
        train_set, tuning_set = PatientDataset(train), PatientDataset(tuning)
        train_loader = make_loader(train_set, tc, MlmCollator(len(vocab), tc.seed, mask_prob=config.mask_prob), True)
        val_loader = (
            make_loader(tuning_set, tc, MlmCollator(len(vocab), tc.seed, fixed=True, mask_prob=config.mask_prob), False)
            if len(tuning_set)
            else None
        )
        task = MaskedLMTask(model_config, tc)
        monitor = "val/loss" if val_loader is not None else None
        budget = time_budget(tc, stage_started)
        trainer = build_trainer(tc, out, monitor, "min", train_loader, [budget] if budget else None)
        log.info("pretrain: %d train / %d tuning patients, vocabulary %d", len(train), len(tuning), len(vocab))
        started = time.perf_counter()
        trainer.fit(task, train_loader, val_loader, ckpt_path=resume_path(config.resume, out))
        seconds = time.perf_counter() - started
        best = str(getattr(trainer.checkpoint_callback, "best_model_path", "") or "")
        if best:
            task = MaskedLMTask(model_config, tc)
            load_task_weights(task, best)
        metrics: dict[str, Any] = dict(_evaluate(trainer, task, val_loader))
        if trainer.is_global_zero:
            metrics.update(
                epochs=trainer.current_epoch,
                steps=trainer.global_step,
                train_seconds=round(seconds, 1),
                stage_seconds=round(time.monotonic() - stage_started, 1),
                **(budget.report() if budget else {}),
                train_patients=len(train),
                tuning_patients=len(tuning),
                train_tokens_per_epoch=int(train_set.lengths.sum()),
                best_checkpoint=best,
                **padding_report(train_set, tc),
            )
            write_json(out / S.METRICS_FILE, metrics)
            save_bundle(
                out,
                "mlm",
                model_config,
                task_state_dict(task),
                vocab=vocab["token"].tolist(),
                etl_dir=str(Path(config.data).resolve()),
            )
            log.info(
                "pretrain: tuning MLM loss %.4f, top-1 precision %.4f, top-5 recall %.4f",
                metrics.get("mlm_loss", float("nan")),
                metrics.get("top1_precision", float("nan")),
                metrics.get("top5_recall", float("nan")),
            )
    return out_dir


def _evaluate(trainer: pl.Trainer, task: MaskedLMTask, val_loader: object) -> dict[str, float]:
    """MLM metrics of ``task`` on the tuning split (fixed masks)."""
    if val_loader is None:
        return {}
    results = trainer.validate(task, val_loader, verbose=False)[0]
    return {
        "mlm_loss": round(float(results["val/loss"]), 5),
        "top1_precision": round(float(results["val/top1_precision"]), 5),
        "top5_recall": round(float(results["val/top5_recall"]), 5),
        "masked_tokens": int(results["val/masked_tokens"]),
    }
