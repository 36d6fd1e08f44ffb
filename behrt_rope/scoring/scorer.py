"""A fine-tuned model ready to score whole histories as of each patient's last visit."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

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

    On CPU, ``workers`` batches are scored at once, each by one thread running torch single-threaded
    (torch releases the GIL inside its kernels). The default model's matrices (a few thousand rows by 128
    to 384 columns) are too small for one product to keep two cores busy, whole batches side by side are
    not. ``workers=0``: one per torch thread (``torch.get_num_threads()``, the cores by default) on CPU,
    one on a GPU. Each batch is computed the same way whatever the number of workers.
    """

    def __init__(
        self,
        model: BehrtForMultiLabel,
        device: torch.device,
        precision: Precision = "auto",
        max_tokens: int = 4096,
        max_batch: int = 1024,
        workers: int = 0,
    ) -> None:
        self.model = model.eval().to(device)
        self.device = device
        self.dtype = resolve_dtype(precision, device)
        self.max_tokens = max_tokens
        self.max_batch = max_batch
        if workers < 0:
            raise ValueError(f"workers must be >= 0 (0: automatic), got {workers}")
        self.workers = workers or (torch.get_num_threads() if device.type == "cpu" else 1)

    @property
    def num_labels(self) -> int:
        return self.model.num_labels

    def score(self, seqs: Sequences) -> np.ndarray:
        """Probabilities ``(N, L)`` float32, row ``i`` for patient ``i`` of ``seqs`` as of its last token."""
        out = np.zeros((len(seqs), self.num_labels), dtype=np.float32)
        batches = iter_batches(
            seqs, self.max_tokens, score_last=self.model.pooling == "visit", max_batch=self.max_batch
        )
        if self.workers == 1:
            for rows, batch in batches:
                out[rows] = self._score_batch(batch)
            return out
        with ThreadPoolExecutor(self.workers, initializer=torch.set_num_threads, initargs=(1,)) as pool:
            for rows, probs in _in_order(pool, self._score_batch, batches, window=2 * self.workers):
                out[rows] = probs
        return out

    def _score_batch(self, batch: dict[str, torch.Tensor]) -> np.ndarray:
        """Probabilities ``(B, L)`` float32 of one padded batch (from :func:`iter_batches`)."""
        # inference mode and autocast are per thread: entered here, in whichever thread scores the batch
        with torch.inference_mode(), torch.autocast(self.device.type, self.dtype, enabled=self.dtype != torch.float32):
            batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
            logits = self.model(**model_inputs(batch), score_at=batch.get("score_at"))  # (B, L)
            return torch.sigmoid(logits.float()).cpu().numpy()


def _in_order(
    pool: ThreadPoolExecutor,
    fn: Callable[[dict[str, torch.Tensor]], np.ndarray],
    batches: Iterator[tuple[np.ndarray, dict[str, torch.Tensor]]],
    window: int,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``(rows, fn(batch))`` for every batch, in order, with at most ``window`` batches built or in flight
    (so memory holds a few padded batches, not the shard's)."""
    pending: deque[tuple[np.ndarray, Future[np.ndarray]]] = deque()
    for rows, batch in batches:
        pending.append((rows, pool.submit(fn, batch)))
        if len(pending) >= window:
            done_rows, future = pending.popleft()
            yield done_rows, future.result()
    while pending:
        done_rows, future = pending.popleft()
        yield done_rows, future.result()
