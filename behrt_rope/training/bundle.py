"""A trained model on disk: ``model.safetensors`` (weights) and ``model.json`` (everything else).

Neither file can run code when read: safetensors holds raw tensors behind a JSON header, and the
description is plain JSON (kind 'mlm' or 'multilabel', the model configuration as ``dataclasses.asdict``,
the vocabulary, the ETL settings, the versions that wrote it and, for fine-tuned models, labels and task).
Nothing here unpickles: a pickle put where a model file is expected, including the ``model.pt`` of older
versions, is refused with a one-line :class:`~behrt_rope.errors.ArtifactError` before any of it is read.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch

import behrt_rope
from behrt_rope import atomic
from behrt_rope import config as config_lib
from behrt_rope import schema as S
from behrt_rope.errors import ArtifactError
from behrt_rope.model.config import ModelConfig
from behrt_rope.stage import require_done

FORMAT = "behrt-rope-model"
FORMAT_VERSION = 1
ADDED_LATER: dict[str, Any] = {
    "history_max": False,
    "label_attention_keys": "visit",
    "age_basis": 0,
    "label_own_code": False,
    "wide_time": False,
    "sex_embedding": False,
    "label_code_tie": False,
    "label_first_record": False,
    "label_time_steps": False,
    "sparse_time": False,
    "visit_gap": False,
    "state_filter": 0,
    "state_path_reach": 0,
    "state_path": 0,
    "state_path_copies": 1,
}
"""ModelConfig fields added after format version 1, with the value that a ``model.json`` written before them
means: the model as it was then (their current defaults would describe a different set of weights)."""


def save_bundle(
    out_dir: Path, kind: str, model_config: ModelConfig, state_dict: dict[str, torch.Tensor], **extra: Any
) -> None:
    """Write ``out_dir/model.safetensors`` and ``out_dir/model.json`` (each atomically, weights first).

    ``extra`` holds JSON values (lists, dicts, strings, numbers, None).
    """
    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in state_dict.items()}
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "kind": kind,
        "model_config": dataclasses.asdict(model_config),
        "versions": {"behrt_rope": behrt_rope.__version__, "torch": torch.__version__},
        **extra,
    }
    text = json.dumps(meta, indent=1)  # fails here, before any file is written, on a non-JSON value
    with atomic.atomic_path(out_dir / S.MODEL_WEIGHTS_FILE) as tmp:
        safetensors.torch.save_file(tensors, str(tmp), metadata={"format": FORMAT, "kind": kind})
    atomic.write_text(out_dir / S.MODEL_META_FILE, text + "\n")


def load_bundle(stage_dir: str | Path, kind: str) -> dict[str, Any]:
    """Read a finished model directory; returns its description with ``model_config`` (a ModelConfig) and
    ``state_dict``. A directory without its ``.done`` marker (an interrupted run) is refused."""
    producer = "pretrain" if kind == "mlm" else "finetune"
    folder = require_done(stage_dir, producer)
    weights, meta_path = folder / S.MODEL_WEIGHTS_FILE, folder / S.MODEL_META_FILE
    if not weights.exists() or not meta_path.exists():
        if (folder / S.LEGACY_MODEL_FILE).exists():
            raise ArtifactError(
                f"{folder / S.LEGACY_MODEL_FILE}: refusing a pickle-based model file (loading one can run any code "
                f"it holds); this version reads only {S.MODEL_WEIGHTS_FILE} + {S.MODEL_META_FILE}: "
                f"rerun `behrt-rope {producer}` to write them"
            )
        missing = S.MODEL_WEIGHTS_FILE if not weights.exists() else S.MODEL_META_FILE
        raise ArtifactError(f"{folder}: {missing} not found; is this a `behrt-rope {producer}` output?")
    meta = _read_meta(meta_path)
    if meta.get("kind") != kind:
        raise ArtifactError(f"{meta_path}: holds a '{meta.get('kind')}' model, expected '{kind}'")
    try:
        stored = meta.get("model_config") or {}
        meta["model_config"] = config_lib.build(ModelConfig, {**ADDED_LATER, **stored} if stored else stored)
    except config_lib.ConfigError as err:
        raise ArtifactError(f"{meta_path}: model_config: {err}") from None
    meta["state_dict"] = read_weights(weights)
    return meta


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file; anything else (a pickle, say) is refused unread."""
    try:
        return safetensors.torch.load_file(str(path), device="cpu")
    except (safetensors.SafetensorError, OSError, ValueError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ArtifactError(f"{path}: not a safetensors weights file ({reason}); refusing to load it") from None


def _read_meta(path: Path) -> dict[str, Any]:
    try:
        meta = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as err:
        reason = str(err).splitlines()[0]
        raise ArtifactError(f"{path}: not a behrt-rope model description (invalid JSON: {reason})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ArtifactError(f'{path}: not a behrt-rope model description (no "format": "{FORMAT}")')
    if int(meta.get("format_version", 0)) > FORMAT_VERSION:
        raise ArtifactError(
            f"{path}: model format version {meta['format_version']} is newer than this behrt-rope reads "
            f"({FORMAT_VERSION}); upgrade behrt-rope"
        )
    return meta


def task_state_dict(task: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The wrapped model's weights from a Lightning task (keys without the 'model.' prefix)."""
    return {k[len("model.") :]: v for k, v in task.state_dict().items() if k.startswith("model.")}
