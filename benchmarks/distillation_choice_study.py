"""Does a small tuning split choose the distillation weight well? Replays ``finetune``'s choice on subsets.

    python benchmarks/distillation_choice_study.py --data ETL_DIR --first FINETUNE_W0 --distilled FINETUNE_W08
        [--choose-patients 400] [--repeats 40]

``finetune`` trains the deep part on labels alone (weight 0) and, unless that first deep part clearly leads its
teacher on the tuning split, again distilled from the teacher at 0.8 (``behrt_rope.training.distillation_choice``),
then keeps one of the two. This study needs both trainings of one cohort, fine-tuned from the same pre-training on
an ETL output with a *large* tuning split (``etl.split.tuning=0.45``): ``--first`` with
``sparse_time_distillation=0``, ``--distilled`` with ``sparse_time_distillation=0.8``. Their tuning logits are
scored once; then, ``--repeats`` times, ``--choose-patients`` random tuning patients (the size of the quality
benchmark's 5% split) replay each rule and the other tuning patients score the deep part it keeps. The teacher
here is the sparse time path alone (``finetune`` may add the state path's chains to it). Nothing is read from the
held-out split.

Rules: ``prefer_0.8`` (until session 61: 0.8 unless 0 is clearly better), ``prefer_the_leader`` (the weight whose
learner led on the point estimates, the deep part or its teacher, unless the other is clearly better), and the
fixed weights. Prints ONE JSON object: per rule, the mean macro AP of the kept deep part on the scoring patients,
its difference from ``prefer_0.8`` (mean, sd over repeats, share of repeats won) and how often it kept 0.8.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
from scipy.special import expit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from behrt_rope.training.distillation_choice import (  # noqa: E402
    PREFERRED_WEIGHT,
    choose_weight,
    path_leads,
    preferred_weight,
)
from behrt_rope.training.tasks import macro_average_precision  # noqa: E402
from benchmarks.share_choice import against, choosing_samples, sizes, tuning_logits  # noqa: E402

FIRST = 0.0
"""The first training's weight (labels alone)."""


def rule_weights(
    y: np.ndarray, first: np.ndarray, distilled: np.ndarray, teacher: np.ndarray, patients: np.ndarray
) -> dict[str, float]:
    """The weight each rule keeps, chosen on ``y`` ``(N, L)`` with ``(N, L)`` probabilities of the two deep parts
    and of the teacher; ``patients`` ``(N,)``. A first deep part that clearly leads its teacher ends every rule at
    0 (no second training)."""
    lead = path_leads(y, first, teacher, patients)
    fixed = {"fixed_0": FIRST, f"fixed_{PREFERRED_WEIGHT:g}": PREFERRED_WEIGHT}
    if lead.deep_clearly_leads:
        return {f"prefer_{PREFERRED_WEIGHT:g}": FIRST, "prefer_the_leader": FIRST, **fixed}
    probs = {FIRST: first, PREFERRED_WEIGHT: distilled}
    return {
        f"prefer_{PREFERRED_WEIGHT:g}": choose_weight(y, probs, patients, preferred=PREFERRED_WEIGHT).weight,
        "prefer_the_leader": choose_weight(y, probs, patients, preferred=preferred_weight(lead)).weight,
        **fixed,
    }


def study(
    first: dict[str, np.ndarray], distilled: dict[str, np.ndarray], choose_patients: int, repeats: int, seed: int
) -> dict[str, Any]:
    """Replay the rules on ``choose_patients`` random tuning patients, score the kept deep part on the rest."""
    y, patients = first["y"], first["patients"]
    if not (np.array_equal(y, distilled["y"]) and np.array_equal(patients, distilled["patients"])):
        raise SystemExit("--first and --distilled were not fine-tuned on the same tuning samples (same ETL output?)")
    deep = {FIRST: expit(first["deep"]), PREFERRED_WEIGHT: expit(distilled["deep"])}
    teacher = expit(first["path"])
    scores: dict[str, list[float]] = {}
    kept: dict[str, list[float]] = {}
    for c in choosing_samples(patients, choose_patients, repeats, seed):
        weights = rule_weights(y[c], deep[FIRST][c], deep[PREFERRED_WEIGHT][c], teacher[c], patients[c])
        for name, weight in weights.items():
            scores.setdefault(name, []).append(macro_average_precision(y[~c], deep[weight][~c]))
            kept.setdefault(name, []).append(weight)
    rules = against(scores, f"prefer_{PREFERRED_WEIGHT:g}")
    for name, weights_kept in kept.items():
        rules[name][f"kept_{PREFERRED_WEIGHT:g}"] = round(float(np.mean(np.array(weights_kept) == PREFERRED_WEIGHT)), 2)
    whole = {f"{w:g}": round(macro_average_precision(y, p), 5) for w, p in deep.items()}
    return {
        **sizes(y, patients, choose_patients, repeats),
        "deep_macro_ap_whole_tuning_split": {**whole, "teacher": round(macro_average_precision(y, teacher), 5)},
        "rules": rules,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="the ETL output both runs were fine-tuned on")
    parser.add_argument("--first", required=True, help="`behrt-rope finetune` output at sparse_time_distillation=0")
    parser.add_argument("--distilled", required=True, help="the same at sparse_time_distillation=0.8")
    parser.add_argument("--choose-patients", type=int, default=400, help="tuning patients that replay the choice")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    first, distilled = tuning_logits(args.data, args.first), tuning_logits(args.data, args.distilled)
    result = study(first, distilled, args.choose_patients, args.repeats, args.seed)
    print(json.dumps({"data": args.data, "first": args.first, "distilled": args.distilled, **result}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
