"""Helpers shared by the training tests: a tiny synthetic cohort through the real ETL, and tiny CLI settings.

Plain functions, not fixtures: each test module wraps them in the (module-scoped) fixtures it needs, so no
conftest is involved and nothing here runs unless a test asks for it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from behrt_rope import schema as S
from behrt_rope.cli import main
from behrt_rope.data.datasets import labelled_dataset
from behrt_rope.data.labels import TaskConfig, build_samples, label_index, targets
from behrt_rope.data.sequences import load_tokens
from behrt_rope.training.loaders import SplitData
from synthetic_data.generator import SynthConfig, generate

TINY_MODEL = (
    "model.hidden_size=16",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.intermediate_size=32",
    "model.time2vec_periodic=4",
)
"""A model small enough that a pre-training epoch on the tiny cohort takes well under a second."""

FAST_TRAINER = (
    "trainer.batch_size=32",
    "trainer.progress_bar=false",
    "trainer.log_every_n_steps=1",
    "trainer.accelerator=cpu",
    "model.state_path=0",
)
"""Quiet, fast trainer settings, on the CPU on any host: several tests assert bitwise reproducibility, which
holds on the CPU only (a GPU's bf16 autocast and atomic reductions break it). The GPU tests override it. No
state path: its fit after the deep part would add seconds to every fine-tuning (tests/test_state_path.py
turns it on)."""


def write_cohort(raw_dir: Path, patients: int, seed: int = 0) -> Path:
    """A seeded synthetic cohort in the visits format (CSV) in ``raw_dir``."""
    raw_dir.mkdir(parents=True, exist_ok=True)
    patients_df, events_df = generate(SynthConfig(patients=patients, seed=seed))
    patients_df.to_csv(raw_dir / f"{S.PATIENTS_TABLE}.csv", index=False)
    events_df.to_csv(raw_dir / f"{S.EVENTS_TABLE}.csv", index=False)
    return raw_dir


def build_etl(root: Path, patients: int = 160, seed: int = 0) -> Path:
    """Cohort + ``behrt-rope etl`` into ``root/etl``; returns the ETL output directory."""
    raw = write_cohort(root / "raw", patients, seed)
    etl = root / "etl"
    status = main(["etl", "--input", str(raw), "--out", str(etl), "progress=false"])
    assert status == 0, "the ETL of the synthetic cohort failed"
    return etl


def pretrain_argv(data: Path, out: Path, *overrides: str, max_epochs: int = 1) -> list[str]:
    """``behrt-rope pretrain`` arguments with the tiny model and quiet, fast trainer settings."""
    return [
        "pretrain",
        "--data",
        str(data),
        "--out",
        str(out),
        "--max-epochs",
        str(max_epochs),
        *TINY_MODEL,
        *FAST_TRAINER,
        *overrides,
    ]


def read_metrics(out: Path) -> dict[str, Any]:
    """A stage's ``metrics.json``."""
    return json.loads((out / S.METRICS_FILE).read_text())


def build_finetuned(root: Path, patients: int = 160, seed: int = 0, *overrides: str) -> tuple[Path, Path]:
    """Cohort + ETL + a 1-epoch tiny ``finetune`` (no pre-training); returns (raw input dir, model dir)."""
    etl = build_etl(root, patients, seed)
    model = root / "ft"
    argv = ["finetune", "--data", str(etl), "--out", str(model), "--max-epochs", "1", "task.min_label_count=2"]
    # one training, not the default's second one at another distillation weight (tests/test_distillation_choice.py)
    status = main([*argv, *TINY_MODEL, *FAST_TRAINER, "sparse_time_distillation=0", *overrides])
    assert status == 0, "fine-tuning the tiny model failed"
    return root / "raw", model


def split_data(root: Path, bundle: dict[str, Any], name: str) -> SplitData:
    """Split ``name`` of ``build_finetuned``'s ETL under ``root``, next-visit samples with the fine-tuned model's
    labels (``bundle``)."""
    label_of_token = label_index(np.asarray(bundle["label_token_ids"]), len(bundle["vocab"]))
    part = load_tokens(root / "etl").split(name)
    samples = build_samples(part, TaskConfig())
    data, collate = labelled_dataset(part, samples.rows, samples.cuts, samples.label_spans, label_of_token, "visit")
    return SplitData(part, samples, data, collate, targets(part, samples, label_of_token))


def error_line(stderr: str) -> str:
    """The CLI's error line in ``stderr``: exactly one ``behrt-rope ...: error: ...`` line, no traceback.

    Log lines of the stage may come before it (the console log writes to stderr too)."""
    lines = [line for line in stderr.strip().splitlines() if line.startswith("behrt-rope")]
    assert len(lines) == 1 and ": error: " in lines[0] and "Traceback" not in stderr, stderr
    return lines[0]
