"""How much of the gap to the oracle can any learner close on a recurrence cohort with this much data?

    python benchmarks/recurrence_ceiling.py --etl ETL_DIR [--patients 8000] [--seed 3031] [extra synth settings]

The recurrence process's oracle uses the true coefficients. This script fits the *true model form* instead:
for each code, a logistic regression on exactly the generator's own features of the recorded history (age
bump, sex, visit count, seen, duration, count, recency with the true decay, follow-up term, each trigger's
ramp with its true delay and width), with the coefficients estimated on the train split's visits of the ETL
in ``--etl`` (the same patients the model and the references train on). Only the hidden frailty is left out,
since no history shows it. That is the best a learner that already knew the generator's equations could do
from 4,000 patients; the share of the gap it closes is the reachable share, against which the model's is read.

The features are read at the day of the predicted visit (the age, the years since each first record), which
a prediction at the cut does not know and the oracle integrates over; on sparse histories, with years between
visits, that makes the fitted form a generous ceiling. ``--shapes true_at_cut`` (and ``binned_at_cut``) read
them on the cut's day instead, what a learner of the record knows, and so bound the reach from below: a
learner that also modelled the gap law would land between the two.

Prints JSON: macro AP at the oracle's cuts of the held-out patients for the fitted true form, the oracle
and a bag-of-codes logistic regression fitted on the same samples (presence of every code, age, visit count),
the share of the gap the fitted form closes, and ``per_code``: each code's AP for the three, so that the
macro average can be taken over another label set (a fine-tuned model's labels, as ``evaluate`` does).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import average_precision_score

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from behrt_rope import schema as S  # noqa: E402
from behrt_rope.data.sequences import load_tokens  # noqa: E402
from behrt_rope.evaluation.sparse_time import AGE_EDGES, YEARS_EDGES, bins  # noqa: E402
from synthetic_data.generator import DAYS_PER_YEAR, SynthConfig, _ramp, patient_ids  # noqa: E402
from synthetic_data.oracle import oracle_table  # noqa: E402
from synthetic_data.recurrence import MAX_TRIGGERS, RecurrenceCatalogue, RecurrenceSimulation, draw_catalogue  # noqa: E402

FEATURES = (
    "age_bump",
    "female",
    "visit_count",
    "seen",
    "duration",
    "count",
    "recency",
    "followup",
    "trigger_1",
    "trigger_2",
)
"""The columns of :func:`design`, in order."""


def design(sim: RecurrenceSimulation, idx: np.ndarray, day: np.ndarray) -> np.ndarray:
    """(patients, codes, features) the true features of each code at a visit on ``day`` (before it)."""
    cat = sim.cat
    age = (day - sim.birth[idx]) / DAYS_PER_YEAR
    seen = (sim.count[idx] > 0).astype(float)
    years_first = np.nan_to_num((day[:, None] - sim.first_day[idx]) / DAYS_PER_YEAR, nan=0.0)
    since = sim.visits[idx, None] - sim.last_visit[idx]
    cols = [
        np.exp(-(((age[:, None] - cat.age_mid) / cat.age_width) ** 2)) - 0.5,
        np.broadcast_to(sim.female[idx, None], seen.shape).astype(float),
        np.broadcast_to(np.log1p(sim.visits[idx, None]) / 3.0, seen.shape),
        seen,
        seen * np.minimum(years_first, 10.0) / 10.0,
        seen * np.log1p(sim.count[idx]),
        seen * np.exp(-(since - 1) / cat.decay),
        (seen * (since == 1)) * np.exp(-sim.last_gap[idx, None] / 30.0),
    ]
    ramp = seen[:, cat.trigger_parent] * _ramp(years_first[:, cat.trigger_parent], cat.trigger_delay, cat.trigger_width)
    return np.concatenate([np.stack(cols, axis=-1), _trigger_slots(cat, ramp[..., None])], axis=-1)


def _trigger_slots(cat: RecurrenceCatalogue, per_link: np.ndarray) -> np.ndarray:
    """``(n, codes, 2 F)``: each code's (at most two) trigger links' ``(n, links, F)`` values, zeros where a
    code has fewer triggers."""
    n, _, width = per_link.shape
    slots = np.zeros((n, len(cat.codes), MAX_TRIGGERS, width))
    used = np.zeros(len(cat.codes), dtype=int)
    for link, child in enumerate(cat.trigger_child):
        slots[:, child, used[child]] = per_link[:, link]
        used[child] += 1
    return slots.reshape(n, len(cat.codes), MAX_TRIGGERS * width)


SINCE_EDGES = (1.5, 2.5, 3.5, 4.5, 5.5)
"""Bins of visits since a code was last recorded (1, 2, ..., 6 or more)."""
GAP_EDGES = (14.0, 30.0, 90.0)
"""Bins of days between the previous two visits (the follow-up term)."""


def binned_design(sim: RecurrenceSimulation, idx: np.ndarray, day: np.ndarray) -> np.ndarray:
    """(patients, codes, 40) the same quantities as :func:`design` in shape-free bins.

    What a learner knows that is told *which* codes trigger which (the structure) but none of the catalogue's
    shapes: no code's age peak, recency decay, follow-up scale or trigger delay and ramp; each enters as
    indicator bins of its raw quantity, whose weights the regression learns per code from the data.
    """
    cat = sim.cat
    age = (day - sim.birth[idx]) / DAYS_PER_YEAR
    count = sim.count[idx]
    seen = (count > 0).astype(float)[..., None]  # (n, k, 1)
    years_first = np.nan_to_num((day[:, None] - sim.first_day[idx]) / DAYS_PER_YEAR, nan=0.0)
    since = sim.visits[idx, None] - sim.last_visit[idx]
    shape = seen.shape[:2]
    gap = np.broadcast_to(sim.last_gap[idx, None], shape)
    cols = [
        np.broadcast_to(bins(age, AGE_EDGES)[:, None, :], (*shape, len(AGE_EDGES) + 1)),
        np.broadcast_to(sim.female[idx, None, None], (*shape, 1)).astype(float),
        np.broadcast_to(np.log1p(sim.visits[idx, None, None]) / 3.0, (*shape, 1)),
        seen,
        seen * bins(years_first, YEARS_EDGES),
        seen * np.log1p(count)[..., None],
        seen * bins(since, SINCE_EDGES),
        seen * (since == 1)[..., None] * bins(gap, GAP_EDGES),
    ]
    parent = seen[:, cat.trigger_parent] * bins(years_first[:, cat.trigger_parent], YEARS_EDGES)  # (n, links, 6)
    return np.concatenate([*cols, _trigger_slots(cat, parent)], axis=-1).astype(np.float32)


def collect(
    cfg: SynthConfig, *features: Callable[[RecurrenceSimulation, np.ndarray, np.ndarray], np.ndarray]
) -> tuple[np.ndarray, np.ndarray, list[np.ndarray], np.ndarray, np.ndarray]:
    """Every visit after a patient's first, from one seeded simulation: (patient, visit number, one design per
    function of ``features``, outcome, day of the visit before).

    ``features`` make the designs (default :func:`design`, the true form; :func:`binned_design`: shape-free)."""
    makers = features or (design,)
    cat = draw_catalogue(cfg)
    sim = RecurrenceSimulation(cfg, np.random.default_rng(cfg.seed), cat)
    parts: list[tuple[Any, ...]] = []
    pending: dict[str, Any] = {}

    def before(idx: np.ndarray, day: np.ndarray) -> None:
        keep = sim.visits[idx] >= 1
        pending.update(
            keep=keep,
            visit=sim.visits[idx[keep]].copy(),
            xs=[make(sim, idx[keep], day[keep]) for make in makers],
            prev=sim.t_prev[idx[keep]].copy(),
        )

    def after(idx: np.ndarray, day: np.ndarray, hits: np.ndarray, visit: int) -> None:
        keep = pending["keep"]
        if keep.any():
            parts.append((idx[keep], pending["visit"], pending["xs"], hits[keep], pending["prev"]))

    sim.run_visits(before_visit=before, after_visit=after)
    patient, visit, outcome, prev = (np.concatenate([p[i] for p in parts]) for i in (0, 1, 3, 4))
    xs = [np.concatenate([p[2][k] for p in parts]) for k in range(len(makers))]
    return patient, visit, xs, outcome, prev


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--etl", required=True, help="the ETL output of the same cohort (for its patient split)")
    parser.add_argument("--patients", type=int, default=8000)
    parser.add_argument("--seed", type=int, default=3031)
    parser.add_argument(
        "--drop", nargs="*", default=[], choices=FEATURES, help="leave these features out (what do they carry?)"
    )
    parser.add_argument(
        "--shapes",
        choices=tuple(SHAPES),
        default="true",
        help="true: the catalogue's shapes (the fitted true form); binned: the same structure, shapes learned "
        "from indicator bins (binned_design); *_at_cut: the same read on the cut's day, not the next visit's",
    )
    parser.add_argument("overrides", nargs="*", help="synth settings as key=value (e.g. visit_rate=0.35)")
    args = parser.parse_args()
    if args.shapes != "true" and args.drop:
        parser.error(f"--drop names columns of the true form; it does not combine with --shapes {args.shapes}")
    settings = dict(kv.split("=", 1) for kv in args.overrides)
    cfg = SynthConfig(patients=args.patients, seed=args.seed, process="recurrence")
    for key, value in settings.items():
        setattr(cfg, key, type(getattr(cfg, key))(value))
    print(json.dumps(fitted_forms(cfg, Path(args.etl), (args.shapes,), args.drop)[args.shapes], indent=1))


def at_cut(make: Callable[[RecurrenceSimulation, np.ndarray, np.ndarray], np.ndarray]) -> Callable[..., np.ndarray]:
    """``make``'s design read on the day of the visit *before* (the cut a prediction is made at) instead of the
    predicted visit's day: the age and the years since each first record that a prediction knows. The fit then
    learns their effect averaged over the gap to the next visit, as any learner of the record must, where the
    design at the visit's own day is told that day (a generous ceiling on sparse histories)."""

    def design_at_cut(sim: RecurrenceSimulation, idx: np.ndarray, day: np.ndarray) -> np.ndarray:
        return make(sim, idx, sim.t_prev[idx].astype(np.float64))

    return design_at_cut


SHAPES = {
    "true": design,
    "binned": binned_design,
    "true_at_cut": at_cut(design),
    "binned_at_cut": at_cut(binned_design),
}
"""How a fit's design reads each feature's shape (as the catalogue draws it, or learned from indicator bins),
and on which day (the predicted visit's, or the cut's: ``_at_cut``)."""


def fitted_forms(
    cfg: SynthConfig, etl: Path, shapes: Sequence[str] = ("true",), drop: Sequence[str] = ()
) -> dict[str, dict[str, Any]]:
    """The fitted form of the recurrence cohort ``cfg`` (its ETL output in ``etl``, for the patient split) for
    each of ``shapes`` (keys of :data:`SHAPES`; one simulation and one oracle table for all), without the
    features named in ``drop`` (the true form's only): macro AP at the oracle's cuts of the held-out patients
    for it, the oracle and a bag-of-codes regression, the share of the gap it closes, and ``per_code``, each
    code's three APs (codes as the generator writes them)."""
    oracle = oracle_table(cfg)
    codes = draw_catalogue(cfg).codes
    patient, _, xs, y, prev = collect(cfg, design, *(SHAPES[s] for s in shapes if s != "true"))
    seen, visits = FEATURES.index("seen"), FEATURES.index("visit_count")
    x_true = xs[0]
    bag = np.concatenate([x_true[:, :, seen], x_true[:, 0, visits : visits + 1]], axis=1)  # every code, visits
    designs = iter(xs[1:])
    x_of = {
        s: x_true[:, :, [i for i, name in enumerate(FEATURES) if name not in drop]] if s == "true" else next(designs)
        for s in shapes
    }
    split = load_tokens(etl).patients.set_index(S.PATIENT_ID)[S.SPLIT]
    ids = patient_ids(cfg.patients)
    split_of = split.reindex(ids).to_numpy()[patient]
    train = split_of == S.TRAIN
    # the held-out samples at the oracle's cuts: the visit after the cut, whose previous visit is the cut day
    cut_day = oracle.drop_duplicates(S.PATIENT_ID).set_index(S.PATIENT_ID)[S.PREDICTION_TIME]
    cut = cut_day.reindex(ids).to_numpy().astype("datetime64[D]").astype("int64", copy=False)
    at_cut = (split_of == S.HELD_OUT) & (prev == cut[patient])
    truth = np.zeros((at_cut.sum(), len(codes)))
    rows = {p: i for i, p in enumerate(ids[patient[at_cut]])}
    o = oracle[oracle[S.PATIENT_ID].isin(rows)]
    truth[o[S.PATIENT_ID].map(rows).to_numpy(), np.searchsorted(codes, o[S.CODE].to_numpy())] = o[S.PROBABILITY]
    bag_scores = np.zeros_like(truth)
    fitted = {s: np.zeros_like(truth) for s in shapes}
    for j in range(len(codes)):
        if y[train, j].min() == y[train, j].max():
            continue
        for s, x in x_of.items():
            model = LogisticRegression(C=10.0, max_iter=2000).fit(x[train, j], y[train, j])
            fitted[s][:, j] = model.predict_proba(x[at_cut, j])[:, 1]
        reference = LogisticRegression(C=1.0, max_iter=2000).fit(bag[train], y[train, j])
        bag_scores[:, j] = reference.predict_proba(bag[at_cut])[:, 1]
    outcome = y[at_cut]
    ok = [j for j in range(len(codes)) if 0 < outcome[:, j].sum() < len(outcome)]
    counts = {"train_samples": int(train.sum()), "samples_at_cuts": int(at_cut.sum()), "codes": len(ok)}
    return {s: _scored(fitted[s], truth, bag_scores, outcome, ok, codes, counts) for s in shapes}


def _scored(
    fitted: np.ndarray,
    truth: np.ndarray,
    bag_scores: np.ndarray,
    outcome: np.ndarray,
    ok: list[int],
    codes: np.ndarray,
    counts: dict[str, int],
) -> dict[str, Any]:
    """One fit's figures (see :func:`fitted_forms`) from ``(n, codes)`` probabilities of it, the oracle and the
    bag of codes against the outcomes ``outcome``, over the codes ``ok`` (both outcomes seen at the cuts)."""
    scores = {"fitted_true_form": fitted, "oracle": truth, "bag_of_codes": bag_scores}
    per_code = {
        name: [float(average_precision_score(outcome[:, j], s[:, j])) for j in ok] for name, s in scores.items()
    }
    result = {name: float(np.mean(aps)) for name, aps in per_code.items()}
    low, high = result["bag_of_codes"], result["oracle"]
    result["fitted_true_form_gap_closed"] = (result["fitted_true_form"] - low) / (high - low)
    out: dict[str, Any] = {k: round(v, 4) for k, v in result.items()} | counts
    # each code's APs, so that a reader can restrict the macro average to another label set (a model's)
    out["per_code"] = {
        str(codes[j]): {name: round(aps[i], 5) for name, aps in per_code.items()} for i, j in enumerate(ok)
    }
    return out


if __name__ == "__main__":
    main()
