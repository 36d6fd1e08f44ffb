"""Prediction quality on synthetic cohorts of different shapes: model against both references and the oracle.

    python benchmarks/quality.py [--cohorts default short_sparse long_dense] [--patients 8000]
                                 [--split 0.5 0.05 0.45]
                                 [--work DIR] [--oracle-replicas 300] [--markdown FILE] [--with-wide]
                                 [--record-oracle-particles 1000] [--task 12m] [--seed-offset 7000] [--reach]
                                 [-- extra overrides for pretrain and finetune, e.g. trainer.max_epochs=2]

For each cohort: ``behrt-rope synth`` (with ``oracle=true``) -> ``etl`` -> ``pretrain`` -> ``finetune
--pretrained`` -> ``evaluate oracle=...``, every stage through the real CLI with its DEFAULT settings (the
cohort's shape is the only thing that changes, and the ETL's patient split: by default 50% train, 5% tuning,
45% held-out of 8,000 patients, i.e. 4,000 train patients and one oracle cut for each of about 3,600 held-out
patients, since macro AP over a few hundred cuts is mostly noise), each in its own process. Figures come from
the held-out split, which no setting was chosen on. Prints ONE JSON object: per cohort, macro/micro AP and
macro AUROC of the model, the two logistic regressions (bag of codes on every visit; presence on one cut per
patient, the classic reference), the gradient-boosted model and the oracle on the held-out samples at the
oracle's cuts (with 95% bootstrap intervals), the share of the logistic-regression-to-oracle gap each closes
from either regression (macro AP, with a paired interval), the model's macro AP minus each reference's there (paired
interval: is it ahead of gradient boosting?), the same predictors on every held-out sample (no oracle),
the CPU and wall seconds of each stage (CPU: user + system of the stage's process and its children), what
fine-tuning chose on the tuning split and how far its budget let it go (``finetune_choices``), and the thread
setting the stages ran with (``torch_threads``: the budget is wall time, so one thread beside another run trains
fewer epochs than two threads alone, the issue's 2 cores). With
``--with-wide`` a second model is fine-tuned from the same pre-trained encoder with ``model.wide=true`` (the
bag-of-codes path, off by default) and scored at the same cuts (row ``model_with_wide_path``): what the wide
path would add to the encoder. With ``--task 6m`` or ``--task 12m`` the model is fine-tuned for that window
task and, since the oracles give next-visit probabilities, measured against the references on every
held-out sample only (no synth oracle, no ``at_oracle_cuts``). With ``--record-oracle-particles N`` the
clinical cohorts are also measured against the record oracle of their held-out patients
(``synthetic_data/record_oracle.py``: the best prediction from the recorded history alone, the ceiling a model
can reach; about 15 minutes of one core per 3,600 patients at N = 1000): ``gap_closed_record`` per predictor.
With ``--reach`` the recurrence cohorts also fit the generator's own form on the same train patients
(``benchmarks/recurrence_ceiling.py``; its shapes told, and learned from bins, each read on the predicted
visit's day and on the cut's, all four fits on one simulation): how much of the gap a learner that knew the
equations closes from the same data (``reach``, and a table of its own). Read on the predicted visit's day
the fit is told when that visit falls, which no prediction is; read on the cut's, it is not: the two bound
what such a learner reaches. The progression cohorts instead fit the generator's hidden Markov model, its
structure told, by maximum likelihood on the same train patients (``benchmarks/progression_reach.py``) and
predict with its filter at the oracle's cuts (``reach.fitted_structure``).
With ``--markdown FILE`` it also writes the tables that ``docs/benchmarks.md`` shows.

The cohorts differ in structure, and their seeds are ones the defaults were never tuned on:

* ``default``: the generator's defaults (11 years, about 0.55 routine visits a year).
* ``short_sparse``: a 5-year window, half the visit rate, more background codes: short, noisy histories.
* ``long_dense``: a 17-year window, twice the visit rate, more follow-up visits: long histories.
* ``recurrence``, ``recurrence_sparse``: the second generator family (``synth.process=recurrence``), whose
  oracle uses only the record, at the default density and with short, sparse histories.
* ``recurrence_300_codes``: the same family with a catalogue of 300 codes instead of 64 (each rarer): about
  three times as many labels, most of them with few positives.
* ``recurrence_long_dense``: the same family over a 17-year window at twice the visit rate: about 270 tokens
  per patient, and a quarter of the histories longer than ``etl.max_seq_len`` (512).
* ``progression``: the third generator family (``synth.process=progression``): conditions in pairs move
  through hidden stages that visits record with stage-dependent chances. Its oracle is the exact posterior
  of the stages given the record, so it is also the ceiling a model of the record can reach.
* ``progression_200_codes``: the same family with a catalogue of 200 codes instead of 64: about three times as
  many condition pairs (so three times as many hidden-state chains to fit) and background codes.

``--seed-offset N`` adds N to every seed: the same shapes drawn afresh (new catalogues for the recurrence family),
cohorts that neither the defaults nor earlier runs of this benchmark have seen.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from behrt_rope import config as config_lib  # noqa: E402
from behrt_rope import schema as S  # noqa: E402
from behrt_rope.data.sequences import load_tokens  # noqa: E402
from behrt_rope.evaluation.ceiling import HISTORY_PARTS, format_share  # noqa: E402
from behrt_rope.evaluation.report import REFERENCE_NAMES, replicate_difference  # noqa: E402
from benchmarks.progression_reach import reach as progression_reach  # noqa: E402
from benchmarks.recurrence_ceiling import fitted_forms  # noqa: E402
from synthetic_data.generator import SynthConfig  # noqa: E402
from synthetic_data.record_oracle import record_oracle_table  # noqa: E402

COHORTS: dict[str, list[str]] = {
    "default": ["--seed", "2024"],
    "short_sparse": [
        "--seed",
        "2025",
        "synth.start=2016-01-01",
        "synth.visit_rate=0.3",
        "synth.noise_codes_per_visit=1.2",
    ],
    "long_dense": [
        "--seed",
        "2026",
        "synth.start=2004-01-01",
        "synth.visit_rate=1.1",
        "synth.followup_probability=0.6",
    ],
    "recurrence": ["--seed", "3031", "synth.process=recurrence"],
    "recurrence_sparse": [
        "--seed",
        "3032",
        "synth.process=recurrence",
        "synth.start=2015-01-01",
        "synth.visit_rate=0.35",
        "synth.noise_codes_per_visit=1.2",
    ],
    "recurrence_300_codes": ["--seed", "3041", "synth.process=recurrence", "synth.codes=300"],
    "recurrence_long_dense": [
        "--seed",
        "3051",
        "synth.process=recurrence",
        "synth.start=2004-01-01",
        "synth.visit_rate=1.1",
    ],
    "progression": ["--seed", "3061", "synth.process=progression"],
    "progression_200_codes": ["--seed", "3071", "synth.process=progression", "synth.codes=200"],
}
PREDICTORS = ("model", *REFERENCE_NAMES, "oracle")


def cohort_args(name: str, seed_offset: int = 0) -> list[str]:
    """``behrt-rope synth`` arguments of cohort ``name``, its seed moved by ``seed_offset``: the same shape
    drawn afresh (for the recurrence family a new catalogue too), a cohort no setting was ever tuned on.

    >>> cohort_args("recurrence", 7000)
    ['--seed', '10031', 'synth.process=recurrence']
    """
    args = list(COHORTS[name])
    seed = args.index("--seed") + 1
    args[seed] = str(int(args[seed]) + seed_offset)
    return args


def is_clinical(name: str) -> bool:
    """Whether cohort ``name`` is of the clinical process, whose oracle knows more than the record (the other
    processes' oracles are already record oracles).

    >>> is_clinical("short_sparse"), is_clinical("recurrence"), is_clinical("progression")
    (True, False, False)
    """
    return not any(arg.startswith("synth.process=") for arg in COHORTS[name])


def stage(command: str, *args: str) -> dict[str, float]:
    """Run ``behrt-rope COMMAND ARGS`` in a child process; its CPU and wall seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    argv = [sys.executable, "-m", "behrt_rope", command, *args]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"behrt-rope {command} failed:\n{done.stderr[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"cpu_s": round(cpu, 1), "wall_s": round(time.perf_counter() - started, 1)}


def run_cohort(
    work: Path,
    name: str,
    patients: int,
    replicas: int,
    extra: list[str],
    with_wide: bool = False,
    split: tuple[float, float, float] = (0.8, 0.1, 0.1),
    record_particles: int = 0,
    task: str = "next_visit",
    seed_offset: int = 0,
    reach: bool = False,
) -> dict[str, Any]:
    """Every stage on one cohort (its seed moved by ``seed_offset``, see :func:`cohort_args`); the figures of
    its evaluation and the cost of each stage. With ``record_particles`` (clinical cohorts) also the record
    oracle of the held-out patients; with ``reach`` (recurrence and progression cohorts) also a learner told the
    generator's structure, fitted on the same patients (:func:`told_learner_reach`). The oracles give next-visit
    probabilities, so a ``6m`` or ``12m`` ``task`` is measured against the references only."""
    d = {s: work / name / s for s in ("cohort", "etl", "pretrain", "finetune", "evaluate")}
    oracle = task == "next_visit"
    against_oracle = [f"oracle={d['cohort']}"] if oracle else []
    seconds = {
        "synth": stage(
            "synth",
            "--out",
            str(d["cohort"]),
            "--patients",
            str(patients),
            *cohort_args(name, seed_offset),
            *(["oracle=true", f"oracle_replicas={replicas}"] if oracle else []),
        ),
        "etl": stage(
            "etl",
            "--input",
            str(d["cohort"]),
            "--out",
            str(d["etl"]),
            "progress=false",
            *(f"etl.split.{k}={v}" for k, v in zip(("train", "tuning", "held_out"), split)),
        ),
        **(
            {"record_oracle": write_record_oracle(d["cohort"], d["etl"], record_particles, replicas)}
            if oracle and record_particles and is_clinical(name)
            else {}
        ),
        "pretrain": stage(
            "pretrain", "--data", str(d["etl"]), "--out", str(d["pretrain"]), "trainer.progress_bar=false", *extra
        ),
        "finetune": stage(
            "finetune",
            "--data",
            str(d["etl"]),
            "--out",
            str(d["finetune"]),
            "--pretrained",
            str(d["pretrain"]),
            "--task",
            task,
            "trainer.progress_bar=false",
            *extra,
        ),
        "evaluate": stage(
            "evaluate",
            "--model",
            str(d["finetune"]),
            "--data",
            str(d["etl"]),
            "--out",
            str(d["evaluate"]),
            *against_oracle,
            "progress=false",
        ),
    }
    if with_wide:  # same pre-trained encoder, the wide bag-of-codes path switched on
        wide, wide_eval = work / name / "finetune_with_wide", work / name / "evaluate_with_wide"
        seconds["finetune_with_wide"] = stage(
            "finetune",
            "--data",
            str(d["etl"]),
            "--out",
            str(wide),
            "--pretrained",
            str(d["pretrain"]),
            "--task",
            task,
            "trainer.progress_bar=false",
            "model.wide=true",
            *extra,
        )
        seconds["evaluate_with_wide"] = stage(
            "evaluate",
            "--model",
            str(wide),
            "--data",
            str(d["etl"]),
            "--out",
            str(wide_eval),
            *against_oracle,
            "progress=false",
            "gradient_boosting=false",
            "sparse_time_regression=false",
        )
    metrics = json.loads((d["evaluate"] / "metrics.json").read_text())
    finetune = json.loads((d["finetune"] / "metrics.json").read_text())
    manifest = json.loads((d["etl"] / "manifest.json").read_text())
    wide_metrics = json.loads((work / name / "evaluate_with_wide" / "metrics.json").read_text()) if with_wide else None
    reached = (
        {"reach": told_learner_reach(name, d["cohort"], d["etl"], metrics, finetune["label_codes"])}
        if reach
        and oracle
        and metrics["ceiling"]
        and ("synth.process=recurrence" in COHORTS[name] or "synth.process=progression" in COHORTS[name])
        else {}
    )
    return {
        "task": task,
        "patients": manifest["patients"]["with_tokens"],
        "tokens_per_patient": manifest["sequence_length"]["mean"],
        "labels": finetune["labels"],
        "finetune_epochs": finetune["epochs"],
        "finetune_choices": finetune_choices(finetune),
        **(at_oracle_cuts(metrics, wide_metrics) if metrics["ceiling"] else {}),
        **reached,
        "all_held_out": {
            "n_samples": metrics["model"]["n_samples"],
            **{
                p: {k: _with_ci(e["overall"], k) for k in ("macro_ap", "micro_ap", "macro_auroc")}
                for p, e in {"model": metrics["model"], **metrics["baselines"]}.items()
            },
        },
        "seconds": seconds,
        "train_cpu_s": round(seconds["pretrain"]["cpu_s"] + seconds["finetune"]["cpu_s"], 1),
        "train_wall_s": round(seconds["pretrain"]["wall_s"] + seconds["finetune"]["wall_s"], 1),
    }


def finetune_choices(finetune: dict[str, Any]) -> dict[str, Any]:
    """What ``finetune`` chose on the tuning split and how far its budget let it go (its ``metrics.json``), so a
    figure can be read without the run's log: the epochs and whether the time budget stopped them, the
    distillation weight kept and the weights tried, the sparse time path's and the state path's shares, and the
    stage's seconds. Keys a run did not record (older metrics, paths switched off) are left out.

    >>> finetune_choices({"epochs": 19, "time_budget_stopped": True, "sparse_time_distillation": 0.8,
    ...     "distillation_choice": {"weights_tried": [0.0, 0.8]}, "sparse_time_share": 0.25,
    ...     "state_path": {"share": 0.0, "epochs": 43}, "stage_seconds": 714.1})
    ... # doctest: +NORMALIZE_WHITESPACE
    {'epochs': 19, 'time_budget_stopped': True, 'distillation_weight': 0.8, 'distillation_weights_tried': [0.0, 0.8],
     'sparse_time_share': 0.25, 'state_path_share': 0.0, 'state_path_epochs': 43, 'stage_seconds': 714.1}
    """
    state = finetune.get("state_path") or {}
    choices = {
        "epochs": finetune.get("epochs"),
        "time_budget_stopped": finetune.get("time_budget_stopped"),
        "distillation_weight": finetune.get("sparse_time_distillation"),
        "distillation_weights_tried": (finetune.get("distillation_choice") or {}).get("weights_tried"),
        "sparse_time_share": finetune.get("sparse_time_share"),
        "state_path_share": state.get("share"),
        "state_path_epochs": state.get("epochs"),
        "stage_seconds": finetune.get("stage_seconds"),
    }
    return {k: v for k, v in choices.items() if v is not None}


def torch_threads() -> dict[str, Any]:
    """The thread setting the stages inherit: ``OMP_NUM_THREADS`` (None: torch's default, one thread per core)
    and this machine's core count. The fine-tuning budget is wall time, so a run on one thread beside another
    trains fewer epochs than one alone on two cores (docs/benchmarks.md, "Fifty-third round")."""
    return {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "cpu_count": os.cpu_count()}


def cohort_config(cohort: Path) -> SynthConfig:
    """The synth settings a cohort folder was written with."""
    return config_lib.build(SynthConfig, config_lib.load_yaml(cohort / S.RESOLVED_CONFIG_FILE)["synth"])


def gap_anchors(metrics: dict[str, Any]) -> tuple[float, float]:
    """An evaluation's (``metrics.json``) macro AP at the oracle's cuts of the tuned logistic regression and of
    the oracle: the two ends of the gap a share is measured on."""
    predictors = metrics["ceiling"]["predictors"]
    return predictors["logistic_regression"]["overall"]["macro_ap"], predictors["oracle"]["overall"]["macro_ap"]


def told_learner_reach(
    name: str, cohort: Path, etl: Path, metrics: dict[str, Any], labels: list[str]
) -> dict[str, Any]:
    """The reach of a learner told the generator's structure on cohort ``name`` (a recurrence or progression
    one): :func:`fitted_form_reach` or :func:`fitted_structure_reach`."""
    if "synth.process=progression" in COHORTS[name]:
        return fitted_structure_reach(cohort, etl, metrics, labels)
    return fitted_form_reach(cohort, etl, metrics, labels)


def fitted_structure_reach(
    cohort: Path, etl: Path, metrics: dict[str, Any], labels: list[str], max_iter: int = 80
) -> dict[str, Any]:
    """How far the progression generator's hidden Markov model, its structure told and its parameters fitted
    on the same train patients (``benchmarks/progression_reach.py``), gets at the oracle's cuts: scored by
    :func:`reach_share` over the model's ``labels`` against the evaluation's tuned logistic regression and
    oracle (``metrics``), with the fit's figures (``max_iter`` L-BFGS iterations)."""
    low, high = gap_anchors(metrics)
    cpu = time.process_time()
    out = progression_reach(cohort_config(cohort), etl, max_iter, log=False)
    return {
        "fitted_structure": reach_share(out["per_code"], labels, low, high, "fitted_structure"),
        "oracle_as_scored_here": reach_share(out["per_code"], labels, low, high, "oracle"),
        "fit": out["fit"],
        "cpu_s": round(time.process_time() - cpu, 1),
    }


def fitted_form_reach(cohort: Path, etl: Path, metrics: dict[str, Any], labels: list[str]) -> dict[str, Any]:
    """How far a learner that knew the recurrence generator's equations gets from the same train patients
    (``benchmarks/recurrence_ceiling.py``): its form fitted with the catalogue's shapes told (``true_shapes``)
    and with the shapes learned from bins (``binned_shapes``), each read on the predicted visit's day (generous:
    it is told that day) and on the cut's (``..._at_cut``: what a learner of the record knows), each scored by
    :func:`reach_share` against the evaluation's tuned logistic regression and oracle (``metrics``) over the
    model's ``labels``."""
    low, high = gap_anchors(metrics)
    cpu = time.process_time()
    fits = fitted_forms(cohort_config(cohort), etl, REACH_FITS)
    cpu_s = round(time.process_time() - cpu, 1)
    return {_reach_key(shapes): reach_share(fit["per_code"], labels, low, high) for shapes, fit in fits.items()} | {
        "cpu_s": cpu_s
    }


REACH_FITS = ("true", "binned", "true_at_cut", "binned_at_cut")
"""The fitted forms ``--reach`` runs (keys of ``recurrence_ceiling.SHAPES``)."""


def _reach_key(shapes: str) -> str:
    """``metrics`` key of a fitted form: ``true_shapes``, ``binned_shapes_at_cut``, ...

    >>> [_reach_key(s) for s in REACH_FITS]
    ['true_shapes', 'binned_shapes', 'true_shapes_at_cut', 'binned_shapes_at_cut']
    """
    kind, _, at = shapes.partition("_")
    return f"{kind}_shapes" + (f"_{at}" if at else "")


def reach_share(
    per_code: dict[str, dict[str, float]], labels: list[str], low: float, high: float, key: str = "fitted_true_form"
) -> dict[str, Any]:
    """The fitted learner's (``per_code[code][key]``) macro AP over the codes among ``labels`` (matched as
    written or without their dots, as the ETL may strip them) and the share of the gap from ``low`` to ``high``
    (macro AP of the tuned logistic regression and of the oracle at the same cuts) that it closes.

    >>> per_code = {c: {"fitted_true_form": ap} for c, ap in (("A01.1", 0.5), ("B02", 0.3), ("C03", 0.9))}
    >>> reach_share(per_code, ["A011", "B02"], 0.2, 0.6)
    {'macro_ap': 0.4, 'codes': 2, 'gap_closed': 0.5}
    """
    wanted = set(labels)
    aps = [e[key] for code, e in per_code.items() if code in wanted or code.replace(".", "") in wanted]
    ap = sum(aps) / len(aps) if aps else math.nan
    return {"macro_ap": round(ap, 5), "codes": len(aps), "gap_closed": round((ap - low) / (high - low), 4)}


def at_oracle_cuts(metrics: dict[str, Any], wide: dict[str, Any] | None) -> dict[str, Any]:
    """From an evaluation against the oracle (``metrics.json``; ``wide``: the wide-path model's): every
    predictor's figures at the oracle's cuts (``at_oracle_cuts``) and the record oracle's macro AP when the
    cohort has one."""
    ceiling, record = metrics["ceiling"], metrics.get("ceiling_record") or {"predictors": {}}
    by_history = ceiling.get("by_history") or {}
    record_by_history = record.get("by_history") or {}
    if wide:
        ceiling["predictors"]["model_with_wide_path"] = wide["ceiling"]["predictors"]["model"]
        for part, entries in (wide["ceiling"].get("by_history") or {}).items():
            by_history.setdefault(part, {})["model_with_wide_path"] = entries["model"]
    return {
        "at_oracle_cuts": {
            "n_samples": ceiling["n_samples"],
            **{
                p: {
                    **{
                        k: _with_ci(ceiling["predictors"][p]["overall"], k)
                        for k in ("macro_ap", "micro_ap", "macro_auroc")
                    },
                    "gap_closed": ceiling["predictors"][p]["gap_closed"],
                    "gap_closed_one_cut": ceiling["predictors"][p].get("gap_closed_one_cut"),
                    **({"model_minus_this": model_lead(ceiling["predictors"], p)} if p != "model" else {}),
                    "gap_closed_by_history": {part: e[p]["gap_closed"] for part, e in by_history.items() if p in e},
                    **(
                        {
                            "gap_closed_record": record["predictors"][p]["gap_closed"],
                            "gap_closed_record_by_history": {
                                part: e[p]["gap_closed"] for part, e in record_by_history.items() if p in e
                            },
                        }
                        if p in record["predictors"]
                        else {}
                    ),
                }
                for p in (*PREDICTORS, "model_with_wide_path")
                if p in ceiling["predictors"]
            },
        },
        **(
            {"record_oracle_macro_ap": _with_ci(record["predictors"]["oracle"]["overall"], "macro_ap")}
            if "oracle" in record["predictors"]
            else {}
        ),
    }


def model_lead(predictors: dict[str, Any], other: str) -> dict[str, Any] | None:
    """The model's macro AP minus ``other``'s at the oracle's cuts, with a paired interval (the evaluation
    draws every predictor's bootstrap replicate ``b`` from the same samples; no interval without both
    predictors' replicates); None when either is missing."""
    model, entry = predictors.get("model"), predictors.get(other)
    lead = replicate_difference(model, entry, "macro_ap") if model and entry else None
    if lead is None:
        return None
    point, low, high = lead
    return {"point": point, "ci": [low, high] if math.isfinite(low) and math.isfinite(high) else None}


def write_record_oracle(cohort: Path, etl: Path, particles: int, replicas: int) -> dict[str, float]:
    """The record oracle of the held-out patients (``synthetic_data/record_oracle.py``), written beside the
    state oracle as ``cohort/oracle_record.parquet`` so that ``evaluate oracle=cohort`` measures against
    both; its CPU and wall seconds (it runs in this process, on one core)."""
    cpu, started = time.process_time(), time.perf_counter()
    cfg = config_lib.build(SynthConfig, config_lib.load_yaml(cohort / S.RESOLVED_CONFIG_FILE)["synth"])
    held = load_tokens(etl).split(S.HELD_OUT).patients[S.PATIENT_ID].astype(str).tolist()
    oracle = record_oracle_table(cfg, particles=particles, replicas=replicas, patients=held)
    oracle.table.to_parquet(cohort / S.RECORD_ORACLE_FILE, index=False)
    return {"cpu_s": round(time.process_time() - cpu, 1), "wall_s": round(time.perf_counter() - started, 1)}


def _with_ci(overall: dict[str, Any], key: str) -> dict[str, Any]:
    return {"point": overall[key], "ci": (overall.get("ci") or {}).get(key)}


def markdown(results: dict[str, Any]) -> str:
    """The docs tables: at the oracle's cuts (cohorts evaluated against it), on every held-out sample, and
    the cost, one row per cohort and predictor."""
    cohorts = results["cohorts"]
    with_cuts = {name: r for name, r in cohorts.items() if "at_oracle_cuts" in r}
    tables = [_cuts_table(with_cuts), _lead_table(with_cuts)] if with_cuts else []
    reached = {name: r for name, r in cohorts.items() if "reach" in r and "fitted_structure" not in r["reach"]}
    tables += [_reach_table(reached)] if reached else []
    structures = {name: r for name, r in cohorts.items() if "fitted_structure" in r.get("reach", {})}
    tables += [_structure_reach_table(structures)] if structures else []
    return "\n".join([*tables, _held_out_table(cohorts), _cost_table(cohorts)])


def _cuts_table(cohorts: dict[str, Any]) -> str:
    """Every predictor at the oracle's cuts with the gap closed (and the record oracle's columns when a cohort
    has it)."""
    record = any("record_oracle_macro_ap" in r for r in cohorts.values())
    lines = [
        "| cohort | predictor | macro AP (95% CI) | micro AP | macro AUROC | gap closed (95% CI) "
        "| from the one-cut LR (95% CI) | on codes on file | on new onsets |"
        + (" gap closed to the record oracle (95% CI) | on file / new onsets |" if record else ""),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if record else ""),
    ]
    for cohort, r in cohorts.items():
        if "record_oracle_macro_ap" in r:
            ap = r["record_oracle_macro_ap"]
            lines.append(f"| {cohort} | record oracle | {ap['point']:.3f} |" + " |" * (6 + 2 * record))
        for p in [p for p in (*PREDICTORS, "model_with_wide_path") if p in r["at_oracle_cuts"]]:
            e = r["at_oracle_cuts"][p]
            parts = e.get("gap_closed_by_history") or {}
            split = " | ".join(format_share(parts.get(part), ci=False) for part in HISTORY_PARTS)
            row = (
                f"| {cohort} | {p} | {_ap_with_ci(e)} | {e['micro_ap']['point']:.3f} | "
                f"{e['macro_auroc']['point']:.3f} | {format_share(e['gap_closed'])} "
                f"| {format_share(e.get('gap_closed_one_cut'))} | {split} |"
            )
            if record:
                on_record = e.get("gap_closed_record_by_history") or {}
                halves = " / ".join(format_share(on_record.get(part), ci=False) for part in HISTORY_PARTS)
                row += f" {format_share(e.get('gap_closed_record'))} | {halves} |"
            lines.append(row)
    return "\n".join(lines) + "\n"


def _lead_table(cohorts: dict[str, Any]) -> str:
    """Per cohort, the model's macro AP minus each reference's at the oracle's cuts (paired 95% CI): whether
    the model is ahead of the strongest cheap baseline."""
    names = [p for p in REFERENCE_NAMES if any(p in r["at_oracle_cuts"] for r in cohorts.values())]
    lines = [
        "| cohort | " + " | ".join(f"model minus {p} (paired 95% CI)" for p in names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for cohort, r in cohorts.items():
        leads = [(r["at_oracle_cuts"].get(p) or {}).get("model_minus_this") for p in names]
        lines.append(f"| {cohort} | " + " | ".join(_lead_text(lead) for lead in leads) + " |")
    return "\n".join(lines) + "\n"


def _lead_text(lead: dict[str, Any] | None) -> str:
    if not lead:
        return "–"
    text = f"{lead['point']:+.4f}"
    return text + (f" ({lead['ci'][0]:+.4f} to {lead['ci'][1]:+.4f})" if lead.get("ci") else "")


def _held_out_table(cohorts: dict[str, Any]) -> str:
    """Every predictor on all held-out samples of the cohort's task (no oracle needed)."""
    lines = [
        "| cohort | task | predictor | macro AP (95% CI) | micro AP | macro AUROC |",
        "|---|---|---|---:|---:|---:|",
    ]
    for cohort, r in cohorts.items():
        for p, e in r["all_held_out"].items():
            if p != "n_samples":
                lines.append(
                    f"| {cohort} | {r.get('task', 'next_visit')} | {p} | {_ap_with_ci(e)} | "
                    f"{e['micro_ap']['point']:.3f} | {e['macro_auroc']['point']:.3f} |"
                )
    return "\n".join(lines) + "\n"


def _reach_table(cohorts: dict[str, Any]) -> str:
    """Gap closed at the oracle's cuts by the model and by the generator's own form fitted on the same patients
    (``--reach``), and the model's share of that form's."""
    lines = [
        "| cohort | model | fitted form, shapes told | fitted form, shapes from bins | model / told form "
        "| the same two read at the cut (told / bins) | model / told form at the cut |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for cohort, r in cohorts.items():
        model = r["at_oracle_cuts"]["model"]["gap_closed"]["point"]
        told, binned = (r["reach"][f"{shapes}_shapes"]["gap_closed"] for shapes in ("true", "binned"))
        at_cut = [r["reach"].get(f"{shapes}_shapes_at_cut", {}).get("gap_closed") for shapes in ("true", "binned")]
        cut_text, cut_share = "—", "—"
        if None not in at_cut:
            cut_text, cut_share = f"{at_cut[0]:.0%} / {at_cut[1]:.0%}", f"{model / at_cut[0]:.0%}"
        lines.append(
            f"| {cohort} | {model:.0%} | {told:.0%} | {binned:.0%} | {model / told:.0%} | {cut_text} | {cut_share} |"
        )
    return "\n".join(lines) + "\n"


def _structure_reach_table(cohorts: dict[str, Any]) -> str:
    """Gap closed at the oracle's cuts by the model and by the progression model fitted with its structure
    told (``--reach``), and the model's share of the fit's."""
    lines = [
        "| cohort | model | hidden Markov model, structure told, fitted | model / fitted |",
        "|---|---:|---:|---:|",
    ]
    for cohort, r in cohorts.items():
        model, fitted = (
            r["at_oracle_cuts"]["model"]["gap_closed"]["point"],
            r["reach"]["fitted_structure"]["gap_closed"],
        )
        lines.append(f"| {cohort} | {model:.0%} | {fitted:.0%} | {model / fitted:.0%} |")
    return "\n".join(lines) + "\n"


def _cost_table(cohorts: dict[str, Any]) -> str:
    lines = [
        "| cohort | patients | mean tokens per patient | held-out samples (at the oracle's cuts) "
        "| train CPU s (wall s) |",
        "|---|---:|---:|---:|---:|",
    ]
    for cohort, r in cohorts.items():
        at_cuts = r["at_oracle_cuts"]["n_samples"] if "at_oracle_cuts" in r else "–"
        lines.append(
            f"| {cohort} | {r['patients']} | {r['tokens_per_patient']} | {r['all_held_out']['n_samples']} ({at_cuts}) "
            f"| {r['train_cpu_s']:.0f} ({r['train_wall_s']:.0f}) |"
        )
    return "\n".join(lines) + "\n"


def _ap_with_ci(entry: dict[str, Any]) -> str:
    ap = entry["macro_ap"]
    return f"{ap['point']:.3f}" + (f" ({ap['ci'][0]:.3f}-{ap['ci'][1]:.3f})" if ap["ci"] else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cohorts", nargs="+", default=list(COHORTS), choices=list(COHORTS))
    parser.add_argument("--patients", type=int, default=8000)
    parser.add_argument(
        "--split",
        type=float,
        nargs=3,
        default=(0.5, 0.05, 0.45),
        metavar=("TRAIN", "TUNING", "HELD_OUT"),
        help="patient shares; the default gives 4,000 train patients and a held-out set large enough for the "
        "oracle comparison (one cut per held-out patient)",
    )
    parser.add_argument(
        "--task",
        default="next_visit",
        choices=("next_visit", "6m", "12m"),
        help="the fine-tuning task; the oracles give next-visit probabilities, so 6m and 12m are measured "
        "against the references on every held-out sample only",
    )
    parser.add_argument("--oracle-replicas", type=int, default=300)
    parser.add_argument(
        "--record-oracle-particles",
        type=int,
        default=0,
        help="also measure against the record oracle of the held-out patients (clinical cohorts) with this "
        "many copies per patient (1000: about a quarter of a core-second per patient); 0: off",
    )
    parser.add_argument(
        "--seed-offset",
        type=int,
        default=0,
        help="add this to every cohort's seed: the same shapes drawn afresh, cohorts never seen before (>= 0)",
    )
    parser.add_argument(
        "--reach",
        action="store_true",
        help="recurrence cohorts: also fit the generator's own form on the same patients (its shapes told, and "
        "learned from bins) to show how much of the gap a learner that knew the equations closes",
    )
    parser.add_argument("--work", type=Path, default=None, help="keep every stage's output here")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the docs table here")
    parser.add_argument(
        "--with-wide", action="store_true", help="also fine-tune and score the model with its wide path on"
    )
    parser.add_argument("extra", nargs="*", help="overrides passed to pretrain and finetune")
    args = parser.parse_args(argv)
    if args.seed_offset < 0:
        parser.error(f"--seed-offset must be >= 0, got {args.seed_offset}")
    with tempfile.TemporaryDirectory(prefix="behrt_quality_") as tmp:
        work = (args.work or Path(tmp)).resolve()  # the stages run from the repository root
        results: dict[str, Any] = {
            "benchmark": "quality",
            "patients": args.patients,
            "oracle_replicas": args.oracle_replicas,
            "record_oracle_particles": args.record_oracle_particles,
            "task": args.task,
            "split": args.split,
            "overrides": args.extra,
            "seed_offset": args.seed_offset,
            "torch_threads": torch_threads(),
            "cohorts": {},
        }
        for name in args.cohorts:
            print(f"quality: cohort {name}", file=sys.stderr, flush=True)
            results["cohorts"][name] = run_cohort(
                work,
                name,
                args.patients,
                args.oracle_replicas,
                args.extra,
                args.with_wide,
                tuple(args.split),
                args.record_oracle_particles,
                args.task,
                args.seed_offset,
                args.reach,
            )
    print(json.dumps(results, indent=2))
    if args.markdown:
        args.markdown.write_text(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
