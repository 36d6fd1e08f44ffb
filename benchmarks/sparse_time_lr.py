"""A sparse logistic regression on binned time features of every label code, against a fine-tuned model.

    python benchmarks/sparse_time_lr.py --etl ETL_DIR [--model FINETUNE_DIR] [--c 0.03 0.1 0.3] [--select-c none]
                                         [--bins cumulative|indicator]

The gradient-boosted reference reads, per label, that label's own time features and only whether each other
code was ever recorded. This script asks what a *linear* model gets from the timing of every code, with an
L1 penalty: the generators' cross-code effects ("code p raises c from some years after p was first
recorded") are sparse, and an L1 fit can find the few pairs that matter among all of them where an L2 fit
spreads its weight. Nothing here knows a generator: the features are built from the ETL output alone
(``behrt_rope/evaluation/sparse_time.py``, where ``evaluate`` fits the same model as a reference).

Fitted per label on the train split's next-visit samples (every visit), scored on the **tuning** split's
(held-out is never read), for each ``--c`` (the inverse L1 strength: of the refit, when a first fit at
``--select-c``, 0.05 by default as in the library, chose the codes each label reads, a relaxed lasso;
``--select-c none`` fits once; ``--bins`` how the fits read the ordered time bins, cumulative by default as in
the library). Prints JSON: tuning macro AP of the fine-tuned model (``--model``, whose
labels are the ones scored) and of the sparse regression at each C, with the mean number of non-zero weights
per label, the CPU seconds of the fits, and the macro AP of the mean of its logit and the model's (an ensemble
of the two). Since session 11 the default model already averages itself with this regression (its sparse time
path): to compare the regression with the deep model alone, pass a model fine-tuned with
``model.sparse_time=false``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from behrt_rope import schema as S  # noqa: E402
from behrt_rope.data.labels import Samples, TaskConfig, build_samples, label_index, targets  # noqa: E402
from behrt_rope.data.sequences import Sequences, load_tokens  # noqa: E402
from behrt_rope.evaluation.sparse_time import BINS, DEFAULT_BINS, SELECT_C, fit_sparse_time  # noqa: E402
from behrt_rope.evaluation.time_features import time_features  # noqa: E402
from behrt_rope.training.bundle import load_bundle  # noqa: E402
from behrt_rope.training.inference import multilabel_model, score  # noqa: E402
from behrt_rope.training.sparse_time_fit import logit  # noqa: E402
from behrt_rope.training.tasks import macro_average_precision  # noqa: E402


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
    parser.add_argument(
        "--select-c",
        type=lambda text: None if text == "none" else float(text),
        default=SELECT_C,
        help="inverse L1 strength of the fit that chooses the codes each label reads; none: one fit on everything",
    )
    parser.add_argument("--bins", choices=BINS, default=DEFAULT_BINS, help="how the fits read the ordered bins")
    args = parser.parse_args()
    seqs = load_tokens(args.etl)
    bundle = load_bundle(args.model, "multilabel")
    label_of_token = label_index(np.asarray(bundle["label_token_ids"]), len(bundle["vocab"]))
    train, train_samples, y_train = split_samples(seqs, S.TRAIN, label_of_token)
    tuning, tuning_samples, y_tuning = split_samples(seqs, S.TUNING, label_of_token)
    f_train = time_features(train, train_samples, label_of_token)
    f_tuning = time_features(tuning, tuning_samples, label_of_token)
    result: dict[str, object] = {
        "train_samples": len(f_train),
        "tuning_samples": len(f_tuning),
        "select_c": args.select_c,
        "bins": args.bins,
    }
    probs = score(multilabel_model(bundle), tuning, tuning_samples.rows, tuning_samples.cuts)
    result["model"] = round(macro_average_precision(y_tuning, probs), 4)
    model_logits = logit(probs)
    for c in args.c:
        started = time.process_time()
        fit = fit_sparse_time(f_train, y_train, c, n_jobs=1, select_c=args.select_c, bins=args.bins)
        scores = fit.logits(f_tuning)
        fitted = y_train.min(axis=0) < y_train.max(axis=0)
        nonzero = ((fit.own_weight != 0).sum(1) + (fit.shared_weight != 0).sum(1))[fitted]
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
