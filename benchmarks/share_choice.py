"""How well does a small tuning split choose the sparse time path's share, against a share per label?

    python benchmarks/share_choice.py --data ETL_DIR --model FINETUNE_DIR [--choose-patients 400] [--repeats 40]

``finetune`` sets one share of the sparse time path for all labels (``behrt_rope.training.sparse_time_fit``):
until session 60 the best of ``SHARE_GRID`` by macro AP on the tuning split (``best_point_estimate``), since
then 0.5 unless another share is clearly better there (``clearly_better_than_0.5``). This study asks which of
these, a share per label (the best of a finer grid by each label's AP), one shrunk towards the common share by
the label's number of positives (``n / (n + k)`` of the way), shares chosen by the tuning cross-entropy instead of
AP (one for all labels, or one per label: the loss reads every sample, not only the ranking of the few positives),
two shares by history (one where the label's code is already on file, one for new onsets; the best pair by point
estimate, or the common share unless a pair is clearly better), the default rule with the deep part alone (0) and
nearly alone (0.1) among its shares (``clearly_better_than_0.5_from_0``), or a fixed share, ranks best. It needs a model
fine-tuned on an ETL output with a *large* tuning split (``etl.split.tuning=0.45``, about 3,500 patients): the tuning
split's logits of each part are scored once, then, ``--repeats`` times, ``--choose-patients`` random tuning
patients (the size of the default 5% split of 8,000) choose each share and the remaining tuning patients
score it. Nothing is read from the held-out split. With a state path its share stays the model's.

Prints ONE JSON object: per method, the mean macro AP on the scoring patients, the mean difference from the
best point estimate with its standard deviation over the repeats and the share of repeats it wins; how often
each share was the best point estimate, and each pair (on file / new onset) the two by-history rules chose.
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
from scipy.special import expit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from behrt_rope import config as config_lib  # noqa: E402
from behrt_rope import schema as S  # noqa: E402
from behrt_rope.data.labels import TaskConfig, build_samples, history, label_index, targets  # noqa: E402
from behrt_rope.data.sequences import load_tokens, load_vocabulary  # noqa: E402
from behrt_rope.evaluation.metrics import per_column_scores  # noqa: E402
from behrt_rope.training.bundle import load_bundle  # noqa: E402
from behrt_rope.training.clear_gain import choose_clearly_better  # noqa: E402
from behrt_rope.training.inference import Part, multilabel_model, score_parts  # noqa: E402
from behrt_rope.training.sparse_time_fit import EQUAL_SHARE, SHARE_GRID, clear_share  # noqa: E402
from behrt_rope.training.tasks import macro_average_precision  # noqa: E402

FINE_GRID = tuple(np.round(np.linspace(0.0, 1.0, 21), 2))
"""Shares a label may get on its own."""
SHRINKAGE = (5, 20, 50)
"""Pseudo-positives ``k`` of the shrunk per-label shares."""
HISTORY_GRID = (0.0, 0.25, 0.5, 0.75, 1.0)
"""Shares each history (code on file, new onset) may get."""
GRID_FROM_0 = (0.0, 0.1, *SHARE_GRID)
"""The common shares with the deep part alone and nearly alone added (``clearly_better_than_0.5_from_0``)."""


def loss_by_label(y: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """``(L,)`` mean binary cross-entropy (nats) of ``(N, L)`` ``logits`` against ``y``, each label over its ``N``
    samples; stable for large logits.

    >>> loss_by_label(np.array([[1, 0]]), np.array([[0.0, 0.0]])).round(4)
    array([0.6931, 0.6931])
    """
    return np.mean(np.logaddexp(0.0, logits) - y * logits, axis=0)


def tuning_logits(data: str, model_dir: str) -> dict[str, np.ndarray]:
    """The tuning split's targets ``y`` ``(N, L)``, patients ``(N,)``, ``on_file`` ``(N, L)`` (the label's code
    already in the sample's input) and ``(N, L)`` logits of the deep part, the sparse time path and (when fitted)
    the state path, with ``state_share`` ``()``."""
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
        "on_file": history(seqs, samples, label_of_token),
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


def mix(deep: np.ndarray, path: np.ndarray, share: np.ndarray, on_file: np.ndarray) -> np.ndarray:
    """``(N, L)`` logits ``(1 - w) deep + w path`` with ``w`` from ``share`` ``(2, L)``: row 0 where the label's code is
    on file (``on_file`` ``(N, L)``), row 1 where it is not.

    >>> mix(np.zeros((2, 1)), np.ones((2, 1)), np.array([[0.25], [0.75]]), np.array([[True], [False]])).tolist()
    [[0.25], [0.75]]
    """
    w = np.where(on_file, share[0], share[1])  # (N, L)
    return (1 - w) * deep + w * path


def history_shares(
    y: np.ndarray, deep: np.ndarray, path: np.ndarray, patients: np.ndarray, on_file: np.ndarray, common: float
) -> dict[str, tuple[float, float]]:
    """Two shares of :data:`HISTORY_GRID`, ``(on file, new onset)``: the pair with the best macro AP
    (``by_history``), and ``(common, common)`` unless a pair is clearly better (``by_history_clear``,
    :func:`~behrt_rope.training.clear_gain.choose_clearly_better`); arrays as in :func:`method_shares`."""
    pairs = [(a, b) for a in HISTORY_GRID for b in HISTORY_GRID]
    pairs += [] if (common, common) in pairs else [(common, common)]
    probs: dict[float, np.ndarray] = {
        float(i): expit(mix(deep, path, np.array([[a], [b]]), on_file)) for i, (a, b) in enumerate(pairs)
    }
    choice = choose_clearly_better(y, probs, patients, reference=float(pairs.index((common, common))))
    best = max(choice.macro_ap, key=lambda i: (choice.macro_ap[i], -abs(pairs[int(i)][0] - pairs[int(i)][1])))
    return {"by_history": pairs[int(best)], "by_history_clear": pairs[int(choice.chosen)]}


def method_shares(
    y: np.ndarray, deep: np.ndarray, path: np.ndarray, patients: np.ndarray, on_file: np.ndarray
) -> tuple[dict[str, np.ndarray], float]:
    """``(2, L)`` shares of each method (row 0 for samples with the label's code on file, row 1 for the others,
    :func:`mix`), chosen on ``y`` ``(N, L)`` with the parts' ``(N, L)`` logits (``patients`` ``(N,)`` each sample's
    patient, ``on_file`` ``(N, L)``); and the best point estimate among the common shares (the rule until
    session 60)."""
    common = best_point_estimate(deep, path, y)
    by_share = np.stack([per_column_scores(y, (1 - w) * deep + w * path)[0] for w in FINE_GRID])  # (shares, L)
    seen = ~np.isnan(by_share[0])
    own = np.where(seen, np.asarray(FINE_GRID)[np.nanargmax(np.where(seen, by_share, -1.0), axis=0)], common)
    losses = np.stack([loss_by_label(y, (1 - w) * deep + w * path) for w in FINE_GRID])  # (shares, L)
    positives = y.sum(0)
    labels = y.shape[1]
    from_0 = clear_share(deep, path, y, patients, GRID_FROM_0)  # the default grid's intervals among these
    default = from_0.among(SHARE_GRID)
    shares = {
        "best_point_estimate": np.full(labels, common),
        "clearly_better_than_0.5": np.full(labels, default),
        "clearly_better_than_0.5_from_0": np.full(labels, from_0.chosen),
        "fixed_0.4": np.full(labels, 0.4),
        "fixed_0.5": np.full(labels, EQUAL_SHARE),
        "deep_alone": np.zeros(labels),
        "path_alone": np.ones(labels),
        "per_label": own,
        "common_by_loss": np.full(labels, FINE_GRID[int(np.argmin(losses.mean(1)))]),
        "per_label_by_loss": np.asarray(FINE_GRID)[np.argmin(losses, axis=0)],
    }
    for k in SHRINKAGE:
        shares[f"per_label_shrunk_{k}"] = common + positives / (positives + k) * (own - common)
    both = {name: np.stack([share, share]) for name, share in shares.items()}
    for name, pair in history_shares(y, deep, path, patients, on_file, default).items():
        both[name] = np.repeat(np.array(pair)[:, None], labels, axis=1)
    return both, common


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
    y, patients, deep, path, on_file = (logits[k] for k in ("y", "patients", "deep", "path", "on_file"))
    state_share = float(logits["state_share"])
    scores: dict[str, list[float]] = {}
    commons: list[float] = []
    pairs: dict[str, Counter[str]] = {"by_history": Counter(), "by_history_clear": Counter()}
    clear_chosen: dict[str, Counter[float]] = {
        "clearly_better_than_0.5": Counter(),
        "clearly_better_than_0.5_from_0": Counter(),
    }
    for choose in choosing_samples(patients, choose_patients, repeats, seed):
        shares, common = method_shares(y[choose], deep[choose], path[choose], patients[choose], on_file[choose])
        commons.append(common)
        for name, counter in pairs.items():
            counter[f"{shares[name][0, 0]:g}/{shares[name][1, 0]:g}"] += 1
        for name, chosen in clear_chosen.items():
            chosen[float(shares[name][0, 0])] += 1
        rest = ~choose
        for name, share in shares.items():
            mixed = mix(deep[rest], path[rest], share, on_file[rest])
            if state_share > 0:
                mixed = (1 - state_share) * mixed + state_share * logits["states"][rest]
            scores.setdefault(name, []).append(float(np.nanmean(per_column_scores(y[rest], mixed)[0])))
    return {
        **sizes(y, patients, choose_patients, repeats),
        "share_grid": list(SHARE_GRID),
        "best_point_estimate_chosen": {str(k): v for k, v in sorted(Counter(commons).items())},
        "by_history_chosen": {name: dict(sorted(c.items())) for name, c in pairs.items()},
        "clear_rules_chosen": {name: {f"{w:g}": n for w, n in sorted(c.items())} for name, c in clear_chosen.items()},
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
