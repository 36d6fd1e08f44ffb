"""``model.pt``: everything a later stage needs from a trained model, loadable without Lightning.

A bundle holds the kind ('mlm' or 'multilabel'), the model configuration, the weights, the vocabulary, the
ETL settings that produced the training data and, for fine-tuned models, the labels and task.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from behrt_rope import schema as S
from behrt_rope.errors import ArtifactError
from behrt_rope.model.config import ModelConfig


def save_bundle(
    path: Path, kind: str, model_config: ModelConfig, state_dict: dict[str, torch.Tensor], **extra: Any
) -> None:
    """Write a bundle; ``extra`` holds plain Python values (lists, dicts, strings, numbers)."""
    payload = {
        "kind": kind,
        "model_config": dataclasses.asdict(model_config),
        "state_dict": {k: v.detach().cpu() for k, v in state_dict.items()},
        **extra,
    }
    torch.save(payload, path)


def load_bundle(stage_dir: str | Path, kind: str) -> dict[str, Any]:
    """Read ``stage_dir/model.pt`` and check it is a ``kind`` model."""
    path = Path(stage_dir) / S.MODEL_FILE
    if not path.exists():
        stage = "pretrain" if kind == "mlm" else "finetune"
        raise ArtifactError(f"{stage_dir}: {S.MODEL_FILE} not found; is this a `behrt-rope {stage}` output?")
    bundle = torch.load(path, map_location="cpu", weights_only=False)
    if bundle.get("kind") != kind:
        raise ArtifactError(f"{path}: holds a '{bundle.get('kind')}' model, expected '{kind}'")
    bundle["model_config"] = ModelConfig(**bundle["model_config"])
    return bundle


def task_state_dict(task: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The wrapped model's weights from a Lightning task (keys without the 'model.' prefix)."""
    return {k[len("model.") :]: v for k, v in task.state_dict().items() if k.startswith("model.")}
