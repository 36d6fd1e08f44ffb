"""``behrt-rope evaluate``: held-out metrics and report, beside four reference models and (synthetic) a ceiling.

The references are fitted on the train split's samples of the same task: a bag-of-codes logistic regression
and gradient boosting on time features (``behrt_rope.evaluation.baseline``), an L1 regression on binned timing
of every label code (``behrt_rope.evaluation.sparse_time``), plus the classic set-up of the
BEHRT paper's comparisons, a logistic regression on code presence, age, sex and visit count fitted on one
random cut per train patient. With ``oracle=DIR`` (a ``behrt-rope synth ... oracle=true`` output) every
predictor is also scored on the held-out samples at the oracle's cut visits, beside the generator's true
probabilities, with the share of the gap closed: from the every-visit logistic regression (``gap_closed``,
the stricter yardstick) and from the one-cut one (``gap_closed_one_cut``). A model with the sparse time
path (the default) is also scored in two ablations shown beside the references: its deep part alone
(``model_deep_part``: the encoder and its head, without the sparse time path and the hidden-state chains) and,
when the chains have a share, its learned parts (``model_learned_parts``: the model without the sparse time
path, i.e. without its hand-made time features).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import scipy.sparse as sp

from behrt_rope import config as config_lib
from behrt_rope import schema as S
from behrt_rope.data.labels import (
    Samples,
    TaskConfig,
    build_samples,
    history,
    label_index,
    subsample_index,
    targets,
)
from behrt_rope.data.sequences import Sequences, load_tokens, load_vocabulary, ragged_positions
from behrt_rope.errors import UserError
from behrt_rope.etl import descriptions
from behrt_rope.etl.config import EtlConfig
from behrt_rope.evaluation import meds_predictions
from behrt_rope.evaluation.baseline import (
    GBM_GRID,
    age_features,
    bag_of_codes,
    choose_c,
    choose_gbm,
    fit_predict_baseline,
    fit_predict_gbm,
    sex_features,
)
from behrt_rope.evaluation.ceiling import (
    ORACLE,
    both_shares,
    gap_by_history,
    gap_closed,
    oracle_files,
    oracle_matrix,
    per_code_at_cuts,
    read_oracle,
)
from behrt_rope.evaluation.evaluate import evaluate_scores, write_evaluation_report
from behrt_rope.evaluation.report import REFERENCE_NAMES
from behrt_rope.evaluation.sparse_time import (
    DEFAULT_BINS,
    SELECT_C,
    Bins,
    SparseTimeFit,
    fit_predict_sparse_time,
    sparse_c_setting,
)
from behrt_rope.evaluation.time_features import TimeFeatures, time_features
from behrt_rope.model.heads import BehrtForMultiLabel
from behrt_rope.stage import is_done, require_done, stage, write_json
from behrt_rope.training.bundle import load_bundle
from behrt_rope.training.inference import Part, multilabel_model, resolve_device, score_parts

log = logging.getLogger("behrt_rope.evaluate")
MODEL, LOGISTIC, GBM = "model", "logistic_regression", "gradient_boosting"
LOGISTIC_ONE_CUT = "logistic_regression_one_cut"
DEEP_PART = "model_deep_part"
LEARNED_PARTS = "model_learned_parts"
ABLATIONS: dict[Part, str] = {"deep": DEEP_PART, "learned": LEARNED_PARTS}
"""The model's parts scored as ablations beside the references, by their key in ``metrics.json``."""
SPARSE_TIME = "sparse_time_regression"
TASK_TITLES = {
    "next_visit": "Diagnoses recorded at the next visit",
    "6m": "Diagnoses recorded within 6 months",
    "12m": "Diagnoses recorded within 12 months",
}


@dataclass
class Config:
    model: str = ""
    """A `behrt-rope finetune` output directory."""
    data: str = ""
    """The ETL output directory the model was trained on (its held_out split is evaluated)."""
    out: str = ""
    """Output directory (metrics.json, report.html, plots/)."""
    overwrite: bool = False
    """Redo the work even if OUT already holds a finished run of the same configuration."""
    n_bootstrap: int = 200
    """Bootstrap resamples of held-out samples for the 95% intervals."""
    seed: int = 0
    """Seeds the bootstrap."""
    batch_size: int = 256
    """Samples per forward pass."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to run the model."""
    baseline_c: float | None = None
    """Inverse L2 strength of the logistic-regression baselines. Unset (the default): each regression picks
    its own from ``C_GRID`` (0.01-1) by macro AP on the tuning split's samples (C=1 when that split has none);
    ``metrics.json`` ``baseline_c`` records the choice. A number fixes it for both."""
    baseline_max_train_samples: int = 50_000
    """Fit the reference models on at most this many train samples (a seeded subsample), to bound their time."""
    gradient_boosting: bool = True
    """Also fit the gradient-boosted reference on time features (one tree model per label code)."""
    gradient_boosting_setting: str | None = None
    """The gradient-boosted reference's regularisation, a name of ``GBM_GRID`` (strong, moderate, flexible).
    Unset (the default): the one with the best macro AP on the tuning split's samples, scored on up to 40 of
    its label codes (flexible when that split has none); ``metrics.json`` ``gradient_boosting_setting``
    records the choice."""
    sparse_time_regression: bool = True
    """Also fit the sparse time regression (``behrt_rope/evaluation/sparse_time.py``): an L1 logistic regression
    per label code on binned time features of its own code and of every other label code."""
    sparse_time_c: float | None = None
    """Inverse L1 strength of the sparse time regression (its refit, after ``sparse_time_select_c`` chose the
    codes each label reads). Unset (the default): the one of ``evaluation.sparse_time.C_GRID`` with the best
    macro AP on the tuning split's samples, scored on up to 60 of its label codes, as ``finetune
    sparse_time_c=null`` chooses the path's (``DEFAULT_C`` when that split has none); ``metrics.json``
    ``sparse_time_c`` records the choice. A number fixes it."""
    sparse_time_select_c: float | None = SELECT_C
    """Inverse L1 strength of the first fit of each label's sparse time regression, which only chooses the
    other codes it reads (a relaxed lasso, as ``finetune sparse_time_select_c``); null: one fit on everything."""
    sparse_time_bins: Bins = DEFAULT_BINS
    """How the sparse time regression reads the ordered time bins, as ``finetune sparse_time_bins``."""
    oracle: str = ""
    """A `behrt-rope synth ... oracle=true` output directory (or one oracle file): adds the ceiling; a
    directory that also holds the record oracle (``synth ... record_oracle=true``) adds that second ceiling
    (``ceiling_record``), as does the record oracle's file (``oracle_record.parquet``) given alone."""
    notes: str = ""
    """A caveat shown in the report (e.g. 'Synthetic data: ...')."""
    meds_predictions: bool = False
    """Also write the held-out predictions with their observed outcomes in the MEDS layout
    (OUT/predictions_meds/: one meds-evaluation file per label code, and index.json)."""
    progress: bool = True


def run(config: Config) -> Path:
    """Evaluate on the held-out split; returns the output directory."""
    if not (config.model and config.data and config.out):
        raise UserError("evaluate needs --model FINETUNE_DIR, --data ETL_DIR and --out DIR")
    out_dir = Path(config.out)
    require_done(config.data, "etl")
    if not config.overwrite and is_done(out_dir, config, inputs=[config.model, config.data, config.oracle]):
        log.info("evaluate: %s already holds this run; skipping (overwrite=true to redo)", out_dir)
        return out_dir
    bundle = load_bundle(config.model, "multilabel")
    seqs, vocab = load_tokens(config.data), load_vocabulary(config.data)
    if vocab["token"].tolist() != bundle["vocab"]:
        raise UserError(
            f"{config.model} was trained on a different vocabulary than {config.data} ({len(bundle['vocab'])} "
            f"tokens against {len(vocab)}); evaluate scores the held-out split of the ETL output the model was "
            f"fine-tuned on{_trained_on(config.model)}"
        )
    task = config_lib.build(TaskConfig, bundle["task"])
    if config.oracle and task.name != "next_visit":
        raise UserError(
            f"{config.oracle}: the oracle gives next-visit probabilities, but {config.model} predicts the "
            f"{task.name} task, so no ceiling exists for it; evaluate without oracle=, or a next_visit model"
        )
    label_of_token = label_index(np.asarray(bundle["label_token_ids"], dtype=np.int64), len(vocab))
    held = seqs.split(S.HELD_OUT)
    samples = build_samples(held, task)
    if len(samples) == 0:
        raise UserError(f"{config.data}: the held_out split has no {task.name} samples to evaluate")
    y, seen = targets(held, samples, label_of_token), history(held, samples, label_of_token)
    with stage(out_dir, config, "evaluate", inputs=[config.model, config.data, config.oracle]) as out:
        log.info(
            "evaluate: %d held-out samples from %d patients, %d labels",
            len(samples),
            len(np.unique(samples.rows)),
            y.shape[1],
        )
        model = multilabel_model(bundle, config.model)
        device = resolve_device(config.device)
        parts = ablation_parts(model)
        scored = score_parts(model, held, samples.rows, samples.cuts, config.batch_size, device, config.progress, parts)
        probs = scored["model"]
        splits = References(seqs.split(S.TRAIN), seqs.split(S.TUNING), held, samples, task, label_of_token)
        references, choices = _references(splits, config)
        baseline_c = {name: choices[name] for name in (LOGISTIC, LOGISTIC_ONE_CUT)}
        references.update({name: scored[part] for part, name in ABLATIONS.items() if part in scored})
        labels = bundle["labels"]

        def evaluation(scores: np.ndarray) -> dict[str, Any]:
            return evaluate_scores(y, scores, seen, labels, config.n_bootstrap, config.seed)

        model_eval = evaluation(probs)
        reference_evals = {name: evaluation(scores) for name, scores in references.items()}
        predictions = {MODEL: probs, **references}
        ceilings = {
            key: _ceiling(config, file, held, samples, y, seen, predictions, labels)
            for key, file in (oracle_files(config.oracle) if config.oracle else {}).items()
        }
        pretrain = _pretrain_metrics(bundle)
        write_json(
            out / S.METRICS_FILE,
            {
                "task": task.name,
                "held_out_patients": len(np.unique(samples.rows)),
                "model": model_eval,
                "baselines": reference_evals,
                "ceiling": ceilings.get("ceiling"),
                "ceiling_record": ceilings.get("ceiling_record"),
                "pretrain": pretrain,
                "baseline_c": baseline_c,
                "gradient_boosting_setting": choices.get(GBM),
                "sparse_time_c": choices.get(SPARSE_TIME),
            },
        )
        primary = GBM if GBM in reference_evals else LOGISTIC
        report = write_evaluation_report(
            out,
            "BEHRT-RoPE",
            TASK_TITLES[task.name],
            model_eval,
            reference_evals[primary],
            baseline_name=REFERENCE_NAMES[primary],
            references={REFERENCE_NAMES[name]: value for name, value in reference_evals.items()},
            ceiling=ceilings.get("ceiling"),
            record_ceiling=ceilings.get("ceiling_record"),
            n_patients=len(np.unique(samples.rows)),
            pretrain_metrics=pretrain,
            run_info=_run_info(config, bundle, task, choices),
            notes=[config.notes] if config.notes else (),
            code_descriptions=descriptions.load(config.data) or None,
        )
        if config.meds_predictions:
            meds_predictions.write(_long_predictions(held, samples, labels, probs, y), out / S.MEDS_PREDICTIONS_DIR)
        _log_headline(model_eval, reference_evals, ceilings, report)
    return out_dir


def ablation_parts(model: BehrtForMultiLabel) -> tuple[Part, ...]:
    """The parts of ``model`` to score: the model; with the sparse time path also its deep part alone; and
    when the state path has a share, its learned parts (the model without the sparse time path), which then
    differ from the deep part."""
    if model.sparse_time is None:
        return ("model",)
    return ("model", "deep", "learned") if model.uses_state_path else ("model", "deep")


def _long_predictions(
    held: Sequences, samples: Samples, labels: list[str], probs: np.ndarray, y: np.ndarray
) -> pa.Table:
    """(N samples x L labels) scores and outcomes as a long table: one row per sample and label code."""
    n, n_labels = probs.shape
    repeat = np.repeat(np.arange(n), n_labels)
    ids = held.patients[S.PATIENT_ID].to_numpy(dtype=object)[samples.rows]
    return pa.table(
        {
            S.PATIENT_ID: pa.array(ids[repeat].astype(str)),
            S.PREDICTION_TIME: pa.array(samples.times.astype("datetime64[us]")[repeat], pa.timestamp("us")),
            S.CODE: pa.array(np.tile(np.asarray(labels, dtype=object), n), pa.string()),
            S.PROBABILITY: pa.array(probs.reshape(-1).astype(np.float64)),
            meds_predictions.BOOLEAN_VALUE: pa.array(y.reshape(-1).astype(bool)),
        }
    )


def _train_samples(train: Sequences, task: TaskConfig, config: Config) -> Samples:
    """The train split's samples of the task, a seeded subsample of at most ``baseline_max_train_samples``."""
    samples = build_samples(train, task)
    return samples.take(subsample_index(len(samples), config.baseline_max_train_samples, config.seed))


@dataclass(frozen=True)
class References:
    """What the reference models are fitted on (train), tuned on (tuning) and scored on (the held-out
    ``samples`` of ``held``), for ``task`` and its label columns (``label_of_token``)."""

    train: Sequences
    tuning: Sequences
    held: Sequences
    samples: Samples
    task: TaskConfig
    label_of_token: np.ndarray

    @cached_property
    def tuning_samples(self) -> Samples:
        """The tuning split's samples of the task (built once, for both regressions' choice of C)."""
        return build_samples(self.tuning, self.task)

    @cached_property
    def tuning_targets(self) -> np.ndarray:
        """``(N_tune, L)`` 0/1 targets of :attr:`tuning_samples`."""
        return targets(self.tuning, self.tuning_samples, self.label_of_token)


Features = Callable[[Sequences, Samples, int], tuple[sp.csr_array, np.ndarray]]


def _fit_logistic(
    name: str, features: Features, train_samples: Samples, y_train: np.ndarray, data: References, config: Config
) -> tuple[np.ndarray, dict[str, Any]]:
    """A bag-of-codes regression (its columns from ``features``) fitted on ``train_samples`` (``y_train`` their
    targets): (N, L) held-out probabilities, and its C with how it was chosen (``Config.baseline_c``)."""
    vocab_size = len(data.label_of_token)
    x_train, dense_train = features(data.train, train_samples, vocab_size)
    c, choice = _logistic_c(name, features, (x_train, dense_train, y_train), data, config)
    x_eval, dense_eval = features(data.held, data.samples, vocab_size)
    probs = fit_predict_baseline(
        x_train, y_train, x_eval, C=c, seed=config.seed, extra_train=dense_train, extra_eval=dense_eval
    )
    return probs, choice


def _logistic_c(
    name: str,
    features: Features,
    train: tuple[sp.csr_array, np.ndarray, np.ndarray],
    data: References,
    config: Config,
) -> tuple[float, dict[str, Any]]:
    """``Config.baseline_c`` when set, else the best of ``C_GRID`` on the tuning split's samples."""
    if config.baseline_c is not None:
        return config.baseline_c, {"c": config.baseline_c, "chosen_on": "fixed (baseline_c)"}
    tuning_samples = data.tuning_samples
    if len(tuning_samples) == 0:
        log.warning("evaluate: no tuning samples to choose the %s's C; using C=1", REFERENCE_NAMES[name])
        return 1.0, {"c": 1.0, "chosen_on": "default (no tuning samples)"}
    x_train, dense_train, y_train = train
    x_tune, dense_tune = features(data.tuning, tuning_samples, len(data.label_of_token))
    c, by_c = choose_c(
        x_train, y_train, x_tune, data.tuning_targets, seed=config.seed, extra_train=dense_train, extra_tune=dense_tune
    )
    log.info("evaluate: %s C=%g, chosen on %d tuning samples", REFERENCE_NAMES[name], c, len(tuning_samples))
    return c, {"c": c, "chosen_on": "tuning split", "tuning_macro_ap": {str(k): v for k, v in by_c.items()}}


def _references(data: References, config: Config) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(N, L) held-out probabilities of each reference model, fitted on the same train samples, and how each
    tuned reference's setting was chosen (the logistic regressions' C, gradient boosting's regularisation)."""
    train, held, samples, task, label_of_token = data.train, data.held, data.samples, data.task, data.label_of_token
    train_samples = _train_samples(train, task, config)
    y_train = targets(train, train_samples, label_of_token)
    log.info("evaluate: fitting the logistic regression on %d train samples", len(train_samples))
    out: dict[str, np.ndarray] = {}
    choices: dict[str, Any] = {}
    out[LOGISTIC], choices[LOGISTIC] = _fit_logistic(LOGISTIC, _bag, train_samples, y_train, data, config)
    one_cut = one_cut_samples(train, task, config.seed)
    log.info("evaluate: fitting the one-cut logistic regression on %d train samples", len(one_cut))
    out[LOGISTIC_ONE_CUT], choices[LOGISTIC_ONE_CUT] = _fit_logistic(
        LOGISTIC_ONE_CUT, _presence, one_cut, targets(train, one_cut, label_of_token), data, config
    )
    if config.gradient_boosting or config.sparse_time_regression:
        train_times = time_features(train, train_samples, label_of_token)
        eval_times = time_features(held, samples, label_of_token)
    if config.gradient_boosting:
        setting, choices[GBM] = _gbm_setting(train_times, y_train, data, config)
        log.info("evaluate: fitting gradient boosting on time features, %d labels", y_train.shape[1])
        out[GBM] = fit_predict_gbm(
            train_times, y_train, eval_times, seed=config.seed, params=GBM_GRID[setting], progress=config.progress
        )
    if config.sparse_time_regression:
        log.info("evaluate: fitting the sparse time regression, %d labels", y_train.shape[1])
        c, choices[SPARSE_TIME], start = _sparse_c(train_times, y_train, data, config)
        out[SPARSE_TIME] = fit_predict_sparse_time(
            train_times,
            y_train,
            eval_times,
            c=c,
            progress=config.progress,
            start=start,
            select_c=config.sparse_time_select_c,
            bins=config.sparse_time_bins,
        )
    return out, choices


def _sparse_time_info(choice: dict[str, Any]) -> str:
    """The report's run-info line for the sparse time regression, from its ``sparse_time_c`` record.

    >>> relaxed = {"c": 0.3, "chosen_on": "tuning split", "select_c": 0.05, "bins": "cumulative"}
    >>> _sparse_time_info(relaxed).split(" time features of every label code ")
    ['L1 regression on cumulative bins of the', '(relaxed: codes chosen at C=0.05, refit at C=0.3, tuning split)']
    >>> _sparse_time_info({"c": 0.1, "chosen_on": "fixed (sparse_time_c)", "select_c": None})[17:]
    'indicator bins of the time features of every label code (C=0.1, fixed (sparse_time_c))'
    """
    select_c = choice.get("select_c")
    strength = (
        f"C={choice['c']:g}"
        if select_c is None
        else f"relaxed: codes chosen at C={select_c:g}, refit at C={choice['c']:g}"
    )
    bins = f"{choice.get('bins', 'indicator')} bins of the"
    return f"L1 regression on {bins} time features of every label code ({strength}, {choice['chosen_on']})"


def _sparse_c(
    train_times: TimeFeatures, y_train: np.ndarray, data: References, config: Config
) -> tuple[float, dict[str, Any], SparseTimeFit | None]:
    """``Config.sparse_time_c`` when set, else the best of the sparse ``C_GRID`` on the tuning split (with the
    choice's fit of its sampled labels, which the full fit takes over)."""
    return sparse_c_setting(
        config.sparse_time_c,
        train_times,
        y_train,
        lambda: time_features(data.tuning, data.tuning_samples, data.label_of_token),
        data.tuning_targets,
        config.seed,
        log,
        "evaluate: sparse time regression",
        config.sparse_time_select_c,
        config.sparse_time_bins,
    )


def _gbm_setting(
    train_times: TimeFeatures, y_train: np.ndarray, data: References, config: Config
) -> tuple[str, dict[str, Any]]:
    """``Config.gradient_boosting_setting`` when set, else the best of ``GBM_GRID`` on the tuning split."""
    if config.gradient_boosting_setting is not None:
        name = config.gradient_boosting_setting
        if name not in GBM_GRID:
            raise UserError(f"gradient_boosting_setting must be one of {', '.join(GBM_GRID)}, got {name!r}")
        return name, {"setting": name, "params": GBM_GRID[name], "chosen_on": "fixed (gradient_boosting_setting)"}
    if len(data.tuning_samples) == 0:
        log.warning("evaluate: no tuning samples to choose gradient boosting's regularisation; using 'flexible'")
        return "flexible", {
            "setting": "flexible",
            "params": GBM_GRID["flexible"],
            "chosen_on": "default (no tuning samples)",
        }
    tune_times = time_features(data.tuning, data.tuning_samples, data.label_of_token)
    name, by_setting, n_labels = choose_gbm(
        train_times, y_train, tune_times, data.tuning_targets, seed=config.seed, progress=config.progress
    )
    log.info(
        "evaluate: gradient boosting's regularisation %r, chosen on %d tuning samples and %d label codes",
        name,
        len(data.tuning_samples),
        n_labels,
    )
    return name, {
        "setting": name,
        "params": GBM_GRID[name],
        "chosen_on": "tuning split",
        "tuning_labels": n_labels,
        "tuning_macro_ap": by_setting,
    }


def _ceiling(
    config: Config,
    oracle_file: Path,
    held: Sequences,
    samples: Samples,
    y: np.ndarray,
    seen: np.ndarray,
    predictions: dict[str, np.ndarray],
    labels: list[str],
) -> dict[str, Any]:
    """Every predictor and the oracle on the held-out samples at the oracle's cuts, and the gap closed (also
    apart on codes already on file and new onsets; ``seen`` (N, L) bool: code in the sample's history)."""
    etl = config_lib.build(EtlConfig, _etl_settings(config.data).get("etl", {}))
    matched, oracle_probs = oracle_matrix(read_oracle(oracle_file), held, samples, labels, etl)
    if not len(matched):
        raise UserError(f"{oracle_file}: no oracle cut matches a held-out sample of {config.data}")
    at_cuts = {**{name: scores[matched] for name, scores in predictions.items()}, ORACLE: oracle_probs}
    evaluations = {
        name: evaluate_scores(y[matched], scores, None, labels, config.n_bootstrap, config.seed)
        for name, scores in at_cuts.items()
    }
    closed = gap_closed(evaluations, LOGISTIC)
    closed_one_cut = gap_closed(evaluations, LOGISTIC_ONE_CUT) if LOGISTIC_ONE_CUT in evaluations else {}
    by_history = gap_by_history(y[matched], at_cuts, seen[matched], LOGISTIC, config.n_bootstrap, config.seed)
    log.info("evaluate: %d held-out samples at the cuts of %s", len(matched), oracle_file)
    return {
        "n_samples": len(matched),
        "n_patients": len(np.unique(samples.rows[matched])),
        "predictors": {
            name: {
                "overall": e["overall"],
                "gap_closed": closed[name],
                "gap_closed_one_cut": closed_one_cut.get(name),
                "bootstrap": e["bootstrap"],
            }
            for name, e in evaluations.items()
        },
        "by_history": by_history,
        "per_code": per_code_at_cuts(evaluations),
    }


def _etl_settings(etl_dir: str) -> dict[str, Any]:
    path = Path(etl_dir) / S.ETL_SETTINGS_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def _bag(seqs: Sequences, samples: Samples, vocab_size: int, binary: bool = False) -> tuple[sp.csr_array, np.ndarray]:
    """log(1 + count) (``binary``: 0/1 presence) of each code in each sample's input, and its dense columns:
    the age at the prediction time (``age_features``) and the patient's sex (``sex_features``), (N, 5)."""
    starts = seqs.offsets[samples.rows]
    offsets = np.concatenate([[0], np.cumsum(samples.cuts)])
    positions = ragged_positions(starts, samples.cuts)
    matrix = bag_of_codes(seqs.token_ids[positions], vocab_size, offsets, binary=binary)
    if not binary:
        matrix.data = np.log1p(matrix.data)
    last = starts + samples.cuts - 1
    return matrix, np.hstack([age_features(seqs.ages[last]), sex_features(seqs.sex[last])])


def one_cut_samples(train: Sequences, task: TaskConfig, seed: int) -> Samples:
    """One random eligible prediction time per train patient (seeded): the samples of the classic
    one-cut-per-patient logistic regression, whatever the task's own sampling."""
    return build_samples(train, dataclasses.replace(task, sampling="random_visit", seed=seed))


def _presence(seqs: Sequences, samples: Samples, vocab_size: int) -> tuple[sp.csr_array, np.ndarray]:
    """Whether each code is in each sample's input (0/1), and its dense columns: age (``age_features``), sex
    (``sex_features``) and log(1 + visits so far), (N, 6)."""
    matrix, dense = _bag(seqs, samples, vocab_size, binary=True)
    last = seqs.offsets[samples.rows] + samples.cuts - 1
    visits = np.log1p(seqs.visit_index[last].astype(float) + 1.0)[:, None]
    return matrix, np.hstack([dense, visits])


def _trained_on(model_dir: str) -> str:
    """`` (--data DIR)``: the ETL output a fine-tuning run read, from its resolved config; '' if unknown."""
    saved = Path(model_dir) / S.RESOLVED_CONFIG_FILE
    data = config_lib.load_yaml(saved).get("data") if saved.exists() else None
    return f" (--data {data})" if data else ""


def _pretrain_metrics(bundle: dict[str, Any]) -> dict[str, Any] | None:
    pretrained = bundle.get("pretrained")
    path = Path(pretrained) / S.METRICS_FILE if pretrained else None
    return json.loads(path.read_text()) if path is not None and path.exists() else None


def _run_info(config: Config, bundle: dict[str, Any], task: TaskConfig, choices: dict[str, Any]) -> dict[str, Any]:
    mc = bundle["model_config"]
    return {
        "model directory": config.model,
        "data directory": config.data,
        "task": f"{task.name} ({task.sampling}, labels seen in >= {task.min_label_count} train samples)",
        "encoder": f"{mc.num_layers} layers, hidden {mc.hidden_size}, {mc.num_heads} heads, "
        f"positions {mc.position_encoding}/{mc.position_source}",
        "pre-trained": bundle.get("pretrained") or "no (trained from scratch)",
        "label codes": len(bundle["labels"]),
        "logistic regression": f"bag-of-codes log-counts + age, sex (C={choices[LOGISTIC]['c']:g}, "
        f"{choices[LOGISTIC]['chosen_on']})",
        "gradient boosting": "time features per label code (ever, visits with it, visits and days since, "
        "years since first, in the last visit) + every code ever + age, visits, days since the previous visit "
        f"({choices[GBM]['setting']} regularisation, {choices[GBM]['chosen_on']})"
        if GBM in choices
        else "off",
        "sparse time regression": _sparse_time_info(choices[SPARSE_TIME]) if SPARSE_TIME in choices else "off",
        **({"fine-tuning": _finetune_info(trained)} if (trained := _finetune_metrics(config.model)) else {}),
    }


def _finetune_metrics(model_dir: str) -> dict[str, Any] | None:
    """The fine-tuning run's ``metrics.json`` in ``model_dir``, or None (a bundle copied without it)."""
    path = Path(model_dir) / S.METRICS_FILE
    return json.loads(path.read_text()) if path.exists() else None


def _finetune_info(metrics: dict[str, Any]) -> str:
    """The report's run-info line on how the model was fine-tuned: epochs (and the checkpoint soup when it was
    kept), the path's share and the distillation weight kept, with why (``finetune``'s ``metrics.json``).

    >>> m = {"epochs": 20, "best_epoch": 14, "sparse_time_share": 0.6, "sparse_time_distillation": 0.0,
    ...      "distillation_choice": {"weights_tried": [0.0], "weights_not_tried": [0.8],
    ...      "first_training_against_path": {"deep_macro_ap": 0.25, "path_macro_ap": 0.24, "path_leads": False}}}
    >>> _finetune_info(m).split("; ")
    ['20 epochs (best 14)', 'sparse time path share 0.6', 'distillation weight 0 (no training at 0.8: the deep part \
led its teacher, the sparse time path, on the tuning split, macro AP 0.2500 against 0.2400)']
    >>> m["state_path"] = {"fitted": True, "epochs": 9, "share": 0.0, "distillation_teacher": {"state_path_share": 0.9}}
    >>> _finetune_info(m).split("; ")[2]
    'distillation weight 0 (no training at 0.8: the deep part led its teacher, the sparse time path and the state \
path at share 0.9, on the tuning split, macro AP 0.2500 against 0.2400)'
    >>> m["distillation_choice"]["first_training_against_path"].update(
    ...     deep_clearly_leads=True, deep_minus_path={"difference": 0.01, "low": 0.004, "high": 0.016})
    >>> _finetune_info(m).split("; ")[2]
    'distillation weight 0 (no training at 0.8: the deep part led its teacher, the sparse time path and the state \
path at share 0.9, on the tuning split, macro AP 0.2500 against 0.2400, difference +0.0040 to +0.0160)'
    >>> m["distillation_choice"]["first_training_against_path"]["deep_clearly_leads"] = False
    >>> _finetune_info(m).split("; ")[2]
    'distillation weight 0 (no training at 0.8: the time budget had no room for it)'
    >>> _finetune_info({"epochs": 3, "sparse_time_share": 0.5, "sparse_time_distillation": 0.5, "tuning_samples": 9})
    '3 epochs; sparse time path share 0.5; distillation weight 0.5 (set)'
    >>> _finetune_info({"epochs": 3, "sparse_time_distillation": 0.0})  # no path: nothing to distil
    '3 epochs'
    >>> _finetune_info({"epochs": 20, "best_epoch": 10, "checkpoint_soup": {"epochs": [10, 15, 14], "kept": True}})
    '20 epochs (weights averaged over epochs 10, 15, 14)'
    >>> _finetune_info({"epochs": 4, "state_path": {"fitted": True, "epochs": 9, "share": 0.35}})
    '4 epochs; state path share 0.35 (fitted 9 epochs)'
    >>> _finetune_info({"epochs": 4, "state_path": {"fitted": True, "sets_fitted": 2, "epochs": 40, "share": 0.5}})
    '4 epochs; state path share 0.5 (2 sets of chains fitted, 40 epochs)'
    >>> _finetune_info({"epochs": 4, "state_path": {"fitted": False, "stopped_by": "the time budget", "share": 0.0}})
    '4 epochs; state path not fitted (the time budget)'
    """
    soup = metrics.get("checkpoint_soup") or {}
    kept = f" (weights averaged over epochs {', '.join(map(str, soup['epochs']))})" if soup.get("kept") else ""
    best = f" (best {metrics['best_epoch']})" if metrics.get("best_epoch") and not kept else ""
    parts = [f"{metrics.get('epochs')} epochs{kept or best}"]
    if "sparse_time_share" in metrics:
        parts.append(f"sparse time path share {metrics['sparse_time_share']:g}")
    if "sparse_time_share" in metrics and "sparse_time_distillation" in metrics:  # only a model with the path
        parts.append(f"distillation weight {metrics['sparse_time_distillation']:g}" + _why_weight(metrics))
    states = metrics.get("state_path")
    if states:
        parts.append(f"state path {_state_path_info(states)}")
    return "; ".join(parts)


def _state_path_info(states: dict) -> str:
    """What ``metrics.json`` ``state_path`` says of the fit, in a few words."""
    if not states["fitted"]:
        return f"not fitted ({states.get('stopped_by') or states.get('reason', '')})"
    sets = states.get("sets_fitted", 1)
    fitted = f"{sets} sets of chains fitted, " if sets > 1 else "fitted "
    return f"share {states['share']:g} ({fitted}{states['epochs']} epochs)"


def _why_weight(metrics: dict[str, Any]) -> str:
    """Why the distillation weight was kept, from ``distillation_choice`` (absent: set, or no tuning split)."""
    choice = metrics.get("distillation_choice")
    if not choice:
        return " (set)" if metrics.get("tuning_samples") else " (no tuning split to choose on)"
    teacher = "the sparse time path"
    share = ((metrics.get("state_path") or {}).get("distillation_teacher") or {}).get("state_path_share")
    if share:
        teacher += f" and the state path at share {share:g}"
    if len(choice["weights_tried"]) > 1:
        return (
            f" (kept of {', '.join(f'{w:g}' for w in choice['weights_tried'])} by the tuning split; teacher {teacher})"
        )
    untried = ", ".join(f"{w:g}" for w in choice["weights_not_tried"])
    lead = choice.get("first_training_against_path")
    if lead and lead.get("deep_clearly_leads", not lead["path_leads"]):  # metrics before session 57: the points
        interval = lead.get("deep_minus_path")
        spread = f", difference {interval['low']:+.4f} to {interval['high']:+.4f}" if interval else ""
        return (
            f" (no training at {untried}: the deep part led its teacher, {teacher}, on the tuning split, macro AP "
            f"{lead['deep_macro_ap']:.4f} against {lead['path_macro_ap']:.4f}{spread})"
        )
    return f" (no training at {untried}: the time budget had no room for it)"


def _log_headline(
    model_eval: dict[str, Any], references: dict[str, Any], ceilings: dict[str, dict[str, Any]], report: Path
) -> None:
    def line(name: str, overall: dict[str, Any]) -> str:
        return f"{name} macro AP {overall['macro_ap']:.4f}, micro AP {overall['micro_ap']:.4f}, " + (
            f"macro AUROC {overall['macro_auroc']:.4f}"
        )

    log.info("evaluate: %s", line("model", model_eval["overall"]))
    for name, evaluation in references.items():
        log.info("evaluate: %s", line(name, evaluation["overall"]))
    for key, ceiling in ceilings.items():
        oracle = "record oracle" if key == "ceiling_record" else "oracle"
        for name, entry in ceiling["predictors"].items():
            log.info(
                "evaluate: at oracle cuts, %s; gap closed to the %s %s (from the every-visit / one-cut logistic "
                "regression)",
                line(name, entry["overall"]),
                oracle,
                both_shares(entry),
            )
    log.info("evaluate: report at %s", report)
