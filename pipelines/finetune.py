"""``behrt-rope finetune``: multi-label diagnosis prediction, from a pre-trained encoder or from scratch."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytorch_lightning as pl
import torch
from scipy.special import expit

from behrt_rope import config as config_lib
from behrt_rope import schema as S
from behrt_rope.data.datasets import labelled_dataset
from behrt_rope.data.labels import (
    Samples,
    TaskConfig,
    build_samples,
    fit_label_vocabulary,
    label_counts,
    label_index,
    resolve_min_label_count,
    subsample_index,
    targets,
)
from behrt_rope.data.sequences import Sequences, load_tokens, load_vocabulary
from behrt_rope.errors import UserError
from behrt_rope.evaluation.sparse_time import DEFAULT_BINS, DEFAULT_C, SELECT_C, Bins
from behrt_rope.model.config import HEAD_FIELDS, ModelConfig
from behrt_rope.model.heads import BehrtForMultiLabel, load_encoder_weights, pos_weight_from_counts
from behrt_rope.stage import is_done, require_done, stage, write_json
from behrt_rope.training.bundle import load_bundle, save_bundle, task_state_dict
from behrt_rope.training.chain_pairs import PAIR_CORRELATION
from behrt_rope.training.chains_time import ChainsTime, chains_time
from behrt_rope.training.checkpoints import load_task_weights
from behrt_rope.training.choice_cost import choice_seconds
from behrt_rope.training.clear_gain import CHOICE_LEVEL
from behrt_rope.training.config import TrainerConfig
from behrt_rope.training.distillation_choice import (
    PathLead,
    WeightChoice,
    candidate_weights,
    chains_seconds,
    choose_weight,
    path_leads,
    preferred_weight,
    room_for_another,
)
from behrt_rope.training.loaders import SplitData, make_loader, padding_report
from behrt_rope.training.soup import TopChecksSoup
from behrt_rope.training.sparse_time_fit import EQUAL_SHARE as SPARSE_EQUAL_SHARE
from behrt_rope.training.sparse_time_fit import SHARE_GRID as SPARSE_SHARE_GRID
from behrt_rope.training.sparse_time_fit import fit_path, set_path_share
from behrt_rope.training.state_path_fit import (
    CROSS_EVIDENCE_L1,
    RECORD_WEIGHT,
    fit_state_path,
    set_state_path_share,
)
from behrt_rope.training.state_path_fit import MAX_EPOCHS as STATE_PATH_EPOCHS
from behrt_rope.training.state_path_fit import SHARE_GRID as STATE_SHARE_GRID
from behrt_rope.training.state_path_prefit import PREFIT_EPOCHS
from behrt_rope.training.tasks import MultiLabelTask, macro_average_precision
from behrt_rope.training.teacher import Teacher, choose_teacher
from behrt_rope.training.trainer import budget_left, build_trainer, resume_path, time_budget, uses_gpu
from behrt_rope.training.tuning_logits import TuningLogits

log = logging.getLogger("behrt_rope.finetune")
AFTER_TRAINING_VALIDATIONS = 6.0
"""Validation epochs' worth of time the trainings and the chains leave in the budget for the work after them:
one scoring pass over the tuning split and the bootstrapped choices on it. Measured with 3 on 2 CPU cores: long
histories (13,000 tuning samples, 92 labels) a validation epoch of 8.6 s and that work 31 s, the stage at 718 s of
its 720; the demo's cohort a validation epoch of 1.9 s and that work 12 s, the stage at 722 s. 6 covers both
(docs/benchmarks.md, "Fiftieth round"). The bootstrapped choices' own cost is now measured before training and held
back besides (``training/choice_cost.py``): on a host 30% slower a validation-epoch reserve alone left a clinical
fine-tuning 24 s past its budget (the choices took 22 s, the reserve 12.6 s; "Seventy-fourth round")."""
MONITORS = {"loss": ("val/loss", "min"), "macro_ap": ("val/macro_ap", "max")}
"""``select_by`` -> (logged metric, better direction)."""
RUN_FIELDS = (*HEAD_FIELDS, "dropout", "attention_dropout")
"""``model.*`` settings taken from the fine-tuning run even when the encoder comes pre-trained."""


@dataclass
class Config:
    data: str = ""
    """ETL output directory."""
    out: str = ""
    """Output directory (checkpoints, logs, model.safetensors + model.json, metrics.json)."""
    pretrained: str = ""
    """A `behrt-rope pretrain` output directory to start from; empty: train from scratch."""
    resume: str = ""
    """Checkpoint to resume from: a path, or 'last' for OUT/checkpoints/last.ckpt."""
    overwrite: bool = False
    """Redo the work even if OUT already holds a finished run of the same configuration."""
    pooling: Literal["visit", "cls", "mean"] = "visit"
    """visit: one visit-causal pass per patient scores every prediction time at its visit's [SEP] (fast);
    cls / mean: one bidirectional pass per sample over its input, pooled at [CLS] or averaged (BEHRT)."""
    pos_weight: bool = False
    """Weight each label's positive term by negatives/positives in train (for rare codes)."""
    pos_weight_max: float = 50.0
    """Cap on the positive-class weights."""
    sparse_time_c: float | None = DEFAULT_C
    """With model.sparse_time, the inverse L1 strength of the sparse time path's regression (its refit, after
    ``sparse_time_select_c`` chose the codes each label reads). null: the one of
    ``evaluation.sparse_time.C_GRID`` with the best macro AP of the path alone on the tuning split, scored on
    up to 60 of its label codes before the deep training; ``metrics.json`` ``sparse_time_c`` records it either
    way. Not the default: on four held-out cohorts a choice of one-fit strengths raised the path's own macro AP
    but moved the model's by -0.006 to +0.004 at the oracle's cuts (docs/benchmarks.md, "Twenty-ninth round")."""
    sparse_time_select_c: float | None = SELECT_C
    """With model.sparse_time, the inverse L1 strength of the first fit of each label's regression, which only
    chooses the other codes whose timing the label reads (a relaxed lasso; ``evaluation/sparse_time.py``).
    null: one L1 fit at ``sparse_time_c`` on every column (the default until session 33, at 0.1)."""
    sparse_time_bins: Bins = DEFAULT_BINS
    """With model.sparse_time, how its regression reads the ordered time bins: ``cumulative`` (a weight per step
    from one bin to the next, so the L1 penalty falls on the steps) or ``indicator`` (a weight per bin, the
    default until session 34). The model keeps a weight per bin either way (``evaluation/sparse_time.py``)."""
    sparse_time_share: float | None = None
    """With model.sparse_time, the path's weight in the model's logit (the deep part has 1 minus it); null:
    0.5 unless another of ``training.sparse_time_fit.SHARE_GRID`` has a clearly better tuning macro AP after
    training (its paired 90% interval over the tuning patients above 0; until session 60 the best point
    estimate), 0.5 without a tuning split."""
    sparse_time_distillation: float | None = None
    """With model.sparse_time, the weight of the path's probabilities as soft targets in the deep part's loss:
    ``(1 - w) x BCE(labels) + w x BCE(path's probabilities)`` (knowledge distillation). The deep part still
    reads only the tokens and their times; the frozen path only shapes what it is trained towards. 0: labels
    alone. null: trained at 0, then at 0.8 unless that first deep part clearly leads its teacher on the tuning
    split (the path alone, or with ``state_path_teacher`` the path and the state path's chains; the paired
    interval of macro AP above 0) and when the time budget has room for a second training (at least
    the first one's time left), keeping the weight of the learner that led in that first comparison (0.8 where
    the teacher scored better, 0 where the deep part did, though not clearly) unless the other weight's deep part
    scores a clearly better tuning macro AP (a paired bootstrap over the tuning patients;
    ``training.distillation_choice``; ``metrics.json`` ``distillation_choice``); further runs go to
    OUT/distillation_W."""
    sparse_time_max_samples: int = 50_000
    """With model.sparse_time, fit the path on at most this many train samples (a seeded subsample), to bound
    its time and memory (its features take 24 bytes per sample and label); the deep part trains on all of
    them. Evaluate's references use the same cap. 50,000 against every sample (up to 135,000): level tuning
    macro AP of the model, a 5-13x shorter fit (docs/benchmarks.md, "Seventeenth round")."""
    state_path_l1: float = CROSS_EVIDENCE_L1
    """With model.state_path, the L1 strength on the evidence each code gives the chains of labels it is not
    the code of (``model.state_path.StatePath.cross_evidence_l1``): 0 lets every code move every label's chain
    freely."""
    state_path_share: float | None = None
    """With model.state_path, its weight in the model's logit; null: 0 unless a share of
    ``training.state_path_fit.SHARE_GRID`` is clearly better on the tuning split (the lower end of its paired
    90% bootstrap interval over the tuning patients above 0; the largest such gain), ``training.clear_gain``."""
    state_path_teacher: bool = True
    """With model.state_path and the sparse time path: the chains are fitted right after the first training of
    the deep part and join the distillation teacher of any further one, ``(1 - t) x sparse time path + t x state
    path`` in logits, ``t`` 0 unless a share is clearly better on the tuning split (``training.teacher``;
    ``metrics.json`` ``distillation_teacher``). False: the sparse time path alone teaches. Either way the
    chains' own share of the model's logit is set once the deep part is final."""
    state_path_max_epochs: int = STATE_PATH_EPOCHS
    """With model.state_path, its fit's epochs at most (it stops earlier when its tuning macro AP has not
    improved for 4 epochs, or when the next epoch would overrun ``trainer.max_minutes``)."""
    state_path_time_share: float | None = 0.0
    """With model.state_path and a time budget (``trainer.max_minutes``), the share of the budget the first
    training of the deep part leaves to the chains fitted after it: the first training's schedule ends early
    enough for it (``training.time_budget``). 0 (the default): the first training takes what it can, the chains
    what is left. Null: the data decide (``training.chains_time``): the chains' first set is started from its
    codes' record and fitted one epoch before the first training and, where it then scores at least the sparse
    time path alone on the tuning split, the chains get 0.3 of the budget (what that first set took included),
    else nothing is held back (opt-in: chose right on six screening draws of five families, never more than 0.0003
    below the default, docs/benchmarks.md, "Seventy-third round" and "Seventy-fourth round"). A fixed 0.3 gave
    the chains the time they lacked on a 200-code progression cohort (+0.0073 tuning macro AP) but cost a long
    dense clinical one, where the first training is budget-bound and the chains' share stays 0, 0.0013
    (docs/benchmarks.md, "Seventy-second round")."""
    state_path_pair_correlation: float | None = PAIR_CORRELATION
    """With model.state_path, two label codes share one chain when each is the other's most correlated label
    code across the train patients (presence) and the correlation is at least this (``training.chain_pairs``);
    null: each label its own chain."""
    state_path_prefit_epochs: int = PREFIT_EPOCHS
    """With model.state_path, each set of chains first starts from a hidden Markov model of its label codes'
    record, fitted by maximum likelihood for at most this many epochs (``training.state_path_prefit``); 0: from a
    random start. On since session 66."""
    state_path_record_weight: float = RECORD_WEIGHT
    """With model.state_path, the weight in the chains' fit of the negative log-likelihood per visit of their own
    codes' record (read off their own codes' evidence as a hidden Markov model), beside the next-visit loss
    (``training.state_path_fit``); 0 (the default): the next-visit loss alone. A little better on a progression
    screening cohort, worse on recurrence and clinical ones (docs/benchmarks.md, "Sixty-seventh round")."""
    select_by: Literal["loss", "macro_ap"] = "loss"
    """What picks the best tuning check (the checkpoint kept, the checks of the soup, early stopping): the tuning
    split's BCE loss or its macro AP. The loss averages over every sample and label and is the less noisy of the
    two on small tuning splits: chosen on a quarter of a tuning split and scored on the rest, checks picked by
    loss scored higher macro AP than checks picked by macro AP itself (docs/benchmarks.md, "Twenty-third
    round")."""
    checkpoint_soup: int = 3
    """Average the weights of this many best tuning checks (a uniform soup, ``training.soup``) and keep the
    average when it scores at least as well on the tuning split as the best check (by ``select_by``); 1: the
    best check alone. Off with ``trainer.ema_decay`` (the checks are already averages) and without a tuning
    split. The checkpoints carry the kept checks' weights (k copies of the model) so that a resumed run soups
    over all of them."""
    task: TaskConfig = field(default_factory=TaskConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    """Without --pretrained, the whole model; with it, only the head's settings (label_attention_heads,
    label_attention_keys, history_max, label_own_code, age_basis, wide) and the dropout rates: a pre-trained
    encoder brings its own configuration, and a clashing model.* value is an error."""
    trainer: TrainerConfig = field(
        default_factory=lambda: TrainerConfig(
            max_epochs=20, max_minutes=12.0, learning_rate=3e-3, early_stopping_patience=5, early_stopping_ratio=1.0
        )
    )
    """Fine-tuning defaults: up to 20 epochs at a peak learning rate of 3e-3, and the checkpoint with the best
    tuning value (``select_by``). A run stops once it has gone twice as far as its best epoch and at least 5
    epochs past it: on every default run we had the tuning macro AP curve of, that rule kept the same best
    epoch as 20 epochs, and saved about half the time where the curve peaks early (large label spaces, short
    histories); a fixed patience fired on noise on small tuning splits (docs/benchmarks.md "Quality",
    fifteenth round). At most 12 minutes of wall-clock time from the start of the command (``max_minutes``;
    ``training.time_budget``): where fewer epochs fit (a slow host, hundreds of labels), the schedule ends at
    the last one that does, so that pre-training (2.5 minutes at most) and fine-tuning stay within 15
    minutes; ``trainer.max_minutes=0`` lifts it."""


def run(config: Config) -> Path:
    """Fine-tune; returns the output directory."""
    stage_started = time.monotonic()  # the time budget (trainer.max_minutes) counts from here
    if not config.data or not config.out:
        raise UserError("finetune needs --data ETL_DIR and --out DIR")
    _check_path_settings(config)
    out_dir = Path(config.out)
    require_done(config.data, "etl")
    if not config.overwrite and not config.resume and is_done(out_dir, config, inputs=[config.data, config.pretrained]):
        log.info("finetune: %s already holds this run; skipping (overwrite=true to redo)", out_dir)
        return out_dir
    seqs, vocab = load_tokens(config.data), load_vocabulary(config.data)
    tokens = vocab["token"].tolist()
    model_config, pretrained_state = _encoder_start(config, tokens)
    tc = config.trainer
    train_seqs = seqs.split(S.TRAIN)
    train_samples = build_samples(train_seqs, config.task)
    min_count = resolve_min_label_count(config.task, len(train_samples))
    label_ids = fit_label_vocabulary(train_seqs, train_samples, min_count)
    if len(label_ids) == 0:
        raise UserError(_no_labels_message(config, seqs, train_seqs, train_samples, min_count))
    task_config = dataclasses.replace(config.task, min_label_count=min_count)
    label_of_token = label_index(label_ids, len(vocab))
    train = _split_data(train_seqs, config.task, label_of_token, config.pooling, train_samples)
    tuning = _split_data(seqs.split(S.TUNING), config.task, label_of_token, config.pooling)
    log.info(
        "finetune: task %s, %d train / %d tuning samples; %d labels (codes in >= %d train samples' labels%s): %s",
        config.task.name,
        len(train.y),
        len(tuning.y),
        len(label_ids),
        min_count,
        ", adapted to the data" if config.task.min_label_count is None else "",
        ", ".join(tokens[i] for i in label_ids[:10]) + (" ..." if len(label_ids) > 10 else ""),
    )
    with stage(out_dir, config, "finetune", inputs=[config.data, config.pretrained]) as out:
        pl.seed_everything(tc.seed, workers=True, verbose=False)
        pos_weight, path_report = None, {}
        if config.pos_weight:
            pos_weight = pos_weight_from_counts(
                torch.from_numpy(train.y.sum(0)), len(train.y), config.pos_weight_max
            ).tolist()

        def new_task(distillation: float) -> MultiLabelTask:
            return MultiLabelTask(
                model_config, tc, len(label_ids), config.pooling, pos_weight, label_ids.tolist(), distillation
            )

        task = new_task(0.0)
        if pretrained_state is not None:
            load_encoder_weights(task.model, pretrained_state)
        if task.model.sparse_time is not None:
            keep = subsample_index(len(train.y), config.sparse_time_max_samples, tc.seed)
            fit_samples, y = train_samples.take(keep), train.y[keep]
            path_report = fit_path(
                task.model,
                train_seqs,
                fit_samples,
                label_of_token,
                y,
                config.sparse_time_c,
                tc.progress_bar,
                tuning=(tuning.seqs, tuning.samples, tuning.y),
                seed=tc.seed,
                select_c=config.sparse_time_select_c,
                bins=config.sparse_time_bins,
            )
        has_path = task.model.sparse_time is not None
        weights = candidate_weights(config.sparse_time_distillation, has_path, len(tuning.y) > 0)
        task.path_distillation = weights[0]  # the first run's weight; each further one gets a task of its own
        runs, lead, chains, scores = _train_candidates(
            config, weights, new_task, task, out, train, tuning, stage_started
        )
        chosen, choice_report = _choose_run(runs, weights, scores, lead)
        task, trainer = chosen.task, chosen.trainer
        shares = _set_shares(config, task.model, chosen.distillation, chains, scores, tuning.y)
        tuning_report = {"tuning_macro_ap": float("nan"), "tuning_loss": float("nan")}
        if scores is not None:
            tuning_report = scores.report(task.model, chosen.distillation, task.pos_weight)
        if trainer.is_global_zero:
            metrics = {
                "task": config.task.name,
                "labels": len(label_ids),
                "min_label_count": min_count,
                "label_codes": [tokens[i] for i in label_ids],
                "train_samples": len(train.y),
                "tuning_samples": len(tuning.y),
                **tuning_report,
                **chosen.report,
                "stage_seconds": round(time.monotonic() - stage_started, 1),
                **path_report,
                **choice_report,
                **shares,
                "pretrained": config.pretrained or None,
                **padding_report(train.dataset, tc),
            }
            write_json(out / S.METRICS_FILE, metrics)
            if metrics["epochs"] < tc.max_epochs:
                log.info(
                    "finetune: stopped after epoch %d of %d, best at epoch %s",
                    metrics["epochs"],
                    tc.max_epochs,
                    metrics["best_epoch"],
                )
            save_bundle(
                out,
                "multilabel",
                model_config,
                task_state_dict(task),
                vocab=tokens,
                label_token_ids=label_ids.tolist(),
                labels=[tokens[i] for i in label_ids],
                task=config_lib.to_dict(task_config),
                pooling=config.pooling,
                etl_settings=_etl_settings(config.data),
                pretrained=config.pretrained or None,
            )
            log.info("finetune: tuning macro AP %.4f over %d labels", metrics["tuning_macro_ap"], len(label_ids))
    return out_dir


@dataclass
class DeepRun:
    """One training of the deep part: the task at its kept weights (best check or soup), its trainer and what
    ``metrics.json`` records of it."""

    distillation: float
    task: MultiLabelTask
    trainer: pl.Trainer
    report: dict[str, Any]


def _train_candidates(
    config: Config,
    weights: tuple[float, ...],
    new_task: Callable[[float], MultiLabelTask],
    first: MultiLabelTask,
    out: Path,
    train: SplitData,
    tuning: SplitData,
    stage_started: float,
) -> tuple[list[DeepRun], PathLead | None, dict[str, Any] | None, TuningLogits | None]:
    """Train the deep part once per distillation weight (``training.distillation_choice``): the first in
    ``out`` from ``first`` (encoder and path loaded), each further one in ``out/distillation_W`` from the same
    start and seed, when what is left of the time budget is at least as long as the first run took and the first
    training's deep part does not clearly lead the teacher on the tuning split (the :class:`PathLead`, also
    returned; None with one weight or without room). The state path's chains are fitted right after the first
    training (their report is returned, None without a state path; their share is left at 0) and, with
    ``state_path_teacher``, join the teacher (:mod:`~behrt_rope.training.teacher`). Also returned: the tuning
    split's logits of every part and run (None without tuning samples), scored once for all the choices."""
    start = {k: v.detach().clone() for k, v in first.state_dict().items()}
    time_rule = _chains_time(config, first, train, tuning, stage_started)
    choices = _choice_seconds(config, first.model, weights, tuning)
    runs = [
        _train_deep(config, first, new_task, out, train, tuning, stage_started, config.resume, time_rule.share, choices)
    ]
    chains = _fit_chains(config, runs[0], train, tuning, stage_started, len(weights) > 1, time_rule)
    model, device = runs[0].task.model, runs[0].trainer.strategy.root_device
    fitted = chains is not None and bool(chains.get("fitted"))
    if fitted:  # later runs start from the fitted chains
        start.update({k: v.detach().clone() for k, v in runs[0].task.state_dict().items() if ".state_path." in k})
    scores = TuningLogits.score(model, tuning, device, runs[0].distillation, fitted) if len(tuning.y) else None
    if fitted and chains is not None and scores is not None and scores.states is not None:
        chains["tuning_macro_ap_alone"] = round(macro_average_precision(scores.y, scores.states), 5)
        log.info("finetune: state path's chains alone: tuning macro AP %.4f", chains["tuning_macro_ap_alone"])
    if len(weights) == 1 or scores is None:
        return runs, None, chains, scores
    left = _left_after_reserve(config, stage_started, runs[0])
    if not runs[0].trainer.strategy.broadcast(room_for_another(left, runs[0].report["train_seconds"]), src=0):
        log.info(
            "finetune: no training at sparse_time_distillation=%s: %.1f minutes of the budget left, the first "
            "training took %.1f (trainer.max_minutes)",
            ", ".join(f"{w:g}" for w in weights[1:]),
            (left or 0.0) / 60,
            runs[0].report["train_seconds"] / 60,
        )
        return runs, None, chains, scores
    teacher = choose_teacher(scores, config.state_path_teacher and fitted)
    if chains is not None:
        chains["distillation_teacher"] = teacher.report
    lead = _path_lead(runs[0], scores, teacher)
    if lead.deep_clearly_leads:
        log.info(
            "finetune: no training at sparse_time_distillation=%s: the deep part trained on labels alone scores "
            "tuning macro AP %.4f, its teacher %.4f (difference and interval %s); distilling the clearly weaker "
            "learner into the stronger one does not help",
            ", ".join(f"{w:g}" for w in weights[1:]),
            lead.deep_macro_ap,
            lead.path_macro_ap,
            lead.deep_minus_path,
        )
        return runs, lead, chains, scores
    for weight in weights[1:]:
        if weight != weights[1]:
            left = _left_after_reserve(config, stage_started, runs[0])
            fits = room_for_another(left, runs[0].report["train_seconds"])
            if not runs[0].trainer.strategy.broadcast(fits, src=0):
                break
        pl.seed_everything(config.trainer.seed, workers=True, verbose=False)
        task = new_task(weight)
        task.load_state_dict(start)
        where = out / f"distillation_{weight:g}"
        resume = "last" if config.resume and (where / S.CHECKPOINT_DIR / S.LAST_CHECKPOINT).exists() else ""
        train.dataset.teacher = teacher.logits(model, train, device)  # type: ignore[attr-defined]
        try:
            runs.append(_train_deep(config, task, new_task, where, train, tuning, stage_started, resume))
        finally:
            train.dataset.teacher = None  # type: ignore[attr-defined]
        scores.add_run(runs[-1].task.model, tuning, device, weight)
    return runs, lead, chains, scores


def _fit_chains(
    config: Config,
    run: DeepRun,
    train: SplitData,
    tuning: SplitData,
    stage_started: float,
    second_training: bool = False,
    time_rule: ChainsTime | None = None,
) -> dict[str, Any] | None:
    """Fit the state path's chains of ``run``'s model (share left at 0); their report, None without them. With
    ``second_training`` possible, they leave room for it (``distillation_choice.chains_seconds``); with
    ``time_rule``'s first set started, they go on from it (its report joins theirs)."""
    if run.task.model.state_path is None:
        return None
    left = _left_after_reserve(config, stage_started, run)
    seconds = chains_seconds(left, run.report["train_seconds"], second_training)
    kept = 0.0 if left is None or seconds is None else left - seconds
    if kept > 0:
        log.info(
            "finetune: state path: %.0f s of the %.0f s left; %.0f s kept for a second training (the first: %.0f s)",
            seconds,
            left,
            kept,
            run.report["train_seconds"],
        )
    report = fit_state_path(
        run.task.model,
        train,
        tuning,
        seconds,
        config.state_path_l1,
        config.state_path_share,
        config.state_path_max_epochs,
        config.trainer.seed,
        config.trainer.progress_bar,
        run.trainer.strategy.root_device,
        config.state_path_pair_correlation,
        choose_share=False,
        prefit_epochs=config.state_path_prefit_epochs,
        record_weight=config.state_path_record_weight,
        first_set=None if time_rule is None else time_rule.first_set,
    )
    if time_rule is not None:
        report["time_rule"] = time_rule.report
    if kept > 0:
        report["seconds_kept_for_second_training"] = round(kept, 1)
    return report


def _chains_time(
    config: Config, task: MultiLabelTask, train: SplitData, tuning: SplitData, stage_started: float
) -> ChainsTime:
    """The share of the time budget the first training leaves to ``task``'s chains (``training.chains_time``);
    0 and nothing started when the budget is lifted or the chains cannot be fitted (no tuning samples)."""
    fitted = task.model.state_path is not None and len(tuning.y) and config.state_path_max_epochs > 0
    if config.trainer.max_minutes <= 0 or not fitted:
        return ChainsTime(0.0, None, {"share": 0.0, "chosen_by": "no time budget or no chains to fit"})
    left = budget_left(config.trainer, stage_started) or 0.0
    on_gpu = uses_gpu(config.trainer)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if on_gpu else torch.device("cpu")
    return chains_time(
        task.model,
        train,
        tuning,
        config.state_path_time_share,
        config.state_path_pair_correlation,
        config.state_path_prefit_epochs,
        config.trainer.seed,
        device,
        time.monotonic() + left,
        config.state_path_l1,
        config.state_path_record_weight,
        config.trainer.max_minutes * 60.0,
    )


def _choice_seconds(config: Config, model: BehrtForMultiLabel, weights: tuple[float, ...], tuning: SplitData) -> float:
    """Seconds the choices after training will take on the tuning split (``training.choice_cost``; 0 without a
    budget), for the first training's :class:`~behrt_rope.training.time_budget.TimeBudget` to hold back."""
    if config.trainer.max_minutes <= 0:
        return 0.0
    return choice_seconds(
        tuning.y, tuning.samples.rows, _choice_candidates(config, model, weights), config.trainer.seed
    )


def _choice_candidates(config: Config, model: BehrtForMultiLabel, weights: tuple[float, ...]) -> int:
    """How many candidates the choices after training score with bootstrapped intervals: the sparse time path's
    shares, the state path's and, with several distillation weights, the teacher's mixes, the first training
    against its teacher (two) and the trained runs (at most one per weight)."""
    chains = model.state_path is not None and config.state_path_max_epochs > 0
    n = (
        len({*SPARSE_SHARE_GRID, SPARSE_EQUAL_SHARE})
        if model.sparse_time is not None and config.sparse_time_share is None
        else 0
    )
    n += len(STATE_SHARE_GRID) if chains and config.state_path_share is None else 0
    if len(weights) > 1:
        n += 2 + len(weights) + (len(STATE_SHARE_GRID) if chains and config.state_path_teacher else 0)
    return n


def _left_after_reserve(config: Config, stage_started: float, run: DeepRun) -> float | None:
    """Seconds of the stage's budget left for more training (None: no budget), less what ``run``'s
    :class:`~behrt_rope.training.time_budget.TimeBudget` held back for the choices after training."""
    left = budget_left(config.trainer, stage_started)
    return None if left is None else left - run.report.get("time_budget_reserved_seconds", 0.0)


def _path_lead(run: DeepRun, scores: TuningLogits, teacher: Teacher) -> PathLead:
    """The first training's deep part against the teacher on the tuning split, with the paired interval over its
    patients (rank 0's, so that every DDP rank decides alike)."""
    deep = expit(scores.deep[run.distillation])
    lead = path_leads(scores.y, deep, teacher.tuning_probs, scores.patients)
    return run.trainer.strategy.broadcast(lead, src=0)


def _set_shares(
    config: Config,
    model: BehrtForMultiLabel,
    weight: float,
    chains: dict[str, Any] | None,
    scores: TuningLogits | None,
    y: np.ndarray,
) -> dict[str, Any]:
    """Set the sparse time path's share, then the state path's (``model``'s deep part: the run at ``weight``);
    what ``metrics.json`` records of them (the chains' fit report joins the state path's)."""
    shares: dict[str, Any] = {}
    if model.sparse_time is not None:
        deep, path, patients = (
            (scores.deep[weight], scores.path, scores.patients) if scores is not None else (None, None, None)
        )
        shares = set_path_share(model, config.sparse_time_share, y, deep, path, patients)
    if chains is not None:
        shares["state_path"] = chains
        if chains.get("fitted"):
            assert scores is not None  # chains are fitted only with tuning samples
            base = scores.model_logits(model, weight)  # the state path's share is still 0
            patients = scores.patients
            shares["state_path"].update(
                set_state_path_share(model, config.state_path_share, scores.y, patients, base, scores.states)
            )
    return shares


def _train_deep(
    config: Config,
    task: MultiLabelTask,
    new_task: Callable[[float], MultiLabelTask],
    out: Path,
    train: SplitData,
    tuning: SplitData,
    stage_started: float,
    resume: str,
    held_back_share: float = 0.0,
    choices: float = 0.0,
) -> DeepRun:
    """Train ``task``'s deep part in ``out`` (checkpoints, logs) and keep its best check or their soup;
    ``held_back_share`` of the time budget and ``choices`` seconds are left to the work after it
    (:func:`time_budget`)."""
    tc, weight = config.trainer, task.path_distillation
    train_loader = make_loader(train.dataset, tc, train.collate, True)
    val_loader = make_loader(tuning.dataset, tc, tuning.collate, False) if len(tuning.y) else None
    monitor, mode = MONITORS[config.select_by]
    soup = _soup_callback(config, val_loader is not None, monitor, mode)
    budget = time_budget(tc, stage_started, AFTER_TRAINING_VALIDATIONS, held_back_share, choices)
    trainer = build_trainer(
        tc, out, monitor if val_loader is not None else None, mode, train_loader, [c for c in (soup, budget) if c]
    )
    started = time.perf_counter()
    trainer.fit(task, train_loader, val_loader, ckpt_path=resume_path(resume, out))
    seconds = time.perf_counter() - started
    best = str(getattr(trainer.checkpoint_callback, "best_model_path", "") or "")
    if best:
        task = new_task(weight)
        load_task_weights(task, best)
    soup_report: dict[str, dict] = {}
    if soup is not None and val_loader is not None and len(soup.checks) > 1:
        task, soup_report = _try_soup(soup, lambda: new_task(weight), trainer, val_loader)
    report = {
        "epochs": trainer.current_epoch,
        "best_epoch": getattr(trainer.early_stopping_callback, "best_check", None),
        "steps": trainer.global_step,
        "train_seconds": round(seconds, 1),
        **(budget.report() if budget else {}),
        "best_checkpoint": best,
        **soup_report,
    }
    return DeepRun(weight, task, trainer, report)


def _choose_run(
    runs: list[DeepRun], weights: tuple[float, ...], scores: TuningLogits | None, lead: PathLead | None
) -> tuple[DeepRun, dict]:
    """The run kept by :func:`~behrt_rope.training.distillation_choice.choose_weight` from the deep parts'
    tuning scores, and what ``metrics.json`` records of the choice (nothing to choose with one weight set)."""
    if len(weights) == 1 or scores is None:
        return runs[0], {"sparse_time_distillation": runs[0].distillation}
    if len(runs) == 1 and lead is not None:  # one training: nothing to compare, its score is the path check's
        choice = WeightChoice(
            runs[0].distillation, {runs[0].distillation: lead.deep_macro_ap}, {}, preferred_weight(lead)
        )
    else:
        probs = {run.distillation: expit(scores.deep[run.distillation]) for run in runs}
        choice = choose_weight(scores.y, probs, scores.patients, preferred=preferred_weight(lead))
    tried = [run.distillation for run in runs]
    chosen = runs[tried.index(choice.weight)]
    log.info(
        "finetune: sparse time distillation weights %s, macro AP of the deep part alone on the tuning split %s%s: "
        "keeping %g",
        tried,
        list(choice.macro_ap.values()),
        "".join(
            f"; {w:g} minus {choice.preferred:g}: {d:+.4f} ({lo:+.4f} to {hi:+.4f})"
            for w, (d, lo, hi) in choice.over_preferred.items()
        ),
        chosen.distillation,
    )
    report = {
        "sparse_time_distillation": chosen.distillation,
        "distillation_choice": {
            "weights_tried": tried,
            "weights_not_tried": list(weights[len(runs) :]),
            "first_training_against_path": lead.report() if lead is not None else None,
            "tuning_deep_macro_ap": {f"{w:g}": ap for w, ap in choice.macro_ap.items()},
            "preferred_weight": choice.preferred,
            "tuning_deep_macro_ap_minus_preferred": {
                f"{w:g}": {"difference": d, "low": lo, "high": hi, "level": CHOICE_LEVEL}
                for w, (d, lo, hi) in choice.over_preferred.items()
            },
            "runs": {f"{run.distillation:g}": run.report for run in runs},
        },
    }
    return chosen, report


def _check_path_settings(config: Config) -> None:
    """Stop before any training on a path setting that could only fail once the deep part is trained."""
    for name in ("sparse_time_share", "state_path_share"):
        value = getattr(config, name)
        if value is not None and not 0.0 <= value <= 1.0:
            raise UserError(f"{name} must lie in [0, 1] (or be null: chosen on the tuning split), got {value}")
    if config.state_path_l1 < 0:
        raise UserError(f"state_path_l1 must be >= 0 (0: no penalty), got {config.state_path_l1}")
    if config.state_path_prefit_epochs < 0:
        raise UserError(
            f"state_path_prefit_epochs must be >= 0 (0: a random start), got {config.state_path_prefit_epochs}"
        )
    if config.state_path_record_weight < 0:
        weight = config.state_path_record_weight
        raise UserError(f"state_path_record_weight must be >= 0 (0: the next-visit loss alone), got {weight}")
    share = config.state_path_time_share
    if share is not None and not 0.0 <= share < 1.0:
        raise UserError(
            f"state_path_time_share must lie in [0, 1) (0: nothing held back for the chains; null: the chains' first "
            f"set decides), got {share}"
        )
    if config.state_path_max_epochs < 0:
        raise UserError(f"state_path_max_epochs must be >= 0 (0: not fitted), got {config.state_path_max_epochs}")
    pairing = config.state_path_pair_correlation
    if pairing is not None and not 0.0 <= pairing <= 1.0:
        raise UserError(f"state_path_pair_correlation must lie in [0, 1] (or be null: no shared chains), got {pairing}")


def _soup_callback(config: Config, has_tuning: bool, monitor: str, mode: str) -> TopChecksSoup | None:
    """The callback that keeps the best checks' weights, or None when no soup is made."""
    if config.checkpoint_soup < 1:
        raise UserError(f"checkpoint_soup must be >= 1 (1: the best check alone), got {config.checkpoint_soup}")
    if config.checkpoint_soup == 1 or not has_tuning:
        return None
    if config.trainer.ema_decay > 0:
        log.info("finetune: no checkpoint soup with trainer.ema_decay (each check is already an average)")
        return None
    return TopChecksSoup(config.checkpoint_soup, monitor=monitor, mode=mode)


def _try_soup(
    soup: TopChecksSoup,
    new_task: Callable[[], MultiLabelTask],
    trainer: pl.Trainer,
    val_loader: torch.utils.data.DataLoader,
) -> tuple[MultiLabelTask, dict]:
    """Validate the soup of the kept checks; returns it when it scores at least as well as the best check by
    the soup's monitor (else the best check, rebuilt from its kept weights), and a ``checkpoint_soup`` report."""
    candidate = new_task()
    candidate.load_state_dict(soup.soup())
    score = float(trainer.validate(candidate, val_loader, verbose=False)[0][soup.monitor])
    best_score = soup.checks[0][0]
    kept = soup.no_worse_than_best(score)
    epochs = [epoch + 1 for epoch in soup.epochs]
    log.info(
        "finetune: soup of epochs %s: tuning %s %.4f against %.4f for the best epoch alone; %s",
        epochs,
        soup.monitor,
        score,
        best_score,
        "kept" if kept else "not kept",
    )
    if not kept:
        candidate = new_task()
        candidate.load_state_dict(soup.checks[0][2])
    report = {"epochs": epochs, "monitor": soup.monitor, "soup": round(score, 5), "best_epoch": round(best_score, 5)}
    return candidate, {"checkpoint_soup": {**report, "kept": kept}}


def _no_labels_message(config: Config, seqs: Sequences, train_seqs: Sequences, samples: Samples, min_count: int) -> str:
    """Why there is no label code, in the data's own numbers: patients, samples and label occurrences."""
    where = f"finetune: {config.data} has {len(seqs)} patients ({len(train_seqs)} in train)"
    task = config.task.name
    if len(samples) == 0:
        need = "a later visit" if task == "next_visit" else f"follow-up of {task} after a visit"
        return (
            f"{where} and no {task} train sample: a sample needs {config.task.min_history_visits}+ visits "
            f"and {need}; use more data (or another --task)"
        )
    counts = label_counts(train_seqs, samples)
    most = int(counts.max()) if len(counts) else 0
    return (
        f"{where}, {len(samples)} {task} train samples, and no code occurs in {min_count}+ samples' labels "
        f"(the most frequent occurs in {most}); use more data or set task.min_label_count={max(most, 1)}"
    )


def _split_data(
    seqs: Sequences, task: TaskConfig, label_of_token: np.ndarray, pooling: str, samples: Samples | None = None
) -> SplitData:
    samples = build_samples(seqs, task) if samples is None else samples
    dataset, collate = labelled_dataset(seqs, samples.rows, samples.cuts, samples.label_spans, label_of_token, pooling)
    return SplitData(seqs, samples, dataset, collate, targets(seqs, samples, label_of_token))


def _encoder_start(config: Config, tokens: list[str]) -> tuple[ModelConfig, dict | None]:
    """Model configuration and encoder weights: from the pre-trained bundle, or fresh.

    With a bundle, the head's settings (which pre-training does not use) and the dropout rates (which do not
    change any weight) come from this run's ``model.*``; any other ``model.*`` set to a value that differs
    from the bundle's is an error rather than silently ignored.
    """
    if not config.pretrained:
        return dataclasses.replace(config.model, vocab_size=len(tokens)), None
    bundle = load_bundle(config.pretrained, "mlm")
    if bundle["vocab"] != tokens:
        raise UserError(
            f"{config.pretrained} was pre-trained on a different vocabulary than {config.data}; "
            "pre-train and fine-tune on the same ETL output"
        )
    encoder: ModelConfig = bundle["model_config"]
    defaults = ModelConfig()
    for f in dataclasses.fields(ModelConfig):
        mine, theirs = getattr(config.model, f.name), getattr(encoder, f.name)
        if f.name in RUN_FIELDS or f.name == "vocab_size" or mine in (theirs, getattr(defaults, f.name)):
            continue
        raise UserError(
            f"model.{f.name}={mine} differs from the pre-trained encoder's {f.name}={theirs} "
            f"({config.pretrained}): the encoder's settings come with --pretrained; drop model.{f.name} "
            "or pre-train with it"
        )
    run = {name: getattr(config.model, name) for name in RUN_FIELDS}
    return dataclasses.replace(encoder, **run), bundle["state_dict"]


def _etl_settings(etl_dir: str) -> dict:
    path = Path(etl_dir) / S.ETL_SETTINGS_FILE
    return json.loads(path.read_text()) if path.exists() else {}
