"""Batched, gradient-free scoring with a fine-tuned model (CPU or GPU)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from behrt_rope.data.batching import pad_batch
from behrt_rope.data.datasets import PatientDataset
from behrt_rope.data.sequences import Sequences
from behrt_rope.model.heads import BehrtForMultiLabel
from behrt_rope.training.tasks import model_inputs


def resolve_device(name: str) -> torch.device:
    """'auto' picks CUDA when available."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def multilabel_model(bundle: dict[str, Any]) -> BehrtForMultiLabel:
    """A fine-tuned model from its bundle, in eval mode."""
    model = BehrtForMultiLabel(bundle["model_config"], len(bundle["labels"]), bundle["pooling"])
    model.load_state_dict(bundle["state_dict"])
    return model.eval()


@torch.inference_mode()
def score(
    model: BehrtForMultiLabel,
    seqs: Sequences,
    rows: np.ndarray | None = None,
    cuts: np.ndarray | None = None,
    batch_size: int = 256,
    device: torch.device | None = None,
    progress: bool = False,
) -> np.ndarray:
    """Probabilities (N, L) float32 for the first ``cuts[i]`` tokens of patient ``rows[i]`` (default: all
    patients, whole streams). Items are batched in length order to keep padding low."""
    device = device or torch.device("cpu")
    model = model.to(device)
    dataset = PatientDataset(seqs, rows, cuts)
    order = np.argsort(dataset.lengths, kind="stable")
    out = np.zeros((len(dataset), model.num_labels), dtype=np.float32)
    autocast = device.type == "cuda" and torch.cuda.is_bf16_supported()
    for start in tqdm(range(0, len(order), batch_size), desc="scoring", disable=not progress, unit="batch"):
        index = order[start : start + batch_size]
        batch = {k: v.to(device) for k, v in pad_batch([dataset[int(i)] for i in index]).items()}
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(**model_inputs(batch))
        out[index] = torch.sigmoid(logits.float()).cpu().numpy()
    return out
