"""What does a fine-tuned model miss on a recurrence cohort? Stack its logit with the generator's true features.

    python benchmarks/recurrence_residual.py --etl ETL_DIR --model FINETUNE_DIR [--patients 8000] [--seed 3031]
                                             [extra synth settings, e.g. visit_rate=0.35]

On a ``synth.process=recurrence`` cohort every code's chance at a visit is a logistic function of a few
features of the recorded history (``recurrence_ceiling.py`` lists them). This script scores every visit of
the **train** and **tuning** splits with the model, then fits, per label, a logistic regression on the model's
logit plus one group of those true features on the train samples, and scores the tuning samples. A group
that raises tuning macro AP above the model's own carries information the model did not extract; a group
that adds nothing is one the model already has. It also fits the true form alone (all groups, no model) and
the true form without each group, for scale. Only the tuning split is scored: nothing here looks at held-out
data.

The model's logits on train samples are in-sample (the model was fitted on them), so the stacking weights
lean towards the model: the gains are lower bounds of what each group adds.

Prints JSON: tuning macro AP of the model, of the model plus each group, of the true form and of the true
form without each group; and ``in_sample``, the train macro AP of the model and of the true form. The true
form has a few weights per label and scores about the same on train and tuning samples; a model far ahead on
its own train samples and behind on tuning has fitted patients rather than the structure.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import average_precision_score

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from recurrence_ceiling import FEATURES, collect  # noqa: E402

from behrt_rope import schema as S  # noqa: E402
from behrt_rope.data.labels import TaskConfig, build_samples, label_index, targets  # noqa: E402
from behrt_rope.data.sequences import Sequences, load_tokens  # noqa: E402
from behrt_rope.model.heads import BehrtForMultiLabel  # noqa: E402
from behrt_rope.training.bundle import load_bundle  # noqa: E402
from behrt_rope.training.inference import multilabel_model, score  # noqa: E402
from synthetic_data.generator import SynthConfig, patient_ids  # noqa: E402
from synthetic_data.recurrence import draw_catalogue  # noqa: E402

GROUPS = {
    "age_bump": ("age_bump",),
    "female": ("female",),
    "visit_count": ("visit_count",),
    "history (seen, duration, count)": ("seen", "duration", "count"),
    "recency": ("recency",),
    "followup": ("followup",),
    "triggers (another code's years since first record)": ("trigger_1", "trigger_2"),
}


def split_samples(
    seqs: Sequences, split: str, model: BehrtForMultiLabel, label_of_token: np.ndarray, key: dict[tuple[str, int], int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(simulation rows, model logits (N, L), targets (N, L)) of every next-visit sample of ``split``."""
    part = seqs.split(split)
    samples = build_samples(part, TaskConfig())
    probs = score(model, part, samples.rows, samples.cuts).astype(np.float64)
    logits = np.log(np.clip(probs, 1e-6, 1 - 1e-6)) - np.log(np.clip(1 - probs, 1e-6, 1.0))
    ids = part.patients[S.PATIENT_ID].to_numpy()[samples.rows]
    days = samples.times.astype("int64")
    rows = np.array([key[(p, int(d))] for p, d in zip(ids, days, strict=True)])
    return rows, logits, targets(part, samples, label_of_token)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--etl", required=True, help="the ETL output the model was fine-tuned on")
    parser.add_argument("--model", required=True, help="a `behrt-rope finetune` output directory")
    parser.add_argument("--patients", type=int, default=8000)
    parser.add_argument("--seed", type=int, default=3031)
    parser.add_argument("overrides", nargs="*", help="synth settings as key=value (e.g. visit_rate=0.35)")
    args = parser.parse_args()
    cfg = SynthConfig(patients=args.patients, seed=args.seed, process="recurrence")
    for key, value in dict(kv.split("=", 1) for kv in args.overrides).items():
        setattr(cfg, key, type(getattr(cfg, key))(value))
    bundle = load_bundle(args.model, "multilabel")
    model = multilabel_model(bundle)
    seqs = load_tokens(args.etl)
    label_of_token = label_index(np.asarray(bundle["label_token_ids"]), len(bundle["vocab"]))
    # Codes as the ETL writes them (dots dropped by the default code normalisation).
    codes = [str(c).replace(".", "") for c in draw_catalogue(cfg).codes]
    columns = [codes.index(label) for label in bundle["labels"]]
    patient, _, (design,), _, previous = collect(cfg)
    sim_ids = np.asarray(patient_ids(cfg.patients))[patient]
    key = {(p, int(d)): i for i, (p, d) in enumerate(zip(sim_ids, previous, strict=True))}
    train_rows, train_logits, train_y = split_samples(seqs, S.TRAIN, model, label_of_token, key)
    tune_rows, tune_logits, tune_y = split_samples(seqs, S.TUNING, model, label_of_token, key)
    scored = [j for j in range(len(columns)) if tune_y[:, j].sum() >= 2 and 0 < train_y[:, j].sum() < len(train_y)]

    def macro_ap(with_model: bool, features: list[int], in_sample: bool = False) -> float:
        """Tuning macro AP of the stacked (or true-form) regression; ``in_sample``: its train macro AP."""
        aps = []
        for j in scored:
            c = columns[j]
            x_train = np.hstack([train_logits[:, [j]]] * with_model + [design[train_rows][:, c][:, features]])
            x_tune = np.hstack([tune_logits[:, [j]]] * with_model + [design[tune_rows][:, c][:, features]])
            fitted = LogisticRegression(C=10.0, max_iter=3000).fit(x_train, train_y[:, j])
            x_eval, y_eval = (x_train, train_y) if in_sample else (x_tune, tune_y)
            aps.append(average_precision_score(y_eval[:, j], fitted.decision_function(x_eval)))
        return float(np.mean(aps))

    def model_ap(logits: np.ndarray, y: np.ndarray) -> float:
        return float(np.mean([average_precision_score(y[:, j], logits[:, j]) for j in scored]))

    all_features = list(range(len(FEATURES)))

    def indices(names: tuple[str, ...], keep: bool) -> list[int]:
        return [i for i, name in enumerate(FEATURES) if (name in names) == keep]

    result: dict[str, object] = {
        "model": model_ap(tune_logits, tune_y),
        # the same labels scored on the train samples both were fitted on: how much each over-fits
        "in_sample": {"model": model_ap(train_logits, train_y), "true_form": macro_ap(False, all_features, True)},
        "model_plus": {group: macro_ap(True, indices(names, True)) for group, names in GROUPS.items()},
        "model_plus_all": macro_ap(True, all_features),
        "true_form": macro_ap(False, all_features),
        "true_form_without": {group: macro_ap(False, indices(names, False)) for group, names in GROUPS.items()},
        "tuning_samples": len(tune_rows),
        "labels": len(scored),
    }
    print(json.dumps(_rounded(result), indent=1))


def _rounded(value: object) -> object:
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return value


if __name__ == "__main__":
    main()
