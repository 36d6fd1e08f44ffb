"""Shared set-up of the quality benchmark's reach tests: a small cohort with its oracle and ETL output, and the
two anchors of an evaluation's ceiling."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from behrt_rope.cli import main


def cohort_with_oracle(tmp_path: Path, patients: int, seed: int, *settings: str) -> tuple[Path, Path]:
    """``synth`` (with ``oracle=true`` and the synth ``settings``) and ``etl`` (a 50 / 10 / 40 split) in
    ``tmp_path``; returns the cohort and ETL folders."""
    cohort, etl = tmp_path / "cohort", tmp_path / "etl"
    synth = ["synth", "--out", str(cohort), "--patients", str(patients), "--seed", str(seed), *settings]
    assert main([*synth, "oracle=true"]) == 0
    split = ("etl.split.train=0.5", "etl.split.tuning=0.1", "etl.split.held_out=0.4")
    assert main(["etl", "--input", str(cohort), "--out", str(etl), "progress=false", *split]) == 0
    return cohort, etl


def ceiling_metrics(low: float, high: float) -> dict[str, Any]:
    """The part of ``metrics.json`` a reach reads: the tuned logistic regression's and the oracle's macro AP."""
    anchors = {"logistic_regression": low, "oracle": high}
    return {"ceiling": {"predictors": {name: {"overall": {"macro_ap": ap}} for name, ap in anchors.items()}}}
