"""A sparse logistic regression on binned time features of every label code, against a fine-tuned model.

    python benchmarks/sparse_time_lr.py --etl ETL_DIR [--model FINETUNE_DIR] [--c 0.03 0.1 0.3]

The gradient-boosted reference reads, per label, that label's own time features and only whether each other
code was ever recorded. This script asks what a *linear* model gets from the timing of every code, with an
L1 penalty: the generators' cross-code effects ("code p raises c from some years after p was first
recorded") are sparse, and an L1 fit can find the few pairs that matter among all of them where an L2 fit
spreads its weight. Nothing here knows a generator: the features are built from the ETL output alone,
from the same quantities as ``behrt_rope.evaluation.time_features`` (docs/evaluation.md), as indicator bins
so that the regression learns each shape:

* per label ``j``, its own code: ever recorded, log(1 + visits with it), visits since last recorded (0, 1,
  ..., 5+), days since (bins at 30, 90, 365 and 1,095 days), years since first recorded (bins at 1, 2, 3, 5
  and 8 years), recorded at the last visit;
* shared by all labels, every label code: years since first recorded in the same bins (0 when never) and
  recorded at the last visit;
* per sample: age in 10-year bins, sex, log(1 + visits so far), days since the previous visit in bins.

Fitted per label on the train split's next-visit samples (every visit), scored on the **tuning** split's
(held-out is never read), for each ``--c`` (the inverse L1 strength). Prints JSON: tuning macro AP of the
fine-tuned model (``--model``, whose labels are the ones scored) and of the sparse regression at each C,
with the mean number of non-zero weights per label, the CPU seconds of the fits, and the macro AP of the mean
of its logit and the model's (an ensemble of the two).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import sklearn
from sklearn.linear_model import LogisticRegression

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from behrt_rope import schema as S  # noqa: E402
from behrt_rope.data.labels import Samples, TaskConfig, build_samples, label_index, targets  # noqa: E402
from behrt_rope.data.sequences import Sequences, load_tokens  # noqa: E402
from behrt_rope.evaluation.time_features import TimeFeatures, time_features  # noqa: E402
from behrt_rope.training.bundle import load_bundle  # noqa: E402
from behrt_rope.training.inference import multilabel_model, score  # noqa: E402
from behrt_rope.training.tasks import macro_average_precision  # noqa: E402

VISITS_EDGES = (0.5, 1.5, 2.5, 3.5, 4.5)
DAYS_EDGES = (30.0, 90.0, 365.0, 1095.0)
YEARS_EDGES = (1.0, 2.0, 3.0, 5.0, 8.0)
AGE_EDGES = (10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0)
GAP_EDGES = (14.0, 30.0, 90.0, 365.0)


def bins(values: np.ndarray, edges: tuple[float, ...]) -> np.ndarray:
    """One-hot bin of each value, ``values.shape + (len(edges) + 1,)``; NaN (never recorded) -> all zeros.

    >>> bins(np.array([0.2, 3.0, np.nan]), (1.0, 2.0)).tolist()
    [[1.0, 0.0, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]
    """
    out = np.eye(len(edges) + 1, dtype=np.float32)[np.digitize(np.nan_to_num(values, nan=0.0), edges)]
    return np.where(np.isnan(values)[..., None], 0.0, out).astype(np.float32)


def shared_design(f: TimeFeatures) -> sp.csr_matrix:
    """``(N, 7 L + 18)``: every label code's years-since-first bins and last-visit flag, and the per-sample bins."""
    per_code = f.per_code  # (N, L, 6): ever, n_visits, visits_since, days_since, years_since_first, in_last
    n = len(f)
    timing = np.concatenate([bins(per_code[:, :, 4], YEARS_EDGES), per_code[:, :, 5:6]], axis=2).reshape(n, -1)
    age, visits, gap, sex = (f.per_sample[:, i] for i in range(4))
    sample = [
        bins(age, AGE_EDGES),  # (n, 9)
        (sex[:, None] == np.arange(1, 4)).astype(np.float32),  # (n, 3) female, male, other
        np.log1p(visits)[:, None],  # (n, 1)
        bins(gap, GAP_EDGES),  # (n, 5) days since the previous visit (none at the first)
    ]
    return sp.csr_matrix(np.concatenate([timing, *sample], axis=1))


def own_design(f: TimeFeatures, j: int) -> np.ndarray:
    """``(N, 20)``: label ``j``'s own code in bins (see the module docstring)."""
    own = f.per_code[:, j]  # (N, 6)
    return np.concatenate(
        [
            own[:, 0:1],
            np.log1p(own[:, 1:2]),
            bins(own[:, 2], VISITS_EDGES),
            bins(own[:, 3], DAYS_EDGES),
            bins(own[:, 4], YEARS_EDGES),
            own[:, 5:6],
        ],
        axis=1,
    )


def l1_logistic_regression(c: float) -> LogisticRegression:
    """An L1-penalised logistic regression; scikit-learn 1.8 replaced ``penalty="l1"`` by ``l1_ratio=1``."""
    if tuple(int(part) for part in sklearn.__version__.split(".")[:2]) >= (1, 8):
        return LogisticRegression(C=c, l1_ratio=1.0, solver="liblinear", max_iter=2000)
    return LogisticRegression(C=c, penalty="l1", solver="liblinear", max_iter=2000)


def split_samples(seqs: Sequences, split: str, label_of_token: np.ndarray) -> tuple[Sequences, Samples, np.ndarray]:
    """One split's patients, next-visit samples (every visit) and ``(N, L)`` targets."""
    part = seqs.split(split)
    samples = build_samples(part, TaskConfig())
    return part, samples, targets(part, samples, label_of_token)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--etl", required=True)
    parser.add_argument(
        "--model", required=True, help="a `behrt-rope finetune` output on the same ETL (its label set is scored)"
    )
    parser.add_argument("--c", type=float, nargs="+", default=[0.03, 0.1, 0.3], help="inverse L1 strengths")
    args = parser.parse_args()
    seqs = load_tokens(args.etl)
    bundle = load_bundle(args.model, "multilabel")
    label_of_token = label_index(np.asarray(bundle["label_token_ids"]), len(bundle["vocab"]))
    train, train_samples, y_train = split_samples(seqs, S.TRAIN, label_of_token)
    tuning, tuning_samples, y_tuning = split_samples(seqs, S.TUNING, label_of_token)
    f_train = time_features(train, train_samples, label_of_token)
    f_tuning = time_features(tuning, tuning_samples, label_of_token)
    shared_train, shared_tuning = shared_design(f_train), shared_design(f_tuning)
    result: dict[str, object] = {"train_samples": len(f_train), "tuning_samples": len(f_tuning)}
    probs = score(multilabel_model(bundle), tuning, tuning_samples.rows, tuning_samples.cuts)
    result["model"] = round(macro_average_precision(y_tuning, probs), 4)
    model_logits = np.log(np.clip(probs, 1e-6, 1 - 1e-6)) - np.log(np.clip(1 - probs, 1e-6, 1.0))
    for c in args.c:
        started = time.process_time()
        scores, nonzero = np.zeros(y_tuning.shape), []
        for j in range(y_train.shape[1]):
            if y_train[:, j].min() == y_train[:, j].max():
                continue
            x_train = sp.hstack([sp.csr_matrix(own_design(f_train, j)), shared_train]).tocsr()
            x_tuning = sp.hstack([sp.csr_matrix(own_design(f_tuning, j)), shared_tuning]).tocsr()
            fitted = l1_logistic_regression(c)
            fitted.fit(x_train, y_train[:, j])
            scores[:, j] = fitted.decision_function(x_tuning)
            nonzero.append(int((fitted.coef_ != 0).sum()))
        result[f"sparse_lr_c{c:g}"] = {
            "macro_ap": round(macro_average_precision(y_tuning, scores), 4),
            "mean_logit_with_model": round(macro_average_precision(y_tuning, (scores + model_logits) / 2), 4),
            "nonzero_weights_per_label": round(float(np.mean(nonzero)), 1),
            "cpu_seconds": round(time.process_time() - started, 1),
        }
        print(json.dumps(result), flush=True)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
