"""The Lightning ``Trainer`` we build: what it prints on every run."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from pytorch_lightning.utilities._pytree import _tree_flatten

from behrt_rope.training.config import TrainerConfig
from behrt_rope.training.trainer import build_trainer


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def lightning_messages() -> Iterator[list[str]]:
    """What Lightning logs through its rank-zero logger while the test runs."""
    logger = logging.getLogger("pytorch_lightning.utilities.rank_zero")
    collect = Collect()
    logger.addHandler(collect)
    yield collect.messages
    logger.removeHandler(collect)


def test_the_hosted_logger_advertisement_is_dropped_and_device_facts_kept(
    tmp_path: Path, lightning_messages: list[str]
) -> None:
    build_trainer(TrainerConfig(max_steps=1, accelerator="cpu"), tmp_path, monitor=None, mode="min")
    build_trainer(TrainerConfig(max_steps=1, accelerator="cpu"), tmp_path, monitor=None, mode="min")
    assert any(m.startswith("GPU available") for m in lightning_messages), lightning_messages
    assert not [m for m in lightning_messages if "litlogger" in m]
    assert len(logging.getLogger("pytorch_lightning.utilities.rank_zero").filters) == 1  # not one per trainer


def test_lightnings_own_torch_deprecation_is_not_shown(tmp_path: Path) -> None:
    build_trainer(TrainerConfig(max_steps=1, accelerator="cpu"), tmp_path, monitor=None, mode="min")
    with warnings.catch_warnings(record=True) as shown:
        _tree_flatten({"a": 1})  # Lightning builds torch's deprecated LeafSpec here on every step's outputs
        warnings.warn("something else to see", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in shown] == ["something else to see"]
