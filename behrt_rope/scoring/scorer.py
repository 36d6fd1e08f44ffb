"""A fine-tuned model ready to score whole histories as of each patient's last visit."""

from __future__ import annotations

import numpy as np
import torch

from behrt_rope.data.batching import model_inputs
from behrt_rope.data.sequences import Sequences
from behrt_rope.model.heads import BehrtForMultiLabel
from behrt_rope.scoring.batches import iter_batches
from behrt_rope.scoring.precision import Precision, resolve_dtype


class Scorer:
    """Scores :class:`Sequences` with a :class:`BehrtForMultiLabel` in eval mode, without autograd.

    Batches are length buckets of at most ``max_tokens`` padded tokens and ``max_batch`` patients. Under
    bf16 the matrix products run in bf16 (autocast) while the model's precision-sensitive parts (RoPE
    angles, Time2Vec) stay fp32; probabilities come back as fp32.
    """

    def __init__(
        self,
        model: BehrtForMultiLabel,
        device: torch.device,
        precision: Precision = "auto",
        max_tokens: int = 4096,
        max_batch: int = 1024,
    ) -> None:
        self.model = model.eval().to(device)
        self.device = device
        self.dtype = resolve_dtype(precision, device)
        self.max_tokens = max_tokens
        self.max_batch = max_batch

    @property
    def num_labels(self) -> int:
        return self.model.num_labels

    @torch.inference_mode()
    def score(self, seqs: Sequences) -> np.ndarray:
        """Probabilities ``(N, L)`` float32, row ``i`` for patient ``i`` of ``seqs`` as of its last token."""
        out = np.zeros((len(seqs), self.num_labels), dtype=np.float32)
        visit = self.model.pooling == "visit"
        autocast = self.dtype != torch.float32
        for rows, batch in iter_batches(seqs, self.max_tokens, score_last=visit, max_batch=self.max_batch):
            batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast(self.device.type, dtype=self.dtype, enabled=autocast):
                logits = self.model(**model_inputs(batch), score_at=batch.get("score_at"))  # (B, L)
            out[rows] = torch.sigmoid(logits.float()).cpu().numpy()
        return out
