"""``finetune`` under DDP: two CPU processes (gloo) train one model; rank 0 alone writes its outputs."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures_training import FAST_TRAINER, TINY_MODEL, build_etl, read_metrics

from behrt_rope import schema as S
from behrt_rope.cli import main
from behrt_rope.training.bundle import load_bundle

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_finetune_ddp_gloo_on_two_cpu_processes(tmp_path: Path) -> None:
    etl = build_etl(tmp_path / "cohort", patients=160, seed=5)
    out = tmp_path / "ddp"
    argv = ["finetune", "--data", str(etl), "--out", str(out), "--max-epochs", "10", "task.min_label_count=2"]
    ddp = ["trainer.strategy=ddp", "trainer.ddp_backend=gloo", "trainer.accelerator=cpu", "trainer.devices=2"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    # Lightning's launcher re-runs this very command line once per extra rank.
    command = [*argv, *TINY_MODEL, *FAST_TRAINER, *ddp, "trainer.max_steps=4"]
    done = subprocess.run(
        [sys.executable, "-m", "behrt_rope", *command],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = read_metrics(out)
    assert metrics["steps"] == 4 and math.isfinite(metrics["tuning_macro_ap"]) and math.isfinite(metrics["tuning_loss"])
    assert (out / S.LOG_FILE).read_text().count("tuning macro AP") == 1  # metrics and model.pt from rank 0 only
    choice = metrics["distillation_choice"]  # the ranks took one decision on the second training
    lead = choice["first_training_against_path"]
    assert lead["path_leads"] == (lead["path_macro_ap"] > lead["deep_macro_ap"])
    assert lead["deep_clearly_leads"] == (lead["deep_minus_path"]["low"] > 0)
    assert (0.8 in choice["weights_tried"]) <= (
        not lead["deep_clearly_leads"]
    )  # none where the deep part clearly leads
    bundle = load_bundle(out, "multilabel")
    assert bundle["model_config"].hidden_size == 16 and len(bundle["labels"]) == metrics["labels"]
    # the DDP-trained model scores new histories like any other
    pred = tmp_path / "pred.parquet"
    assert main(["predict", "--model", str(out), "--input", str(tmp_path / "cohort" / "raw"), "--out", str(pred)]) == 0
    assert pred.stat().st_size > 0
