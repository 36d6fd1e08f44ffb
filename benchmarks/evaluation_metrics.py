"""The cost of one predictor's headline metrics and their bootstrap intervals at a large label space.

    python benchmarks/evaluation_metrics.py [--samples 37537] [--labels 297] [--bootstrap 200] [--seed 0]

``evaluate`` scores every predictor (model, deep part, four references) on all held-out samples and at the
oracle's cuts, each time with the six headline metrics, their 200 bootstrap replicates, and again on the
new-onset pairs. At hundreds of labels the pooled (micro) metrics dominate: N x L pairs to rank. This script
times, on random scores with a per-label signal (the same arrays for both):

* ``one_ranking``: :func:`~behrt_rope.evaluation.metrics.summary_and_replicates`, which ranks the pairs once
  per code, once pooled and once per sample and reads the point values and every replicate off them;
* ``separate`` (the named baseline, the route ``evaluate`` took until session 15): the point values with
  scikit-learn's pooled ``average_precision_score`` and ``roc_auc_score`` plus the per-code and per-sample
  rankings, then the replicates from rankings built again;
* ``macro_ap_only``: :func:`~behrt_rope.evaluation.metrics.macro_ap_and_replicates`, what ``finetune``'s
  clearly-better choices read (macro AP and its replicates alone), against ``one_ranking``'s route to the same
  numbers (session 53's).

Prints ONE JSON object with the seconds of each (best of ``--repeats``), the speed-up, and the largest
difference between the two routes' point values (they compute the same metrics); the same for the macro-AP-only
route against ``one_ranking`` (seconds, speed-up and the largest difference of their macro AP replicates).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from sklearn.metrics import average_precision_score, roc_auc_score

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from behrt_rope.evaluation.metrics import (  # noqa: E402
    HEADLINE_METRICS,
    bootstrap_replicates,
    macro_ap_and_replicates,
    per_column_scores,
    summary_and_replicates,
)


def cohort_like(n: int, labels: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(y (N, L) bool, scores (N, L) float32)``: label rates spread like a long-tailed vocabulary (0.1% to
    10%) and scores that rank positives higher with a per-label strength."""
    rng = np.random.default_rng(seed)
    rate = np.exp(rng.uniform(np.log(0.001), np.log(0.1), labels))
    y = rng.random((n, labels)) < rate
    strength = rng.uniform(0.2, 2.0, labels)
    logits = np.log(rate / (1 - rate)) + strength * y + rng.normal(0.0, 1.0, (n, labels))
    return y, (1.0 / (1.0 + np.exp(-logits))).astype(np.float32)


def separate(y: np.ndarray, s: np.ndarray, n_bootstrap: int, seed: int) -> dict[str, float]:
    """The pre-session-15 route: point values apart (pooled metrics by scikit-learn), replicates apart."""
    code_ap, code_auroc = per_column_scores(y, s)
    sample_ap, sample_auroc = per_column_scores(y.T, s.T)
    point = {
        "micro_ap": float(average_precision_score(y.ravel(), s.ravel())),
        "micro_auroc": float(roc_auc_score(y.ravel(), s.ravel())),
        "macro_ap": float(np.nanmean(code_ap)),
        "macro_auroc": float(np.nanmean(code_auroc)),
        "samples_ap": float(np.nanmean(sample_ap)),
        "samples_auroc": float(np.nanmean(sample_auroc)),
    }
    bootstrap_replicates(y, s, None, n_bootstrap, seed)
    return point


def one_ranking(y: np.ndarray, s: np.ndarray, n_bootstrap: int, seed: int) -> dict[str, float]:
    summary, _ = summary_and_replicates(y, s, None, n_bootstrap, seed)
    return {name: float(summary[name]) for name in HEADLINE_METRICS}


def macro_replicates_of_summary(y: np.ndarray, s: np.ndarray, n_bootstrap: int, seed: int) -> dict[str, Any]:
    """Macro AP's replicates read off the full summary (``finetune``'s choices until session 54)."""
    return {"replicates": summary_and_replicates(y, s, None, n_bootstrap, seed)[1]["macro_ap"]}


def macro_replicates_alone(y: np.ndarray, s: np.ndarray, n_bootstrap: int, seed: int) -> dict[str, Any]:
    return {"replicates": macro_ap_and_replicates(y, s, n_bootstrap, seed)[1]}


def best_of(repeats: int, run: Callable[[], dict[str, Any]]) -> tuple[float, dict[str, Any]]:
    """Fastest wall seconds of ``repeats`` runs and the last run's values."""
    times, values = [], {}
    for _ in range(repeats):
        started = time.perf_counter()
        values = run()
        times.append(time.perf_counter() - started)
    return min(times), values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=37_537)
    parser.add_argument("--labels", type=int, default=297)
    parser.add_argument("--bootstrap", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    y, s = cohort_like(args.samples, args.labels, args.seed)
    out: dict[str, Any] = {"benchmark": "evaluation_metrics", **vars(args)}
    base_s, base = best_of(args.repeats, lambda: separate(y, s, args.bootstrap, args.seed))
    new_s, new = best_of(args.repeats, lambda: one_ranking(y, s, args.bootstrap, args.seed))
    out["seconds"] = {"separate (baseline)": round(base_s, 2), "one_ranking": round(new_s, 2)}
    out["speedup"] = round(base_s / new_s, 2)
    out["max_point_difference"] = max(abs(base[name] - new[name]) for name in HEADLINE_METRICS)
    full_s, full = best_of(args.repeats, lambda: macro_replicates_of_summary(y, s, args.bootstrap, args.seed))
    alone_s, alone = best_of(args.repeats, lambda: macro_replicates_alone(y, s, args.bootstrap, args.seed))
    out["macro_ap_only"] = {
        "seconds": {"one_ranking (baseline)": round(full_s, 2), "macro_ap_only": round(alone_s, 2)},
        "speedup": round(full_s / alone_s, 2),
        "max_replicate_difference": float(np.max(np.abs(full["replicates"] - alone["replicates"]))),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
