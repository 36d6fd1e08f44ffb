"""Per-batch padding and length-bucketed batch sampling.

Sorting a window of ``bucket_size`` batches by length before cutting batches keeps sequences of similar
length together, so each batch pads to a length close to its members'; the batches are then shuffled.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch

from behrt_rope import schema as S

FIELDS = ("token_ids", "ages", "segments", "visit_index", "sex")
INPUTS = (*FIELDS, "attention_mask")  # what the encoder's forward takes from a padded batch


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The encoder's inputs from a padded batch dict (``sex`` is optional: absent means unknown)."""
    return {name: batch[name] for name in INPUTS if name in batch or name != "sex"}


def pad_batch(items: Sequence[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    """Stack variable-length items into padded tensors (B, T), T = longest item in the batch.

    Returns token_ids/segments/visit_index (long), ages (float32, years) and attention_mask (bool, True on
    real tokens); padding uses ``S.PAD_ID`` and zeros. When the items carry their dataset ``index`` (as
    :class:`~behrt_rope.data.datasets.PatientDataset` items do), ``index`` (B,) long comes along too: it
    identifies a batch, e.g. to drop the batches that DDP sharding repeats from validation metrics.

    >>> b = pad_batch([{f: np.arange(3) for f in FIELDS}, {f: np.arange(1) for f in FIELDS}])
    >>> b["token_ids"].tolist(), b["attention_mask"].sum(1).tolist()
    ([[0, 1, 2], [0, 0, 0]], [3, 1])
    """
    longest = max(len(item["token_ids"]) for item in items)
    batch: dict[str, torch.Tensor] = {}
    for name in (f for f in FIELDS if f in items[0] or f != "sex"):  # items without sex: all unknown
        dtype = np.float32 if name == "ages" else np.int64
        fill = S.PAD_ID if name == "token_ids" else 0
        out = np.full((len(items), longest), fill, dtype=dtype)
        for row, item in enumerate(items):
            out[row, : len(item[name])] = item[name]
        batch[name] = torch.from_numpy(out)
    lengths = torch.tensor([len(item["token_ids"]) for item in items])
    batch["attention_mask"] = torch.arange(longest)[None, :] < lengths[:, None]
    if all("index" in item for item in items):
        batch["index"] = torch.tensor([int(item["index"]) for item in items], dtype=torch.long)
    return batch


def padding_share(lengths: np.ndarray, batches: list[np.ndarray]) -> float:
    """Share of padded positions over the given batches (each an array of item indices).

    >>> round(padding_share(np.array([1, 3, 2, 2]), [np.array([0, 1]), np.array([2, 3])]), 4)  # 1 - 8/10
    0.2
    """
    real = sum(int(lengths[b].sum()) for b in batches)
    padded = sum(int(lengths[b].max()) * len(b) for b in batches if len(b))
    return 1.0 - real / padded if padded else 0.0


class BucketBatchSampler(torch.utils.data.Sampler[list[int]]):
    """Batches of indices grouped by length; shuffled per epoch; shards batches across DDP ranks.

    Lightning calls ``set_epoch`` each epoch (through ``self.sampler``, where it looks for it). Under DDP
    every rank gets the same number of batches (the list is padded by repeating batches, cyclically), so no
    rank waits for another at the end of an epoch.
    A repeated batch is an exact copy (same indices), so evaluation can recognise and drop it.

    An epoch's batches depend only on (seed, epoch), so training resumed mid-epoch continues exactly:
    :meth:`resume_at` sets the epoch and how many of its batches were already trained on, and the next
    iteration skips them. Objects that need the epoch too (the masking collator) register with
    :meth:`add_epoch_listener`.
    """

    def __init__(
        self, lengths: np.ndarray, batch_size: int, bucket_size: int = 50, shuffle: bool = True, seed: int = 0
    ) -> None:
        self.lengths = np.asarray(lengths)
        self.batch_size = batch_size
        self.bucket_size = max(1, bucket_size)
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self._skip = 0  # batches of this epoch to skip at the next iteration (resume)
        self._listeners: list[Callable[[int], None]] = []
        self.sampler = _EpochHandle(self)  # Lightning sets each epoch through it (see _EpochHandle)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        for listener in self._listeners:
            listener(epoch)

    def add_epoch_listener(self, listener: Callable[[int], None]) -> None:
        """Call ``listener(epoch)`` whenever the epoch changes (and once now)."""
        self._listeners.append(listener)
        listener(self.epoch)

    def resume_at(self, epoch: int, batches_done: int) -> None:
        """Continue epoch ``epoch`` after its first ``batches_done`` batches (of this rank); a finished epoch
        continues with the start of the next one."""
        if batches_done >= len(self):
            epoch, batches_done = epoch + 1, 0
        self.set_epoch(epoch)
        self._skip = max(0, batches_done)

    def batches(self) -> list[np.ndarray]:
        """This epoch's batches, for all ranks."""
        rng = np.random.default_rng([self.seed, self.epoch])
        n = len(self.lengths)
        order = rng.permutation(n) if self.shuffle else np.arange(n)
        window = self.batch_size * self.bucket_size
        batches: list[np.ndarray] = []
        for start in range(0, n, window):
            chunk = order[start : start + window]
            chunk = chunk[np.argsort(self.lengths[chunk], kind="stable")]
            batches.extend(chunk[i : i + self.batch_size] for i in range(0, len(chunk), self.batch_size))
        if self.shuffle:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        return batches

    def _rank_batches(self) -> list[np.ndarray]:
        batches = self.batches()
        world, rank = _world()
        if world == 1:
            return batches
        per_rank = -(-len(batches) // world)
        # cyclic, so that even fewer batches than ranks give every rank per_rank batches
        batches = [batches[i % len(batches)] for i in range(per_rank * world)]
        return batches[rank::world]

    def __iter__(self) -> Iterator[list[int]]:
        skip, self._skip = self._skip, 0
        for batch in self._rank_batches()[skip:]:
            yield batch.tolist()

    def __len__(self) -> int:
        world, _ = _world()
        return -(-len(self.batches()) // world)


class _EpochHandle:
    """``batch_sampler.sampler``: Lightning calls ``set_epoch`` on a DataLoader's ``sampler`` and on its
    ``batch_sampler.sampler``, never on the batch sampler itself; this forwards the call to it."""

    def __init__(self, owner: BucketBatchSampler) -> None:
        self.owner = owner

    def set_epoch(self, epoch: int) -> None:
        self.owner.set_epoch(epoch)


def _world() -> tuple[int, int]:
    """(world size, rank) of the default process group; (1, 0) outside DDP."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(), torch.distributed.get_rank()
    return 1, 0
