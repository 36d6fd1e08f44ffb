"""Replay stopping rules on the tuning curves of finished fine-tuning runs: epochs saved, tuning AP lost.

    python benchmarks/early_stopping.py RUN_DIR [RUN_DIR ...] [--patience 5] [--ratio 1.0]

Each ``RUN_DIR`` is a ``behrt-rope finetune`` output whose run went the full ``max_epochs`` (its
``logs/metrics.csv`` holds the tuning macro AP of every epoch). A stopping rule only decides *when* a run ends:
the learning-rate schedule and every epoch before the stop are the same as in the full run, so replaying the
rule on the full curve gives exactly the epochs a stopped run would take and the best tuning macro AP it would
keep. Prints JSON: per run, the full run's epochs, best epoch and best tuning macro AP, and for each rule the
epochs run and the best AP kept; the baseline is a fixed patience (Lightning's ``EarlyStopping``) with the
same minimum, in the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from behrt_rope.training.early_stopping import GrowingPatienceEarlyStopping  # noqa: E402

METRIC = "val/macro_ap"


def tuning_curve(run: Path) -> np.ndarray:
    """Tuning macro AP after each epoch of ``run`` (the last row of each epoch; the final re-validation of the
    kept checkpoint, logged after the last epoch, is left out)."""
    log = pd.read_csv(run / "logs" / "metrics.csv").dropna(subset=[METRIC])
    per_epoch = log.groupby("epoch", sort=True)[METRIC].first().to_numpy()
    epochs = json.loads((run / "metrics.json").read_text())["epochs"]
    return per_epoch[:epochs]


def replay(curve: np.ndarray, patience: int, ratio: float) -> dict[str, float | int]:
    """Epochs a run with this rule takes on ``curve`` and the best tuning macro AP it keeps (the callback
    fine-tuning uses, fed the logged values one check at a time)."""
    rule = GrowingPatienceEarlyStopping(monitor=METRIC, mode="max", patience=patience, ratio=ratio)
    epochs = next((epoch for epoch, value in enumerate(curve, start=1) if rule.check(value)), len(curve))
    return {"epochs": epochs, "best_ap": round(float(curve[:epochs].max()), 5)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--patience", type=int, default=5)
    parser.add_argument("--ratio", type=float, default=1.0)
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    for run in args.runs:
        curve = tuning_curve(run)
        rows.append(
            {
                "run": str(run),
                "full": {
                    "epochs": len(curve),
                    "best_epoch": int(curve.argmax()) + 1,
                    "best_ap": round(float(curve.max()), 5),
                },
                "fixed_patience (baseline)": replay(curve, args.patience, 0.0),
                f"growing_patience (ratio {args.ratio})": replay(curve, args.patience, args.ratio),
            }
        )
    totals = {
        name: {
            "epochs": sum(r[name]["epochs"] for r in rows),
            "best_ap_lost": round(sum(r["full"]["best_ap"] - r[name]["best_ap"] for r in rows), 5),
        }
        for name in rows[0]
        if name != "run"
    }
    print(json.dumps({"patience": args.patience, "runs": rows, "totals": totals}, indent=1))


if __name__ == "__main__":
    main()
