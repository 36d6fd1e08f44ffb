"""A Lightning ``Trainer`` from :class:`TrainerConfig`: precision, strategy, checkpoints, logs, early stop."""

from __future__ import annotations

import importlib.util
import logging
import time
import warnings
from datetime import timedelta
from pathlib import Path

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import LearningRateMonitor, ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger, Logger, TensorBoardLogger
from pytorch_lightning.strategies import DDPStrategy, Strategy

from behrt_rope import schema as S
from behrt_rope.data.batching import BucketBatchSampler
from behrt_rope.errors import UserError
from behrt_rope.training.checkpoints import ExactResume, SafeCheckpointIO
from behrt_rope.training.config import TrainerConfig
from behrt_rope.training.early_stopping import GrowingPatienceEarlyStopping
from behrt_rope.training.time_budget import TimeBudget

log = logging.getLogger(__name__)


class _DropAdvertisement(logging.Filter):
    """Drops Lightning's tip that advertises its hosted experiment logger on every ``Trainer``."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "litlogger" not in record.getMessage()


_ADVERTISEMENT_FILTER = _DropAdvertisement()


def silence_lightning_noise() -> None:
    """Hide what Lightning prints on every run that a user of ours can do nothing about; idempotent.

    - ExactResume restores the sampler's position itself; Lightning cannot see that and warns on every resume.
    - Lightning's own use of a torch API that newer torch deprecates (``LeafSpec``) warns on every fit.
    - The tip advertising Lightning's hosted logger, logged on every ``Trainer``.
    """
    warnings.filterwarnings("ignore", message=r"You're resuming from a checkpoint that ended before the epoch ended")
    warnings.filterwarnings("ignore", r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning)
    for name in ("pytorch_lightning.utilities.rank_zero", "lightning_fabric.utilities.rank_zero"):
        logging.getLogger(name).addFilter(_ADVERTISEMENT_FILTER)  # a filter already there is not added twice


def uses_gpu(cfg: TrainerConfig) -> bool:
    """Whether the trainer runs on a GPU: ``accelerator`` auto or gpu, and CUDA available."""
    return cfg.accelerator in ("auto", "gpu") and torch.cuda.is_available()


def resolve_precision(cfg: TrainerConfig) -> str:
    """``auto``: bf16 mixed precision on a GPU that supports it, full fp32 on CPU."""
    if cfg.precision != "auto":
        return cfg.precision
    return "bf16-mixed" if uses_gpu(cfg) and torch.cuda.is_bf16_supported() else "32-true"


def resolve_strategy(cfg: TrainerConfig) -> str | Strategy:
    """The strategy name, or a DDP strategy with the configured process-group backend."""
    if cfg.strategy == "ddp" and cfg.ddp_backend != "auto":
        return DDPStrategy(process_group_backend=cfg.ddp_backend)
    return cfg.strategy


def loggers(out_dir: Path) -> list[Logger]:
    """CSV logs always; TensorBoard logs when tensorboard is installed."""
    found: list[Logger] = [CSVLogger(out_dir, name="logs", version="")]
    if importlib.util.find_spec("tensorboard") is not None:
        found.append(TensorBoardLogger(out_dir, name="tensorboard", version=""))
    return found


def periodic_checkpoint(cfg: TrainerConfig, out_dir: Path) -> ModelCheckpoint | None:
    """``checkpoints/last.ckpt`` every N steps or minutes within epochs (None when both are 0)."""
    if cfg.checkpoint_every_n_steps <= 0 and cfg.checkpoint_every_minutes <= 0:
        return None
    by_steps = cfg.checkpoint_every_n_steps > 0
    return ModelCheckpoint(
        dirpath=out_dir / S.CHECKPOINT_DIR,
        save_last=True,
        save_top_k=0,
        every_n_train_steps=cfg.checkpoint_every_n_steps if by_steps else None,
        train_time_interval=None if by_steps else timedelta(minutes=cfg.checkpoint_every_minutes),
        enable_version_counter=False,
    )


def weight_average(cfg: TrainerConfig) -> pl.Callback | None:
    """Lightning's weight averaging as an exponential moving average (None when ``ema_decay`` is 0).

    Buffers are not averaged: the model's only buffers are integer ids (the label codes), which an average
    would round."""
    if cfg.ema_decay <= 0:
        return None
    if not 0.0 < cfg.ema_decay < 1.0:
        raise UserError(f"trainer.ema_decay must lie in [0, 1), got {cfg.ema_decay}")
    try:
        from pytorch_lightning.callbacks import WeightAveraging
    except ImportError:  # Lightning < 2.5
        raise UserError("trainer.ema_decay needs pytorch-lightning >= 2.5 (WeightAveraging)") from None
    from torch.optim.swa_utils import get_ema_avg_fn

    return WeightAveraging(use_buffers=False, avg_fn=get_ema_avg_fn(cfg.ema_decay))


def time_budget(
    cfg: TrainerConfig,
    stage_started: float,
    reserve_validations: float = 0.0,
    held_back_share: float = 0.0,
    reserve_choices: float = 0.0,
) -> TimeBudget | None:
    """The stage's :class:`TimeBudget` (None without ``max_minutes``); ``stage_started`` is the
    ``time.monotonic()`` at which the stage began, so the time before training counts against the budget;
    ``reserve_validations``: validation epochs' worth of time held back for the work after training, and
    ``reserve_choices`` seconds besides (fine-tuning's choices, measured before training);
    ``held_back_share``: a share of ``max_minutes`` held back besides (fine-tuning's chains)."""
    if cfg.max_minutes <= 0:
        return None
    spent = time.monotonic() - stage_started
    held_back = held_back_share * cfg.max_minutes * 60.0
    return TimeBudget(
        cfg.max_minutes,
        spent,
        reserve_validations=reserve_validations,
        held_back_seconds=held_back,
        reserve_choices=reserve_choices,
    )


def budget_left(cfg: TrainerConfig, stage_started: float) -> float | None:
    """Seconds left of the stage's ``max_minutes`` budget (may be negative), or None without a budget."""
    if cfg.max_minutes <= 0:
        return None
    return cfg.max_minutes * 60.0 - (time.monotonic() - stage_started)


def build_trainer(
    cfg: TrainerConfig,
    out_dir: Path,
    monitor: str | None,
    mode: str,
    train_loader: torch.utils.data.DataLoader | None = None,
    extra_callbacks: list[pl.Callback] | None = None,
) -> pl.Trainer:
    """Checkpoints ``checkpoints/best.ckpt`` (by ``monitor``) and ``checkpoints/last.ckpt`` (at epoch ends
    and every N steps or minutes), saved atomically and loaded without unpickling code. With the
    ``train_loader`` (batched by a :class:`BucketBatchSampler`), checkpoints also carry what an exact
    mid-epoch resume needs (:class:`~behrt_rope.training.checkpoints.ExactResume`). ``extra_callbacks`` join
    the trainer's own (e.g. fine-tuning's :class:`~behrt_rope.training.soup.TopChecksSoup`)."""
    silence_lightning_noise()
    checkpoint = ModelCheckpoint(
        dirpath=out_dir / S.CHECKPOINT_DIR,
        filename=Path(S.BEST_CHECKPOINT).stem,
        monitor=monitor,
        mode=mode,
        save_last=True,
        save_top_k=1,
        enable_version_counter=False,
    )
    callbacks: list[pl.Callback] = [checkpoint, LearningRateMonitor(logging_interval="step"), *(extra_callbacks or [])]
    periodic = periodic_checkpoint(cfg, out_dir)
    if periodic is not None:
        callbacks.append(periodic)
    sampler = getattr(train_loader, "batch_sampler", None)
    if isinstance(sampler, BucketBatchSampler):
        callbacks.append(ExactResume(sampler))
    averaging = weight_average(cfg)
    if averaging is not None:
        callbacks.append(averaging)
    if monitor and cfg.early_stopping_patience > 0:
        callbacks.append(
            GrowingPatienceEarlyStopping(
                monitor=monitor, mode=mode, patience=cfg.early_stopping_patience, ratio=cfg.early_stopping_ratio
            )
        )
    devices: int | str = int(cfg.devices) if cfg.devices.isdigit() else cfg.devices
    precision = resolve_precision(cfg)
    log.info(
        "trainer: precision %s, accelerator %s, devices %s, strategy %s",
        precision,
        cfg.accelerator,
        devices,
        cfg.strategy,
    )
    return pl.Trainer(
        default_root_dir=out_dir,
        max_epochs=cfg.max_epochs,
        max_steps=cfg.max_steps,
        accelerator=cfg.accelerator,
        devices=devices,
        num_nodes=cfg.num_nodes,
        strategy=resolve_strategy(cfg),
        precision=precision,  # type: ignore[arg-type]
        gradient_clip_val=cfg.gradient_clip or None,
        deterministic=cfg.deterministic,
        callbacks=callbacks,
        plugins=[SafeCheckpointIO()],
        logger=loggers(out_dir),
        log_every_n_steps=cfg.log_every_n_steps,
        enable_progress_bar=cfg.progress_bar,
        enable_model_summary=False,
        use_distributed_sampler=False,  # BucketBatchSampler shards batches across ranks itself
        limit_val_batches=cfg.limit_val_batches if cfg.limit_val_batches <= 1 else int(cfg.limit_val_batches),
        num_sanity_val_steps=0,
    )


def resume_path(resume: str, out_dir: Path) -> str | None:
    """``--resume``: '' for none, 'last' for OUT/checkpoints/last.ckpt, else a checkpoint path."""
    if not resume:
        return None
    path = out_dir / S.CHECKPOINT_DIR / S.LAST_CHECKPOINT if resume == "last" else Path(resume)
    if not path.exists():
        raise UserError(f"checkpoint to resume from not found: {path}")
    return str(path)
