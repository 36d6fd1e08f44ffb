"""``behrt-rope evaluate``: held-out metrics and report, beside a bag-of-codes logistic regression."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import scipy.sparse as sp

from behrt_rope import config as config_lib
from behrt_rope import schema as S
from behrt_rope.data.labels import Samples, TaskConfig, build_samples, history, label_index, targets
from behrt_rope.data.sequences import Sequences, load_tokens, load_vocabulary, ragged_positions
from behrt_rope.errors import UserError
from behrt_rope.evaluation.baseline import age_features, bag_of_codes, fit_predict_baseline
from behrt_rope.evaluation.evaluate import evaluate_scores, write_evaluation_report
from behrt_rope.stage import is_done, require_done, stage, write_json
from behrt_rope.training.bundle import load_bundle
from behrt_rope.training.inference import multilabel_model, resolve_device, score

log = logging.getLogger("behrt_rope.evaluate")
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
    baseline_c: float = 1.0
    """Inverse L2 strength of the logistic-regression baseline."""
    baseline_max_train_samples: int = 50_000
    """Fit the baseline on at most this many train samples (a seeded subsample), to bound its time."""
    notes: str = ""
    """A caveat shown in the report (e.g. 'Synthetic data: ...')."""
    progress: bool = True


def run(config: Config) -> Path:
    """Evaluate on the held-out split; returns the output directory."""
    if not (config.model and config.data and config.out):
        raise UserError("evaluate needs --model FINETUNE_DIR, --data ETL_DIR and --out DIR")
    out_dir = Path(config.out)
    require_done(config.data, "etl")
    if not config.overwrite and is_done(out_dir, config):
        log.info("evaluate: %s already holds this run; skipping (overwrite=true to redo)", out_dir)
        return out_dir
    bundle = load_bundle(config.model, "multilabel")
    seqs, vocab = load_tokens(config.data), load_vocabulary(config.data)
    if vocab["token"].tolist() != bundle["vocab"]:
        raise UserError(f"{config.model} was trained on a different vocabulary than {config.data}")
    task = config_lib.build(TaskConfig, bundle["task"])
    label_of_token = label_index(np.asarray(bundle["label_token_ids"], dtype=np.int64), len(vocab))
    held = seqs.split(S.HELD_OUT)
    samples = build_samples(held, task)
    if len(samples) == 0:
        raise UserError(f"{config.data}: the held_out split has no {task.name} samples to evaluate")
    y, seen = targets(held, samples, label_of_token), history(held, samples, label_of_token)
    with stage(out_dir, config, "evaluate") as out:
        log.info(
            "evaluate: %d held-out samples from %d patients, %d labels",
            len(samples),
            len(np.unique(samples.rows)),
            y.shape[1],
        )
        probs = score(
            multilabel_model(bundle),
            held,
            samples.rows,
            samples.cuts,
            config.batch_size,
            resolve_device(config.device),
            config.progress,
        )
        base = _baseline(seqs, held, samples, task, label_of_token, config)
        labels = bundle["labels"]
        model_eval = evaluate_scores(y, probs, seen, labels, config.n_bootstrap, config.seed)
        base_eval = evaluate_scores(y, base, seen, labels, config.n_bootstrap, config.seed)
        pretrain = _pretrain_metrics(bundle)
        write_json(
            out / S.METRICS_FILE,
            {
                "task": task.name,
                "held_out_patients": len(np.unique(samples.rows)),
                "model": model_eval,
                "baseline": base_eval,
                "pretrain": pretrain,
            },
        )
        report = write_evaluation_report(
            out,
            "BEHRT-RoPE",
            TASK_TITLES[task.name],
            model_eval,
            base_eval,
            n_patients=len(np.unique(samples.rows)),
            pretrain_metrics=pretrain,
            run_info=_run_info(config, bundle, task),
            notes=[config.notes] if config.notes else (),
        )
        _log_headline(model_eval, base_eval, report)
    return out_dir


def _baseline(
    seqs: Sequences,
    held: Sequences,
    samples: Samples,
    task: TaskConfig,
    label_of_token: np.ndarray,
    config: Config,
) -> np.ndarray:
    """Bag-of-codes logistic regression fitted on the train split's samples of the same task."""
    train = seqs.split(S.TRAIN)
    train_samples = build_samples(train, task)
    if len(train_samples) > config.baseline_max_train_samples:
        keep = np.sort(
            np.random.default_rng(config.seed).choice(
                len(train_samples), config.baseline_max_train_samples, replace=False
            )
        )
        train_samples = Samples(
            train_samples.rows[keep],
            train_samples.cuts[keep],
            train_samples.label_spans[keep],
            train_samples.times[keep],
        )
    log.info("evaluate: fitting the logistic-regression baseline on %d train samples", len(train_samples))
    vocab_size = len(label_of_token)
    x_train, age_train = _bag(train, train_samples, vocab_size)
    x_eval, age_eval = _bag(held, samples, vocab_size)
    return fit_predict_baseline(
        x_train,
        targets(train, train_samples, label_of_token),
        x_eval,
        C=config.baseline_c,
        seed=config.seed,
        extra_train=age_features(age_train),
        extra_eval=age_features(age_eval),
    )


def _bag(seqs: Sequences, samples: Samples, vocab_size: int) -> tuple[sp.csr_matrix, np.ndarray]:
    """log(1 + count) of each code in each sample's input, and the age at the prediction time."""
    starts = seqs.offsets[samples.rows]
    offsets = np.concatenate([[0], np.cumsum(samples.cuts)])
    positions = ragged_positions(starts, samples.cuts)
    matrix = bag_of_codes(seqs.token_ids[positions], vocab_size, offsets, binary=False)
    matrix.data = np.log1p(matrix.data)
    return matrix, seqs.ages[starts + samples.cuts - 1]


def _pretrain_metrics(bundle: dict[str, Any]) -> dict[str, Any] | None:
    pretrained = bundle.get("pretrained")
    path = Path(pretrained) / S.METRICS_FILE if pretrained else None
    return json.loads(path.read_text()) if path is not None and path.exists() else None


def _run_info(config: Config, bundle: dict[str, Any], task: TaskConfig) -> dict[str, Any]:
    mc = bundle["model_config"]
    return {
        "model directory": config.model,
        "data directory": config.data,
        "task": f"{task.name} ({task.sampling}, labels seen in >= {task.min_label_count} train samples)",
        "encoder": f"{mc.num_layers} layers, hidden {mc.hidden_size}, {mc.num_heads} heads, "
        f"positions {mc.position_encoding}/{mc.position_source}",
        "pre-trained": bundle.get("pretrained") or "no (trained from scratch)",
        "label codes": len(bundle["labels"]),
        "baseline": f"bag-of-codes log-counts + age, logistic regression (C={config.baseline_c})",
    }


def _log_headline(model_eval: dict[str, Any], base_eval: dict[str, Any], report: Path) -> None:
    m, b = model_eval["overall"], base_eval["overall"]
    log.info(
        "evaluate: macro AP %.4f (baseline %.4f), micro AP %.4f (%.4f), macro AUROC %.4f (%.4f)",
        m["macro_ap"],
        b["macro_ap"],
        m["micro_ap"],
        b["micro_ap"],
        m["macro_auroc"],
        b["macro_auroc"],
    )
    log.info("evaluate: report at %s", report)
