"""Settings shared by pre-training and fine-tuning (the Lightning layer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class TrainerConfig:
    """What the Lightning trainer does; the same for ``pretrain`` and ``finetune``."""

    max_epochs: int = 8
    """Passes over the train split."""
    max_steps: int = -1
    """Stop after this many optimizer steps (-1: no limit)."""
    max_minutes: float = 0.0
    """Wall-clock budget of the stage in minutes, time before training included (0: none). When fewer than
    ``max_epochs`` epochs fit, the learning-rate schedule is shortened to end at the last epoch that fits, and
    the run stops there (``training.time_budget``); a budget that is not tight changes nothing."""
    batch_size: int = 32
    """Sequences (patients) per batch (per device)."""
    learning_rate: float = 1e-3
    """Peak learning rate of AdamW, reached after the warm-up."""
    wide_lr_scale: float = 10.0
    """Learning-rate multiplier of the fine-tuning head's wide (bag-of-codes) linear path."""
    state_filter_lr_scale: float = 10.0
    """Learning-rate multiplier of the fine-tuning head's hidden-state filter (``model.state_filter``): its
    rates, priors and evidence weights are of order 1 and start far from where they end."""
    encoder_lr_scale: float = 1.0
    """Learning-rate multiplier of the encoder (embeddings and blocks), e.g. 0.3 to fine-tune a pre-trained
    encoder more gently than the freshly initialised head."""
    head_lr_scale: float = 1.0
    """Learning-rate multiplier of every parameter outside the encoder, the wide path and the state filter:
    the fine-tuning head (classifier, age basis, label attention, label-code maps) or, in pre-training, the MLM
    head's transform. E.g. 3 in fine-tuning lets the head's per-label weights grow to the size of the effects they
    carry before the pre-trained encoder starts fitting patients: better on short, sparse histories, worse
    on a clinical cohort at the default density (docs/benchmarks.md, "Nineteenth round")."""
    weight_decay: float = 0.01
    """AdamW weight decay of linear layers' weight matrices (not of biases, norms or embedding tables)."""
    warmup_fraction: float = 0.1
    """Share of all steps spent warming the learning rate up linearly from 0."""
    schedule: Literal["linear", "cosine"] = "linear"
    """Decay after the warm-up, down to 0 at the last step."""
    gradient_clip: float = 1.0
    """Clip the gradient norm to this (0: off)."""
    precision: Literal["auto", "32-true", "bf16-mixed", "16-mixed"] = "auto"
    """auto: bf16-mixed on a GPU that supports it, 32-true on CPU."""
    accelerator: Literal["auto", "cpu", "gpu"] = "auto"
    devices: str = "auto"
    """Number of devices per node, or 'auto'."""
    num_nodes: int = 1
    strategy: str = "auto"
    """Lightning strategy, e.g. 'ddp' for several GPUs or nodes."""
    ddp_backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Process-group backend for ddp; gloo works on CPU."""
    num_workers: int = 0
    """DataLoader worker processes."""
    bucket_size: int = 50
    """Length bucketing: sort each group of this many batches by length, then shuffle the batches."""
    ema_decay: float = 0.0
    """Keep an exponential moving average of the weights (decay per optimizer step, e.g. 0.998: an average
    over the last ~500 steps); validation, the best checkpoint and the saved model use the averaged weights.
    0: off."""
    early_stopping_patience: int = 3
    """Validation checks without improvement before stopping (0: off)."""
    early_stopping_ratio: float = 0.0
    """Let the patience grow with the best check: stop after max(patience, ceil(ratio x checks up to the best
    one)) checks without improvement. 1.0: stop once a run has gone twice as far as its best check. 0: the
    patience stays fixed."""
    seed: int = 0
    """Seeds weights, masking, sampling and dropout."""
    deterministic: bool = False
    """Ask torch for deterministic kernels (slower)."""
    log_every_n_steps: int = 10
    progress_bar: bool = True
    limit_val_batches: float = 1.0
    """Share (<=1) or number (>1) of validation batches per check."""
    checkpoint_every_n_steps: int = 0
    """Save OUT/checkpoints/last.ckpt every this many optimizer steps (0: use checkpoint_every_minutes)."""
    checkpoint_every_minutes: float = 5.0
    """Save last.ckpt at least this often within an epoch (0: only at epoch ends), so a kill loses minutes,
    not an epoch; `--resume last` continues mid-epoch exactly where the checkpoint was taken."""

    def __post_init__(self) -> None:
        if self.checkpoint_every_n_steps < 0 or self.checkpoint_every_minutes < 0:
            raise ValueError("checkpoint_every_n_steps and checkpoint_every_minutes must be >= 0")
        if self.max_minutes < 0:
            raise ValueError(f"max_minutes must be >= 0 (0: no budget), got {self.max_minutes}")
        if self.early_stopping_patience < 0 or self.early_stopping_ratio < 0:
            raise ValueError("early_stopping_patience and early_stopping_ratio must be >= 0")
        if min(self.wide_lr_scale, self.state_filter_lr_scale, self.encoder_lr_scale, self.head_lr_scale) < 0:
            raise ValueError("wide_lr_scale, state_filter_lr_scale, encoder_lr_scale and head_lr_scale must be >= 0")
