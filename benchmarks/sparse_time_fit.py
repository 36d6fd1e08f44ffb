"""The sparse time regression's fit, as ``finetune`` and ``evaluate`` run it, against session 35's (the baseline).

    python benchmarks/sparse_time_fit.py --etl ETL_DIR [--runs finetune evaluate] [--max-samples 50000]

``finetune`` fits the model's sparse time path before its deep training, every label at its fixed
``sparse_time_c`` (:data:`~behrt_rope.evaluation.sparse_time.DEFAULT_C`), and that time counts against its
12-minute budget. ``evaluate`` fits the same regression as a reference with its C chosen: each C of
:data:`~behrt_rope.evaluation.sparse_time.C_GRID` on a sample of 60 labels, scored on the tuning split, then
every label at the chosen C, the sampled ones taken over. Both read the next-visit samples of the train split
(the same seeded subsample cap as ``finetune``). Per run, two variants:

* ``baseline``: session 35's fit: liblinear at scikit-learn's default tolerance (1e-4), and in the C choice
  each C fitted on its own, so each label's codes are chosen once per C;
* ``current``: the library's fit: liblinear at :data:`~behrt_rope.evaluation.sparse_time.TOL`, the codes of
  each label chosen once for the whole grid.

Prints one JSON object: per run and variant the seconds (wall, all cores), the C (with the C choice, the tuning
macro AP of each C on the sampled labels) and the regression's own tuning macro AP over every label; then how
far apart the two variants' tuning logits are. The variants run in this process one after the other, so they
share the host's load.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from behrt_rope import schema as S
from behrt_rope.data.labels import (
    TaskConfig,
    build_samples,
    fit_label_vocabulary,
    label_index,
    resolve_min_label_count,
    subsample_index,
    targets,
)
from behrt_rope.data.sequences import load_tokens, load_vocabulary
from behrt_rope.evaluation.baseline import tuning_label_sample
from behrt_rope.evaluation.sparse_time import (
    C_GRID,
    DEFAULT_C,
    TOL,
    TUNING_LABELS,
    fit_sparse_time_grid,
)
from behrt_rope.evaluation.time_features import TimeFeatures, time_features
from behrt_rope.training.tasks import macro_average_precision

BASELINE_TOL = 1e-4
"""scikit-learn's default tolerance, which the fit used until session 36."""


def fit_at(
    train: TimeFeatures, y: np.ndarray, tune: TimeFeatures, y_tune: np.ndarray, tol: float, choose_once: bool | None
) -> dict[str, Any]:
    """The regression at liblinear's ``tol``: every label at :data:`DEFAULT_C` (``choose_once`` None, as
    ``finetune``), or its C chosen first (as ``evaluate``), each label's codes chosen once for the grid
    (``choose_once``) or once per C. Returns its figures and (key ``logits``) the ``(N_tune, L)`` tuning
    logits."""
    started, report, start = time.perf_counter(), {}, None
    chosen = DEFAULT_C
    if choose_once is not None:
        labels = tuning_label_sample(y, y_tune, TUNING_LABELS, 0)
        if choose_once:
            fits = fit_sparse_time_grid(train, y, C_GRID, labels=labels, tol=tol)
        else:
            fits = {c: fit_sparse_time_grid(train, y, (c,), labels=labels, tol=tol)[c] for c in C_GRID}
        by_c = {c: macro_average_precision(y_tune[:, labels], fit.logits(tune)[:, labels]) for c, fit in fits.items()}
        chosen = max(C_GRID, key=lambda c: (by_c[c], -C_GRID.index(c)))
        start = fits[chosen]
        report = {
            "codes_chosen": "once for the grid" if choose_once else "once per C",
            "choice_seconds": round(time.perf_counter() - started, 1),
            "tuning_macro_ap_by_c": {f"{c:g}": round(v, 5) for c, v in by_c.items()},
        }
    full = fit_sparse_time_grid(train, y, (chosen,), start=start, tol=tol)[chosen]
    logits = full.logits(tune)
    return {
        "tol": tol,
        **report,
        "seconds": round(time.perf_counter() - started, 1),
        "c": chosen,
        "tuning_macro_ap": round(macro_average_precision(y_tune, logits), 5),
        "logits": logits,
    }


def compare(train: TimeFeatures, y: np.ndarray, tune: TimeFeatures, y_tune: np.ndarray, choose: bool) -> dict:
    """``baseline`` and ``current`` of one run (``choose``: as ``evaluate``, else as ``finetune``), the speed-up
    and how far apart their tuning logits are."""
    runs = {
        "baseline": fit_at(train, y, tune, y_tune, BASELINE_TOL, False if choose else None),
        "current": fit_at(train, y, tune, y_tune, TOL, True if choose else None),
    }
    gap = np.abs(runs["baseline"].pop("logits") - runs["current"].pop("logits"))
    return {
        **runs,
        "speedup": round(runs["baseline"]["seconds"] / max(runs["current"]["seconds"], 1e-9), 2),
        "tuning_logit_difference": {"max": round(float(gap.max()), 4), "mean": round(float(gap.mean()), 5)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--etl", type=Path, required=True, help="an ETL output directory")
    parser.add_argument("--runs", nargs="+", default=["finetune", "evaluate"], choices=["finetune", "evaluate"])
    parser.add_argument("--max-samples", type=int, default=50_000, help="finetune's sparse_time_max_samples")
    args = parser.parse_args()
    seqs, task = load_tokens(args.etl), TaskConfig()
    train_seqs, tune_seqs = seqs.split(S.TRAIN), seqs.split(S.TUNING)
    train_samples = build_samples(train_seqs, task)
    label_ids = fit_label_vocabulary(train_seqs, train_samples, resolve_min_label_count(task, len(train_samples)))
    label_of_token = label_index(label_ids, len(load_vocabulary(args.etl)))
    keep = subsample_index(len(train_samples), args.max_samples, 0)
    fit_samples, tune_samples = train_samples.take(keep), build_samples(tune_seqs, task)
    y = targets(train_seqs, fit_samples, label_of_token)
    y_tune = targets(tune_seqs, tune_samples, label_of_token)
    train = time_features(train_seqs, fit_samples, label_of_token)
    tune = time_features(tune_seqs, tune_samples, label_of_token)
    runs = {run: compare(train, y, tune, y_tune, choose=run == "evaluate") for run in args.runs}
    print(
        json.dumps(
            {
                "benchmark": "sparse_time_fit",
                "etl": str(args.etl),
                "cores": os.cpu_count(),
                "train_samples": len(y),
                "tuning_samples": len(y_tune),
                "labels": int(y.shape[1]),
                **runs,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
