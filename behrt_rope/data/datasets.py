"""Torch datasets over :class:`~behrt_rope.data.sequences.Sequences`: whole patients (pre-training) and
history prefixes with multi-label targets (fine-tuning, evaluation, prediction)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

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
    ``label_of_token[token_id]`` is the label column of a token id, or -1 if it is not a label code.
    """

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
        return item


def collate_labelled(items: Sequence[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    """Padded inputs plus ``targets`` (B, L) float32 when items carry them."""
    batch = pad_batch(items)
    if "target" in items[0]:
        batch["targets"] = torch.from_numpy(np.stack([item["target"] for item in items]))
    return batch


class MlmCollator:
    """Pads a batch and applies BEHRT's masking.

    ``fixed=True`` (validation) seeds each batch from its item indices, so the same tuning patients get the
    same masks at every validation run; otherwise one generator runs on across batches and epochs.
    """

    def __init__(self, vocab_size: int, seed: int, fixed: bool = False, mask_prob: float = 0.15) -> None:
        self.vocab_size = vocab_size
        self.seed = seed
        self.fixed = fixed
        self.mask_prob = mask_prob
        self.generator: torch.Generator | None = None

    def __call__(self, items: Sequence[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
        batch = pad_batch(items)
        if self.fixed:
            first = min(int(item["index"]) for item in items)
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + first)
        else:
            if self.generator is None:
                worker = torch.utils.data.get_worker_info()
                offset = (worker.id + 1) * 7919 if worker else 0
                self.generator = torch.Generator().manual_seed(self.seed + offset)
            generator = self.generator
        batch["token_ids"], batch["labels"] = mask_tokens(
            batch["token_ids"], self.vocab_size, generator, mask_prob=self.mask_prob
        )
        return batch
