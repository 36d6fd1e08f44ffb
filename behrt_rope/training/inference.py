"""Batched, gradient-free scoring with a fine-tuned model (CPU or GPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from tqdm.auto import tqdm

from behrt_rope import schema as S
from behrt_rope.data.batching import model_inputs
from behrt_rope.data.datasets import VisitScoredDataset, labelled_dataset
from behrt_rope.data.sequences import Sequences
from behrt_rope.errors import ArtifactError
from behrt_rope.model.heads import BehrtForMultiLabel


def resolve_device(name: str) -> torch.device:
    """'auto' picks CUDA when available."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def multilabel_model(bundle: dict[str, Any], where: str | Path = "the model directory") -> BehrtForMultiLabel:
    """A fine-tuned model from its bundle, in eval mode. Weights that do not fit the model its description
    builds (files of two runs or versions side by side in ``where``) stop with a one-line ArtifactError."""
    model = BehrtForMultiLabel(bundle["model_config"], len(bundle["labels"]), bundle["pooling"])
    try:
        model.load_state_dict(bundle["state_dict"])
    except RuntimeError as err:
        detail = next((line.strip() for line in str(err).splitlines()[1:] if line.strip()), str(err))
        raise ArtifactError(
            f"{where}: {S.MODEL_WEIGHTS_FILE} does not fit the model {S.MODEL_META_FILE} describes ({detail[:200]}); "
            "the two files come from different runs or versions: rerun `behrt-rope finetune`"
        ) from None
    return model.eval()


Part = Literal["model", "deep", "path", "states", "learned"]
PARTS: tuple[Part, ...] = ("model", "deep", "path", "states", "learned")
"""What :func:`score_parts` can score: the whole model; its deep part (encoder and fine-tuning head) alone; its
sparse time path alone; its state path alone; its learned parts (``learned``: the model without the sparse
time path, i.e. the deep part mixed with the state path at the state path's share; the deep part alone when
that share is 0)."""


def score(
    model: BehrtForMultiLabel,
    seqs: Sequences,
    rows: np.ndarray | None = None,
    cuts: np.ndarray | None = None,
    batch_size: int = 256,
    device: torch.device | None = None,
    progress: bool = False,
    part: Part = "model",
) -> np.ndarray:
    """Probabilities (N, L) float32 for the first ``cuts[i]`` tokens of patient ``rows[i]`` (default: every
    patient's whole stream, i.e. as of its last visit). Each cut must end with a visit's [SEP].
    ``part``: one of :data:`PARTS`.

    With visit pooling, all of a patient's samples are scored in one visit-causal pass; items are batched
    in length order to keep padding low. Puts ``model`` in eval mode.
    """
    return score_parts(model, seqs, rows, cuts, batch_size, device, progress, (part,))[part]


def score_parts(
    model: BehrtForMultiLabel,
    seqs: Sequences,
    rows: np.ndarray | None = None,
    cuts: np.ndarray | None = None,
    batch_size: int = 256,
    device: torch.device | None = None,
    progress: bool = False,
    parts: tuple[Part, ...] = ("model",),
    logits: bool = False,
) -> dict[Part, np.ndarray]:
    """:func:`score` for several ``parts`` in one pass: ``{part: (N, L) float32 probabilities}`` (their logits
    with ``logits``). The encoder runs once per batch whatever the parts (the model's logit is the mix of the
    deep part's and the paths', as in :meth:`BehrtForMultiLabel.mix_logits`). Leaves ``model`` on ``device``,
    in eval mode, its tensors ordinary ones: it is moved outside inference mode (which covers only the forward
    passes), so that it can still be changed afterwards (e.g. ``finetune`` setting the path's share on a model
    it just scored on the GPU)."""
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ValueError(f"part must be one of {PARTS}, got {unknown[0]!r}")
    device = device or torch.device("cpu")
    model = model.to(device).eval()  # no dropout; a model straight from training is in train mode
    rows = np.arange(len(seqs)) if rows is None else np.asarray(rows, dtype=np.int64)
    cuts = seqs.lengths[rows] if cuts is None else np.asarray(cuts, dtype=np.int64)
    dataset, collate = labelled_dataset(seqs, rows, cuts, None, None, model.pooling)
    order = np.argsort(dataset.lengths, kind="stable")  # type: ignore[attr-defined]
    out = {part: np.zeros((len(rows), model.num_labels), dtype=np.float32) for part in parts}
    autocast = device.type == "cuda" and torch.cuda.is_bf16_supported()
    for start in tqdm(range(0, len(order), batch_size), desc="scoring", disable=not progress, unit="batch"):
        index = order[start : start + batch_size]
        batch = {k: v.to(device) for k, v in collate([dataset[int(i)] for i in index]).items()}
        with torch.inference_mode(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            scores = _part_logits(model, parts, batch)
        ids = _sample_ids(dataset, index)
        for part in parts:
            part_scores = scores[part].float()
            out[part][ids] = (part_scores if logits else torch.sigmoid(part_scores)).cpu().numpy()
    return out


def _part_logits(
    model: BehrtForMultiLabel, parts: tuple[Part, ...], batch: dict[str, torch.Tensor]
) -> dict[Part, torch.Tensor]:
    """The logits of each of ``parts``, the encoder run at most once."""
    inputs, score_at = model_inputs(batch), batch.get("score_at")
    logits: dict[Part, torch.Tensor] = {}
    has_path, has_states = model.sparse_time is not None, model.uses_state_path
    mixed = "model" in parts or "learned" in parts
    if "deep" in parts or mixed:
        logits["deep"] = model.deep_logits(**inputs, score_at=score_at)
    where = (inputs["token_ids"], inputs["visit_index"], inputs["ages"], score_at, inputs.get("sex"))
    if "path" in parts or ("model" in parts and has_path):
        logits["path"] = model.path_logits(*where)
    if "states" in parts or (mixed and has_states):
        logits["states"] = model.state_logits(*where)
    if "model" in parts:
        logits["model"] = model.mix_logits(logits["deep"], logits.get("path"), logits.get("states"))
    if "learned" in parts:
        logits["learned"] = model.mix_logits(logits["deep"], None, logits.get("states"), with_path=False)
    return {part: logits[part] for part in parts}


def _sample_ids(dataset: torch.utils.data.Dataset, items: np.ndarray) -> np.ndarray:
    """The input sample numbers of the model's output rows for these dataset items."""
    if isinstance(dataset, VisitScoredDataset):
        return np.concatenate([dataset.sample_order[dataset.groups[i] : dataset.groups[i + 1]] for i in items])
    return items
