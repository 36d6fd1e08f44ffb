"""Torch datasets over :class:`~behrt_rope.data.sequences.Sequences`: whole patients (pre-training) and
history prefixes with multi-label targets (fine-tuning, evaluation, prediction)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from behrt_rope.data import batching
from behrt_rope.data.batching import FIELDS, pad_batch
from behrt_rope.data.masking import mask_tokens
from behrt_rope.data.sequences import Sequences

IGNORE_INDEX = -100


class PatientDataset(torch.utils.data.Dataset):
    """Item ``i``: the first ``cuts[i]`` tokens of patient ``rows[i]`` (whole streams by default)."""

    def __init__(self, seqs: Sequences, rows: np.ndarray | None = None, cuts: np.ndarray | None = None) -> None:
        self.seqs = seqs
        self.rows = np.arange(len(seqs)) if rows is None else np.asarray(rows, dtype=np.int64)
        self.cuts = seqs.lengths[self.rows] if cuts is None else np.asarray(cuts, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per item, (N,)."""
        return self.cuts

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        start = int(self.seqs.offsets[self.rows[i]])
        stop = start + int(self.cuts[i])
        item = {name: getattr(self.seqs, name)[start:stop] for name in FIELDS}
        item["index"] = np.array(i)
        return item


class LabelledDataset(PatientDataset):
    """A :class:`PatientDataset` whose items also carry a multi-hot target over the label vocabulary.

    ``label_spans[i] = (start, stop)``: flat token positions whose codes form item ``i``'s label set;
    ``label_of_token[token_id]`` is the label column of a token id, or -1 if it is not a label code. With
    ``teacher`` set (``(N, L)`` float32 logits, one row per sample), item ``i`` also carries ``teacher[i]``.
    """

    teacher: np.ndarray | None = None

    def __init__(
        self, seqs: Sequences, rows: np.ndarray, cuts: np.ndarray, label_spans: np.ndarray, label_of_token: np.ndarray
    ) -> None:
        super().__init__(seqs, rows, cuts)
        self.label_spans = np.asarray(label_spans, dtype=np.int64)
        self.label_of_token = np.asarray(label_of_token, dtype=np.int64)
        self.num_labels = int(self.label_of_token.max()) + 1 if len(self.label_of_token) else 0

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        item = super().__getitem__(i)
        start, stop = self.label_spans[i]
        columns = self.label_of_token[self.seqs.token_ids[start:stop]]
        target = np.zeros(self.num_labels, dtype=np.float32)
        target[columns[columns >= 0]] = 1.0
        item["target"] = target
        if self.teacher is not None:
            item["teacher"] = self.teacher[i]
        return item


def collate_labelled(items: Sequence[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    """Padded inputs plus ``targets`` (B, L) float32 when items carry them, and ``teacher`` (B, L) likewise."""
    batch = pad_batch(items)
    for key, name in (("target", "targets"), ("teacher", "teacher")):
        if key in items[0]:
            batch[name] = torch.from_numpy(np.stack([item[key] for item in items]))
    return batch


class MlmCollator:
    """Pads a batch and applies BEHRT's masking.

    ``fixed=True`` (validation) seeds each batch from its item indices, so the same tuning patients get the
    same masks at every validation run (and a batch that DDP sharding repeats gets the same masks again);
    otherwise each batch's masks are drawn from a generator seeded by (seed, DDP rank, epoch, the batch's
    item indices): new masks every epoch, yet a function of the batch alone, so training resumed mid-epoch,
    or run with DataLoader workers, draws exactly the masks of an uninterrupted run. The epoch comes from
    :meth:`set_epoch` (the batch sampler calls it, see ``BucketBatchSampler.add_epoch_listener``).
    """

    def __init__(self, vocab_size: int, seed: int, fixed: bool = False, mask_prob: float = 0.15) -> None:
        self.vocab_size = vocab_size
        self.seed = seed
        self.fixed = fixed
        self.mask_prob = mask_prob
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __call__(self, items: Sequence[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
        batch = pad_batch(items)
        indices = [int(item["index"]) for item in items]
        if self.fixed:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + min(indices))
        else:
            rank = batching._world()[1]
            entropy = np.random.SeedSequence([self.seed, rank, self.epoch, *sorted(indices)])
            generator = torch.Generator().manual_seed(int(entropy.generate_state(1, np.uint64)[0] >> np.uint64(1)))
        batch["token_ids"], batch["labels"] = mask_tokens(
            batch["token_ids"], self.vocab_size, generator, mask_prob=self.mask_prob
        )
        return batch


class VisitScoredDataset(torch.utils.data.Dataset):
    """One item per patient, scored at several prediction times in one visit-causal pass.

    Item ``i`` holds patient ``rows[i]``'s stream up to its latest prediction time and ``score_positions``,
    the (ascending) token positions of the [SEP]s that close each prediction visit. With
    ``label_of_token``, ``target`` (n_i, L) holds the multi-hot label of each of those samples. ``sample_ids``
    maps the scored positions, in order, back to the sample numbering of the inputs. With ``teacher`` set
    (``(N, L)`` float32 logits in the inputs' sample order), ``teacher`` (n_i, L) holds those samples' rows.
    """

    teacher: np.ndarray | None = None

    def __init__(
        self,
        seqs: Sequences,
        rows: np.ndarray,
        cuts: np.ndarray,
        label_spans: np.ndarray | None = None,
        label_of_token: np.ndarray | None = None,
    ) -> None:
        rows, cuts = np.asarray(rows, dtype=np.int64), np.asarray(cuts, dtype=np.int64)
        order = np.lexsort((cuts, rows))  # grouped by patient, prediction times ascending
        self.seqs = seqs
        self.sample_order = order
        self.cuts = cuts[order]
        self.spans = None if label_spans is None else np.asarray(label_spans, dtype=np.int64)[order]
        self.label_of_token = label_of_token
        self.num_labels = 0 if label_of_token is None else int(np.max(label_of_token, initial=-1)) + 1
        sorted_rows = rows[order]
        starts = np.flatnonzero(np.r_[True, sorted_rows[1:] != sorted_rows[:-1]]) if len(rows) else np.zeros(0, int)
        self.groups = np.r_[starts, len(rows)].astype(np.int64)  # samples of item i: groups[i]:groups[i + 1]
        self.rows = sorted_rows[starts] if len(rows) else np.zeros(0, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per item (up to the latest prediction time), (N_items,)."""
        return self.cuts[self.groups[1:] - 1]

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        first, stop = self.groups[i], self.groups[i + 1]
        start = int(self.seqs.offsets[self.rows[i]])
        end = start + int(self.cuts[stop - 1])
        item = {name: getattr(self.seqs, name)[start:end] for name in FIELDS}
        item["index"] = np.array(i)
        item["score_positions"] = self.cuts[first:stop] - 1
        if self.spans is not None and self.label_of_token is not None:
            target = np.zeros((stop - first, self.num_labels), dtype=np.float32)
            for j, (a, b) in enumerate(self.spans[first:stop]):
                columns = self.label_of_token[self.seqs.token_ids[a:b]]
                target[j, columns[columns >= 0]] = 1.0
            item["target"] = target
        if self.teacher is not None:
            item["teacher"] = self.teacher[self.sample_order[first:stop]]
        return item


def collate_visit_scored(items: Sequence[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    """Padded inputs, ``score_at`` (B, T) bool at the scored [SEP]s and, with labels, ``targets`` (N, L) in
    the same row-major order as the model's ``(N, L)`` output (and ``teacher`` (N, L) likewise when items
    carry it)."""
    batch = pad_batch(items)
    score_at = torch.zeros(batch["token_ids"].shape, dtype=torch.bool)
    for row, item in enumerate(items):
        score_at[row, torch.from_numpy(item["score_positions"])] = True
    batch["score_at"] = score_at
    for key, name in (("target", "targets"), ("teacher", "teacher")):
        if key in items[0]:
            batch[name] = torch.from_numpy(np.concatenate([item[key] for item in items]))
    return batch


def labelled_dataset(
    seqs: Sequences,
    rows: np.ndarray,
    cuts: np.ndarray,
    label_spans: np.ndarray | None,
    label_of_token: np.ndarray | None,
    pooling: str,
) -> tuple[torch.utils.data.Dataset, Callable]:
    """The dataset and collate function that feed a multi-label model with this ``pooling``: one item per
    patient for visit pooling, one item per sample (input cut at its prediction time) otherwise."""
    if pooling == "visit":
        return VisitScoredDataset(seqs, rows, cuts, label_spans, label_of_token), collate_visit_scored
    if label_spans is None or label_of_token is None:
        return PatientDataset(seqs, rows, cuts), collate_labelled
    return LabelledDataset(seqs, rows, cuts, label_spans, label_of_token), collate_labelled
