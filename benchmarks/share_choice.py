"""How well does a small tuning split choose the sparse time path's share, against a share per label?

    python benchmarks/share_choice.py --data ETL_DIR --model FINETUNE_DIR [--choose-patients 400] [--repeats 40]

``finetune`` sets one share of the sparse time path for all labels (``behrt_rope.training.sparse_time_fit``):
until session 60 the best of ``SHARE_GRID`` by macro AP on the tuning split (``best_point_estimate``), since
then 0.5 unless another share is clearly better there (``clearly_better_than_0.5``). This study asks which of
these, a share per label (the best of a finer grid by each label's AP), one shrunk towards the common share by
the label's number of positives (``n / (n + k)`` of the way), shares chosen by the tuning cross-entropy instead of
AP (one for all labels, or one per label: the loss reads every sample, not only the ranking of the few positives),
or a fixed share, ranks best. It needs a model fine-tuned
on an ETL output with a *large* tuning split (``etl.split.tuning=0.45``, about 3,500 patients): the tuning
split's logits of each part are scored once, then, ``--repeats`` times, ``--choose-patients`` random tuning
patients (the size of the default 5% split of 8,000) choose each share and the remaining tuning patients
score it. Nothing is read from the held-out split. With a state path its share stays the model's.

Prints ONE JSON object: per method, the mean macro AP on the scoring patients, the mean difference from the
best point estimate with its standard deviation over the repeats and the share of repeats it wins; and how
often each share was the best point estimate.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from behrt_rope import config as config_lib  # noqa: E402
from behrt_rope import schema as S  # noqa: E402
from behrt_rope.data.labels import TaskConfig, build_samples, label_index, targets  # noqa: E402
from behrt_rope.data.sequences import load_tokens, load_vocabulary  # noqa: E402
from behrt_rope.evaluation.metrics import per_column_scores  # noqa: E402
from behrt_rope.training.bundle import load_bundle  # noqa: E402
from behrt_rope.training.inference import Part, multilabel_model, score_parts  # noqa: E402
from behrt_rope.training.sparse_time_fit import SHARE_GRID, clear_share  # noqa: E402
from behrt_rope.training.tasks import macro_average_precision  # noqa: E402

FINE_GRID = tuple(np.round(np.linspace(0.0, 1.0, 21), 2))
"""Shares a label may get on its own."""
SHRINKAGE = (5, 20, 50)
"""Pseudo-positives ``k`` of the shrunk per-label shares."""


def loss_by_label(y: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """``(L,)`` mean binary cross-entropy (nats) of ``(N, L)`` ``logits`` against ``y``, each label over its ``N``
    samples; stable for large logits.

    >>> loss_by_label(np.array([[1, 0]]), np.array([[0.0, 0.0]])).round(4)
    array([0.6931, 0.6931])
    """
    return np.mean(np.logaddexp(0.0, logits) - y * logits, axis=0)


def tuning_logits(data: str, model_dir: str) -> dict[str, np.ndarray]:
    """The tuning split's targets ``y`` ``(N, L)``, patients ``(N,)`` and ``(N, L)`` logits of the deep part,
    the sparse time path and (when fitted) the state path, with ``state_share`` ``()``."""
    bundle = load_bundle(model_dir, "multilabel")
    seqs, vocab = load_tokens(data).split(S.TUNING), load_vocabulary(data)
    task = config_lib.build(TaskConfig, bundle["task"])
    label_of_token = label_index(np.asarray(bundle["label_token_ids"], dtype=np.int64), len(vocab))
    model = multilabel_model(bundle, model_dir)
    if model.sparse_time is None:
        raise SystemExit(f"{model_dir}: the model has no sparse time path, so no share to choose")
    samples = build_samples(seqs, task)
    with_states = model.state_path is not None and float(model.state_path.share) > 0
    parts: tuple[Part, ...] = ("deep", "path", "states") if with_states else ("deep", "path")
    logits = score_parts(model, seqs, samples.rows, samples.cuts, parts=parts, logits=True)
    return {
        "y": targets(seqs, samples, label_of_token),
        "patients": samples.rows,
        **{part: logits[part].astype(np.float64) for part in parts},
        "state_share": np.array(float(model.state_path.share) if with_states else 0.0),
    }


def best_point_estimate(deep: np.ndarray, path: np.ndarray, y: np.ndarray) -> float:
    """The common share of ``SHARE_GRID`` with the best macro AP of ``(1 - w) deep + w path`` (``(N, L)`` logits)
    against ``y``, ties to the more even mix: ``finetune``'s rule until session 60.

    >>> y = np.array([[1], [0], [1], [0]])
    >>> best_point_estimate(np.array([[2.0], [1.0], [-1.0], [0.0]]), np.array([[1.0], [0.0], [1.0], [-1.0]]), y)
    0.75
    """
    scores = {w: round(macro_average_precision(y, (1 - w) * deep + w * path), 5) for w in SHARE_GRID}
    return max(scores, key=lambda w: (scores[w], -abs(w - 0.5)))


def method_shares(
    y: np.ndarray, deep: np.ndarray, path: np.ndarray, patients: np.ndarray
) -> tuple[dict[str, np.ndarray], float]:
    """``(L,)`` shares of each method, chosen on ``y`` ``(N, L)`` with the parts' ``(N, L)`` logits (``patients``
    ``(N,)`` each sample's patient); and the best point estimate among the common shares (the rule until session 60)."""
    common = best_point_estimate(deep, path, y)
    by_share = np.stack([per_column_scores(y, (1 - w) * deep + w * path)[0] for w in FINE_GRID])  # (shares, L)
    seen = ~np.isnan(by_share[0])
    own = np.where(seen, np.asarray(FINE_GRID)[np.nanargmax(np.where(seen, by_share, -1.0), axis=0)], common)
    losses = np.stack([loss_by_label(y, (1 - w) * deep + w * path) for w in FINE_GRID])  # (shares, L)
    positives = y.sum(0)
    labels = y.shape[1]
    shares = {
        "best_point_estimate": np.full(labels, common),
        "clearly_better_than_0.5": np.full(labels, clear_share(deep, path, y, patients).chosen),
        "fixed_0.4": np.full(labels, 0.4),
        "fixed_0.5": np.full(labels, 0.5),
        "deep_alone": np.zeros(labels),
        "path_alone": np.ones(labels),
        "per_label": own,
        "common_by_loss": np.full(labels, FINE_GRID[int(np.argmin(losses.mean(1)))]),
        "per_label_by_loss": np.asarray(FINE_GRID)[np.argmin(losses, axis=0)],
    }
    for k in SHRINKAGE:
        shares[f"per_label_shrunk_{k}"] = common + positives / (positives + k) * (own - common)
    return shares, common


def choosing_samples(patients: np.ndarray, choose_patients: int, repeats: int, seed: int) -> Iterator[np.ndarray]:
    """``repeats`` ``(N,)`` boolean masks of the samples of ``choose_patients`` random patients (``patients``
    ``(N,)`` each sample's patient); the rest of the samples score what those chose."""
    everyone = np.unique(patients)
    if choose_patients >= len(everyone):
        raise SystemExit(f"--choose-patients {choose_patients} leaves no tuning patients to score ({len(everyone)})")
    rng = np.random.default_rng(seed)
    for _ in range(repeats):
        yield np.isin(patients, rng.choice(everyone, choose_patients, replace=False))


def against(scores: dict[str, list[float]], reference: str) -> dict[str, dict[str, float]]:
    """Per method, its mean score over the repeats and its difference from ``reference``'s (mean, standard
    deviation over the repeats, share of repeats won)."""
    base = np.array(scores[reference])
    summary = {}
    for name, values in scores.items():
        diff = np.array(values) - base
        summary[name] = {
            "macro_ap": round(float(np.mean(values)), 5),
            f"minus_{reference}": round(float(diff.mean()), 5),
            "sd": round(float(diff.std()), 5),
            "wins": round(float(np.mean(diff > 0)), 2),
        }
    return summary


def sizes(y: np.ndarray, patients: np.ndarray, choose_patients: int, repeats: int) -> dict[str, int]:
    """What a study ran on: tuning patients and samples (``y`` ``(N, L)``, ``patients`` ``(N,)``), labels, the
    choosing patients and the repeats."""
    return {
        "tuning_patients": len(np.unique(patients)),
        "tuning_samples": len(y),
        "labels": int(y.shape[1]),
        "choose_patients": choose_patients,
        "repeats": repeats,
    }


def study(logits: dict[str, np.ndarray], choose_patients: int, repeats: int, seed: int) -> dict[str, Any]:
    """Choose on ``choose_patients`` random tuning patients, score on the rest, ``repeats`` times."""
    y, patients, deep, path = logits["y"], logits["patients"], logits["deep"], logits["path"]
    state_share = float(logits["state_share"])
    scores: dict[str, list[float]] = {}
    commons: list[float] = []
    for choose in choosing_samples(patients, choose_patients, repeats, seed):
        shares, common = method_shares(y[choose], deep[choose], path[choose], patients[choose])
        commons.append(common)
        rest = ~choose
        for name, share in shares.items():
            mixed = (1 - share) * deep[rest] + share * path[rest]
            if state_share > 0:
                mixed = (1 - state_share) * mixed + state_share * logits["states"][rest]
            scores.setdefault(name, []).append(float(np.nanmean(per_column_scores(y[rest], mixed)[0])))
    return {
        **sizes(y, patients, choose_patients, repeats),
        "share_grid": list(SHARE_GRID),
        "best_point_estimate_chosen": {str(k): v for k, v in sorted(Counter(commons).items())},
        "state_share": state_share,
        "methods": against(scores, "best_point_estimate"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="the ETL output the model was fine-tuned on")
    parser.add_argument("--model", required=True, help="a `behrt-rope finetune` output with the sparse time path")
    parser.add_argument("--choose-patients", type=int, default=400, help="tuning patients that choose the shares")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    result = study(tuning_logits(args.data, args.model), args.choose_patients, args.repeats, args.seed)
    print(json.dumps({"data": args.data, "model": args.model, **result}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
