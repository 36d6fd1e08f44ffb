"""DataLoaders with length-bucketed batches."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from behrt_rope.data.batching import BucketBatchSampler, padding_share
from behrt_rope.data.labels import Samples
from behrt_rope.data.sequences import Sequences
from behrt_rope.training.config import TrainerConfig


@dataclass
class SplitData:
    """One split's sequences, samples, dataset (with its collate function) and label matrix ``(N, L)``."""

    seqs: Sequences
    samples: Samples
    dataset: torch.utils.data.Dataset
    collate: Callable
    y: np.ndarray


def make_loader(
    dataset: torch.utils.data.Dataset,
    cfg: TrainerConfig,
    collate: Callable,
    shuffle: bool,
    batch_size: int | None = None,
) -> torch.utils.data.DataLoader:
    """Length-bucketed (and, for training, shuffled) batches of ``dataset`` (which has ``lengths``).

    A collator with ``set_epoch`` follows the sampler's epoch (so its workers are not persistent: each
    epoch's workers get the new epoch). The loader's own generator seeds its workers, so creating an
    iterator draws nothing from torch's global random stream (which dropout uses): exact resume needs that.
    """
    lengths = dataset.lengths  # type: ignore[attr-defined]
    bucket = cfg.bucket_size if shuffle else 1_000_000  # evaluation: one global sort, least padding
    sampler = BucketBatchSampler(lengths, batch_size or cfg.batch_size, bucket, shuffle, cfg.seed)
    follows_epoch = hasattr(collate, "set_epoch")
    if follows_epoch:
        sampler.add_epoch_listener(collate.set_epoch)  # type: ignore[attr-defined]
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=collate,
        num_workers=cfg.num_workers,
        persistent_workers=cfg.num_workers > 0 and not follows_epoch,
        generator=torch.Generator().manual_seed(cfg.seed),
    )


def padding_report(dataset: torch.utils.data.Dataset, cfg: TrainerConfig) -> dict[str, float]:
    """Share of padded positions in one epoch, length-bucketed vs. plain random batches."""
    lengths = dataset.lengths  # type: ignore[attr-defined]
    bucketed = BucketBatchSampler(lengths, cfg.batch_size, cfg.bucket_size, True, cfg.seed).batches()
    plain = BucketBatchSampler(lengths, cfg.batch_size, 1, True, cfg.seed).batches()
    return {
        "padding_share_bucketed": round(padding_share(lengths, bucketed), 4),
        "padding_share_random_batches": round(padding_share(lengths, plain), 4),
    }
