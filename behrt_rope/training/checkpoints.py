"""Lightning checkpoints that load without running code, save atomically and resume exactly.

* :func:`load_checkpoint` reads a checkpoint with ``torch.load(weights_only=True)``: tensors, numbers,
  strings and containers only, plus the (empty) allow-list :data:`SAFE_GLOBALS`; a checkpoint that holds
  anything else (a pickle payload, say) is refused with a one-line error before it can run.
* :class:`SafeCheckpointIO` is the Trainer's checkpoint plugin: loads through :func:`load_checkpoint`, saves
  through a temporary file renamed into place, so a kill mid-save leaves the previous checkpoint intact.
* :class:`ExactResume` adds to each checkpoint what Lightning does not keep: the train sampler's position in
  its epoch and the random-number states (torch CPU and CUDA, numpy, Python), so that training resumed from
  a mid-epoch checkpoint takes the very same steps as an uninterrupted run.
"""

from __future__ import annotations

import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO

from behrt_rope import atomic
from behrt_rope.data.batching import BucketBatchSampler
from behrt_rope.errors import ArtifactError

SAFE_GLOBALS: list[Any] = []
"""Classes a checkpoint may hold beyond tensors and plain containers. Ours need none: every state we add
is converted to plain values (see :func:`rng_state`)."""
RESUME_KEY = "behrt_rope_resume"


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """A checkpoint's dict, read without unpickling arbitrary objects (``weights_only=True``)."""
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise ArtifactError(f"{path}: refusing to load the checkpoint: {_unsafe_reason(err)}") from None
    except (RuntimeError, EOFError, OSError, ValueError) as err:
        raise ArtifactError(f"{path}: not a readable checkpoint ({_first_line(err)})") from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise ArtifactError(f"{path}: not a Lightning checkpoint (no state_dict)")
    return checkpoint


def load_task_weights(task: torch.nn.Module, path: str | Path) -> None:
    """Load a checkpoint's weights into a freshly built Lightning task (strict)."""
    task.load_state_dict(load_checkpoint(path)["state_dict"])


class SafeCheckpointIO(TorchCheckpointIO):
    """Checkpoint I/O for the Trainer: safe loads, atomic saves."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        with atomic.atomic_path(path) as tmp:
            torch.save(checkpoint, tmp)

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> Any:
        return load_checkpoint(path)


class ExactResume(pl.Callback):
    """Saves and restores the train sampler's position and the random-number states with each checkpoint.

    The sampler is told where to continue in ``on_load_checkpoint``, before Lightning creates the train
    iterator; the random states are put back just before the first batch after the restore, where an
    uninterrupted run would stand with the states saved after the checkpoint's batch.
    """

    def __init__(self, sampler: BucketBatchSampler) -> None:
        self.sampler = sampler
        self._pending_rng: dict[str, Any] | None = None

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        checkpoint[RESUME_KEY] = {
            "epoch": int(trainer.current_epoch),
            "batches_done": int(trainer.fit_loop.epoch_loop.batch_progress.current.processed),  # type: ignore[attr-defined]
            "rng": rng_state(),
        }

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        state = checkpoint.get(RESUME_KEY)
        if state is None:  # a checkpoint from before exact resume: Lightning's own (epoch-level) resume
            return
        self.sampler.resume_at(int(state["epoch"]), int(state["batches_done"]))
        self._pending_rng = state["rng"]

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if self._pending_rng is not None:
            set_rng_state(self._pending_rng)
            self._pending_rng = None


def rng_state() -> dict[str, Any]:
    """The global random states as tensors, ints and lists (all loadable with ``weights_only=True``)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()  # noqa: NPY002 (seed_everything seeds it)
    version, internal, gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": [str(kind), torch.from_numpy(np.asarray(keys).astype(np.int64)), int(pos), int(has_gauss), cached],
        "python": [version, list(internal), gauss],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Put back what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))  # noqa: NPY002
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


def _unsafe_reason(err: BaseException) -> str:
    """The line of torch's weights-only error that names what was refused."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    named = [line for line in lines if "Unsupported global" in line or "Unsupported operand" in line]
    reason = named[0] if named else (lines[0] if lines else type(err).__name__)
    return f"it holds objects outside the allow-list ({reason})"


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
