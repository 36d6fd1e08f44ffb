"""A self-contained HTML report comparing a model with reference models (and, on synthetic data, a ceiling).

``write_report`` draws the figures (saved under ``out_dir/plots/`` and embedded in the page as base64
PNGs) and writes ``out_dir/report.html``: one file with inline CSS, no scripts, no external links, that a
clinician or reviewer can open anywhere. Every piece of text is HTML-escaped.

Its input is a ``ReportInputs``: the task name, the ``evaluate_scores`` dicts of the model and of the
baseline (each holds the overall and new-onset metrics with intervals, the per-code table, precision and
recall at k, calibration summaries and the curves the figures need), plus optional further reference
models, the oracle comparison, pre-training metrics, run information and notes (caveats such as a
synthetic-data warning). The detailed sections set the model beside one baseline, the strongest reference.
"""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from behrt_rope import atomic, schema
from behrt_rope.evaluation import plots
from behrt_rope.evaluation.ceiling import HISTORY_PARTS, format_share
from behrt_rope.evaluation.metrics import CI_LEVEL, percentile_interval

BASELINE_NAME = "Bag-of-codes logistic regression"
REFERENCE_NAMES = {
    "logistic_regression": BASELINE_NAME,
    "logistic_regression_one_cut": "Logistic regression, one cut per patient",
    "gradient_boosting": "Gradient boosting on time features",
    "sparse_time_regression": "Sparse (L1) regression on binned timing of every code",
    "model_deep_part": "Deep part of the model alone (encoder and head; no sparse time path, no chains)",
    "model_learned_parts": "Model without its sparse time path (deep part and hidden-state chains)",
}
"""Display name of each reference model, by its key in ``metrics.json``; every table of names derives from it.
``model_deep_part`` and ``model_learned_parts`` are ablations, not references: the fine-tuned model scored
without the sparse time path that it averages with (the same regression as ``sparse_time_regression``, on
hand-made binned timing features) and, for the deep part, also without the hidden-state chains of its state
path: what the encoder earns alone. The learned parts are everything the model learns from the token stream
itself (shown when the chains have a share; otherwise they are the deep part)."""
PR_PLOT = "precision_recall.png"
ROC_PLOT = "roc.png"
RELIABILITY_PLOT = "reliability.png"
PER_CODE_PLOT = "per_code_ap.png"
AT_K_PLOT = "precision_recall_at_k.png"

METRIC_LABELS = {
    "macro_ap": "Macro AP",
    "micro_ap": "Micro AP",
    "samples_ap": "Per-sample AP",
    "macro_auroc": "Macro AUROC",
    "micro_auroc": "Micro AUROC",
    "samples_auroc": "Per-sample AUROC",
}

DEFINITIONS = (
    (
        "AP (average precision)",
        "Area under the precision-recall curve as a step function "
        "(scikit-learn average_precision_score): the mean, over the true cases, of the precision at the "
        "rank where each case is found. A random ranking scores the prevalence; 1 is perfect.",
    ),
    (
        "AUROC",
        "Probability that a randomly chosen case is scored above a randomly chosen non-case "
        "(ties count one half). 0.5 is chance, 1 is perfect. Insensitive to prevalence, so it can look high "
        "for rare codes that are still hard to find.",
    ),
    ("Micro", "All (sample, code) pairs pooled into one ranking: dominated by common codes."),
    (
        "Macro",
        "Unweighted mean over codes of each code's metric, over codes with at least one case and "
        "one non-case among the evaluated samples; the others are excluded and counted.",
    ),
    (
        "Per-sample",
        "Mean over samples of the sample's metric over its codes (BEHRT's reporting), over "
        "samples with at least one case and one non-case.",
    ),
    (
        "New-onset",
        "The same metrics counting only (sample, code) pairs where the code is absent from the "
        "sample's input history: repeats of known chronic codes are easy and inflate the overall numbers.",
    ),
    (
        "Precision@k / recall@k",
        "Each sample's k highest-scored codes are its predictions. Precision@k: "
        "share of those k that are true, mean over all samples. Recall@k: share of the sample's true codes "
        "among them, mean over samples with at least one true code.",
    ),
    (
        "Brier score",
        "Mean squared difference between predicted probability and outcome (0/1), over all pairs; lower is better.",
    ),
    (
        "ECE / MCE",
        "Predictions are grouped into probability bins; ECE is the pair-weighted mean of "
        "|mean predicted - observed rate| over bins, MCE its maximum over non-empty bins. 0 is perfect.",
    ),
    (
        "95% CI",
        "Bias-corrected percentile bootstrap interval: samples are resampled with replacement and every "
        "metric is recomputed. The difference column resamples both models on the same draws (paired). A "
        "macro replicate averages the same codes as the estimate. Resampling duplicates cases, which pushes "
        "AP up for codes with few cases; the bias correction shifts the interval back by how far the "
        "resamples sit from the estimate, but treat intervals of rare codes as rough.",
    ),
)

CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;max-width:1000px;margin:2em auto;
padding:0 1em;color:#222;line-height:1.45}
h1{font-size:1.6em;margin-bottom:.2em}h2{border-bottom:2px solid #ddd;padding-bottom:.2em;margin-top:1.8em}
table{border-collapse:collapse;margin:.6em 0;font-size:.9em}
th,td{border:1px solid #ccc;padding:.25em .55em;text-align:right;vertical-align:top}
th{background:#f2f4f7}td.l,th.l{text-align:left}
.headline{background:#eef4fb;border:1px solid #9cbbe0;border-radius:6px;padding:.8em 1.2em}
.warn{background:#fff4e0;border:1px solid #e5b567;border-radius:6px;padding:.6em 1em}
.muted{color:#666;font-size:.9em}img{max-width:100%;height:auto;display:block;margin:.5em 0}
details summary{cursor:pointer;font-weight:600;margin:.5em 0}
"""


@dataclass
class ReportInputs:
    """Everything the report shows.

    ``model`` and ``baseline`` are ``evaluate_scores`` outputs on the same samples (the baseline may be
    None); they carry the metrics, per-code tables, calibration summaries and curves. ``pretrain_metrics``
    is a flat dict of masked-language-model results (e.g. loss, accuracy), ``run_info`` a flat dict shown
    as a table (data paths, sizes, settings), ``notes`` lines shown first under Caveats (e.g. the
    synthetic-data warning), ``code_descriptions`` maps a code to its human-readable name.
    ``references`` maps the name of every reference model (the baseline included) to its evaluation on the
    same samples; ``ceiling`` is ``pipelines.evaluate``'s oracle comparison (``n_samples``, ``n_patients``,
    ``predictors``: name -> ``overall`` and ``gap_closed``), or None; ``record_ceiling`` the same against the
    record oracle (the best prediction from the recorded history alone), or None.
    """

    task: str
    model: Mapping[str, Any]
    baseline: Mapping[str, Any] | None = None
    baseline_name: str = BASELINE_NAME
    n_patients: int | None = None
    pretrain_metrics: Mapping[str, Any] | None = None
    run_info: Mapping[str, Any] = field(default_factory=dict)
    notes: Sequence[str] = ()
    code_descriptions: Mapping[str, str] | None = None
    references: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    ceiling: Mapping[str, Any] | None = None
    record_ceiling: Mapping[str, Any] | None = None
    top_codes: int = 30
    plot_codes: int = 20


# ---------------------------------------------------------------------------------------------------------
# Formatting helpers: every helper returns escaped HTML
# ---------------------------------------------------------------------------------------------------------
def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _is_num(value: Any) -> bool:
    return isinstance(value, (int, float, np.number)) and not isinstance(value, bool)


def fmt(value: Any, digits: int = 3) -> str:
    """Plain text of a value: floats to ``digits`` decimals, ints with thousands separators, None/NaN "–"."""
    if value is None or (_is_num(value) and not math.isfinite(float(value))):
        return "–"
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return f"{int(value):,}"
    if _is_num(value):
        return f"{float(value):.{digits}f}"
    return str(value)


def fmt_ci(point: Any, ci: Sequence[Any] | None, digits: int = 3) -> str:
    """ "0.412 (0.398–0.425)", or the point alone without an interval."""
    if ci is None or len(ci) != 2 or any(v is None for v in ci) or fmt(point) == "–":
        return fmt(point, digits)
    return f"{fmt(point, digits)} ({fmt(ci[0], digits)}–{fmt(ci[1], digits)})"


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]], left: int = 1) -> str:
    """An HTML table of plain-text cells; the first ``left`` columns are left-aligned."""

    def cell(tag: str, i: int, value: Any) -> str:
        cls = ' class="l"' if i < left else ""
        return f"<{tag}{cls}>{_e(value)}</{tag}>"

    head = "".join(cell("th", i, h) for i, h in enumerate(headers))
    body = "".join("<tr>" + "".join(cell("td", i, v) for i, v in enumerate(r)) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _img(path: Path, alt: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img src="data:image/png;base64,{data}" alt="{_e(alt)}">'


def _p(text: str, cls: str | None = None) -> str:
    return f'<p class="{cls}">{_e(text)}</p>' if cls else f"<p>{_e(text)}</p>"


def _section(title: str, *parts: str) -> str:
    return f"<section><h2>{_e(title)}</h2>{''.join(parts)}</section>"


# ---------------------------------------------------------------------------------------------------------
# Paired comparison
# ---------------------------------------------------------------------------------------------------------
def paired_difference(
    model: Mapping[str, Any], baseline: Mapping[str, Any] | None, metric: str, section: str = "overall"
) -> tuple[float, float, float] | None:
    """(model - baseline, low, high) for a headline metric, with a paired bias-corrected bootstrap interval.

    Needs both ``evaluate_scores`` dicts to come from the same labels, history, n_bootstrap and seed (same
    ``pairing_key``), so replicate b of both resamples the same samples; otherwise None.
    """
    if not baseline or model.get("pairing_key") != baseline.get("pairing_key"):
        return None
    return replicate_difference(model, baseline, metric, section)


def replicate_difference(
    model: Mapping[str, Any], baseline: Mapping[str, Any], metric: str, section: str = "overall"
) -> tuple[float, float, float] | None:
    """:func:`paired_difference` for two score dicts the caller knows to be paired (the ceiling's predictors
    share their resamples by construction): NaN bounds without replicates of the same shape; None without
    the metric."""
    a, b = model.get(section) or {}, baseline.get(section) or {}
    if a.get(metric) is None or b.get(metric) is None:
        return None
    reps_a = np.asarray(model.get("bootstrap", {}).get(section, {}).get(metric, []), dtype=float)
    reps_b = np.asarray(baseline.get("bootstrap", {}).get(section, {}).get(metric, []), dtype=float)
    low, high = (np.nan, np.nan)
    if reps_a.size and reps_a.shape == reps_b.shape:
        low, high = percentile_interval(reps_a - reps_b, CI_LEVEL, float(a[metric] - b[metric]))
    return float(a[metric] - b[metric]), low, high


def _diff_text(diff: tuple[float, float, float] | None) -> str:
    if diff is None:
        return "–"
    point, low, high = diff
    text = f"{point:+.3f}"
    return text if not (math.isfinite(low) and math.isfinite(high)) else f"{text} ({low:+.3f} to {high:+.3f})"


# ---------------------------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------------------------
def _chance_macro_ap(evaluation: Mapping[str, Any]) -> float | None:
    prevalences = [
        r["prevalence"] for r in evaluation.get("per_code", []) if r.get("ap") is not None and r["prevalence"]
    ]
    return float(np.mean(prevalences)) if prevalences else None


def _headline(inputs: ReportInputs, model_name: str) -> str:
    m, b = inputs.model, inputs.baseline
    overall = m.get("overall", {})
    chance_macro = _chance_macro_ap(m)
    meanings = {
        "macro_ap": "How well each code's true cases are ranked above the rest, averaged over "
        f"{fmt(overall.get('n_codes_macro'))} codes (random ranking: {fmt(chance_macro)}; perfect: 1).",
        "micro_ap": "The same over all patient-code predictions pooled, so common codes dominate "
        f"(random ranking: {fmt(overall.get('label_density'))}).",
        "macro_auroc": "Chance that a code's true case is scored above a non-case, averaged over codes "
        "(0.5: coin toss; 1: perfect).",
    }
    rows = []
    for key, meaning in meanings.items():
        rows.append(
            [
                METRIC_LABELS[key],
                fmt_ci(overall.get(key), overall.get("ci", {}).get(key)),
                fmt_ci((b or {}).get("overall", {}).get(key), (b or {}).get("overall", {}).get("ci", {}).get(key))
                if b
                else "–",
                _diff_text(paired_difference(m, b, key)),
                meaning,
            ]
        )
    facts = [
        f"Task: {inputs.task}",
        f"Model: {model_name}; baseline: {inputs.baseline_name if b else 'none'}",
        f"Evaluated samples: {fmt(m.get('n_samples'))}"
        + (f" from {fmt(inputs.n_patients)} patients" if inputs.n_patients is not None else "")
        + f"; label codes: {fmt(m.get('n_codes'))}",
    ]
    if m.get("repeat_share") is not None:
        facts.append(
            f"{100 * m['repeat_share']:.1f}% of the true (sample, code) pairs repeat a code already in the "
            "sample's history (see New-onset below)."
        )
    table = _table(
        ["Metric", f"{model_name} (95% CI)", "Baseline (95% CI)", "Difference (paired 95% CI)", "What it means"],
        rows,
    )
    items = "".join(f"<li>{_e(f)}</li>" for f in facts)
    return f'<div class="headline"><ul>{items}</ul>{table}</div>'


REFERENCE_METRICS = ("macro_ap", "micro_ap", "macro_auroc")


def _references_section(inputs: ReportInputs, model_name: str) -> str:
    """Model and every reference model side by side, with the model's paired difference to each."""
    if not inputs.references:
        return ""
    headers = ["Predictor"] + [f"{METRIC_LABELS[k]} (95% CI)" for k in REFERENCE_METRICS]
    headers.append(f"{model_name} minus this, macro AP (paired 95% CI)")
    rows = [[model_name] + [_overall_ci(inputs.model, k) for k in REFERENCE_METRICS] + ["–"]]
    for name, evaluation in inputs.references.items():
        diff = _diff_text(paired_difference(inputs.model, evaluation, "macro_ap"))
        rows.append([name] + [_overall_ci(evaluation, k) for k in REFERENCE_METRICS] + [diff])
    intro = (
        "Does the transformer earn its cost? The reference models are fitted on the train patients: a "
        "logistic regression on which codes a patient has had (and age), on the same samples as the model, "
        "the same on one random visit per patient (the classic set-up, where shown), gradient-boosted "
        "trees on hand-made time features (how often, how recently and for how long each code was recorded) "
        "and, where shown, a sparse (L1) regression on the same timing binned, for every code at once, so that "
        "it can find which other code's history matters, both on the same samples as the model. The model "
        "averages its deep part (encoder and attention heads) with that same sparse regression, fitted before "
        "its training; the deep part's row, where shown, is the model without it. A positive "
        "difference whose interval excludes 0 means the model ranks better on this test set."
    )
    return (
        _section("Against the reference models", _p(intro), _table(headers, rows))
        + _ceiling_section(inputs.ceiling, model_name, record=False)
        + _ceiling_section(inputs.record_ceiling, model_name, record=True)
    )


def _overall_ci(evaluation: Mapping[str, Any], key: str) -> str:
    overall = evaluation.get("overall") or {}
    return fmt_ci(overall.get(key), (overall.get("ci") or {}).get(key))


def _ceiling_section(ceiling: Mapping[str, Any] | None, model_name: str, record: bool) -> str:
    """The predictors against the state oracle (``record=False``) or against the record oracle."""
    if not ceiling:
        return ""
    oracle_name = "Record oracle (best from the record)" if record else "Oracle (true probabilities)"
    names = {"model": model_name, "oracle": oracle_name, **REFERENCE_NAMES}
    one_cut = any(entry.get("gap_closed_one_cut") for entry in ceiling["predictors"].values())
    rows = []
    for key, entry in ceiling["predictors"].items():
        row = [names.get(key, key)] + [_overall_ci(entry, k) for k in REFERENCE_METRICS]
        row.append(format_share(entry.get("gap_closed")))
        if one_cut:
            row.append(format_share(entry.get("gap_closed_one_cut")))
        rows.append(row)
    target = "record oracle" if record else "oracle"
    headers = ["Predictor"] + [f"{METRIC_LABELS[k]} (95% CI)" for k in REFERENCE_METRICS]
    headers.append(f"Gap closed, logistic regression to {target} (95% CI)")
    if one_cut:
        headers.append(f"Gap closed, one-cut logistic regression to {target} (95% CI)")
    cuts = f"({fmt(ceiling.get('n_samples'))} samples from {fmt(ceiling.get('n_patients'))} patients)"
    if record:
        title = "Against the learnable ceiling (synthetic data)"
        intro = (
            f"The oracle above sees conditions the record does not show yet. The record oracle answers at the "
            f"same visits {cuts} from the recorded history alone: the generator's probabilities averaged over "
            "every state it could be in given what was recorded (importance sampling). It is the best any "
            "model of the record can do, so the gap columns here say how much of what is learnable a "
            "predictor has learned."
        )
    else:
        title = "Against the ceiling (synthetic data)"
        intro = (
            f"On synthetic data the generator knows each patient's true risk. At one random visit per held-out "
            f"patient {cuts} the oracle gives the true probability of each code at the next visit, the best any "
            "predictor can do. The gap columns say how much of the distance from a logistic regression (0%) to "
            "the oracle (100%) a predictor covers on macro AP: from the bag-of-codes one fitted on every visit "
            "(the stricter yardstick) and, where shown, from the classic one fitted on one cut per patient."
        )
    return _section(title, _p(intro), _table(headers, rows), _history_split(ceiling, names, record))


def _history_split(ceiling: Mapping[str, Any], names: Mapping[str, str], record: bool) -> str:
    """The ceiling table's macro AP and gap closed apart on codes already on file and on new onsets."""
    parts = ceiling.get("by_history")
    if not parts:
        return ""
    headers = ["Predictor"]
    for label in HISTORY_PARTS.values():
        headers += [f"Macro AP, {label} (95% CI)", "Gap closed"]
    rows = []
    for key in ceiling["predictors"]:
        row = [names.get(key, key)]
        for part in HISTORY_PARTS:
            entry = parts[part].get(key, {})
            row += [fmt_ci(entry.get("macro_ap"), entry.get("ci")), format_share(entry.get("gap_closed"), ci=False)]
        rows.append(row)
    intro = "The same cells apart: codes already on file for the patient, and codes not yet recorded (new onsets). "
    if record:
        intro += "Both parts are learnable from the record here: a gap left on new onsets is the model's to close."
    else:
        intro += (
            "The generator knows conditions that have begun but are not yet recorded; no model of the recorded "
            "history can see them, so the oracle's lead on new onsets is partly out of any model's reach, while "
            "on codes already on file a model can come close to it."
        )
    return _p(intro) + _table(headers, rows)


HOW_TO_READ = (
    "Each sample is a patient at a prediction time; the model gives every label code a probability of "
    "being recorded in the outcome window. Discrimination (AP, AUROC) asks whether true diagnoses are "
    "ranked above the others; calibration asks whether a predicted 20% comes true about 20% of the time. "
    "AP is the main metric for rare codes: its chance level is the code's prevalence, so compare it with "
    "the baseline and the prevalence, not with 1. Intervals are 95% bootstrap intervals over samples; a "
    "paired difference interval that excludes 0 means the model and the baseline differ beyond resampling "
    "noise on this test set. New-onset metrics ignore codes already in a patient's history, which is where "
    "forecasting is hard. Results on synthetic data say nothing about clinical performance."
)


def _metrics_rows(
    a: Mapping[str, Any], b: Mapping[str, Any] | None, section: str, model: Mapping[str, Any], base: Any
) -> list[list[str]]:
    rows = []
    for key, label in METRIC_LABELS.items():
        rows.append(
            [
                label,
                fmt_ci(a.get(key), a.get("ci", {}).get(key)),
                fmt_ci(b.get(key), b.get("ci", {}).get(key)) if b else "–",
                _diff_text(paired_difference(model, base, key, section)),
            ]
        )
    counts = (
        (
            "Codes in macro average (excluded)",
            lambda d: f"{fmt(d.get('n_codes_macro'))} ({fmt(d.get('n_codes_excluded'))})",
        ),
        ("Samples in per-sample average", lambda d: fmt(d.get("n_samples_evaluable"))),
        ("Evaluated (sample, code) pairs", lambda d: fmt(d.get("n_pairs"))),
        (
            "True pairs (label density)",
            lambda d: f"{fmt(d.get('n_positive_pairs'))} ({fmt(d.get('label_density'), 4)})",
        ),
        ("Mean true codes per sample", lambda d: fmt(d.get("label_cardinality"), 2)),
    )
    for label, render in counts:
        rows.append([label, render(a), render(b) if b else "–", ""])
    return rows


def _metrics_section(inputs: ReportInputs, model_name: str, section: str, title: str, intro: str) -> str:
    a = inputs.model.get(section)
    if not a:
        return ""
    b = (inputs.baseline or {}).get(section)
    headers = ["Metric", f"{model_name} (95% CI)", f"{inputs.baseline_name} (95% CI)", "Difference (paired 95% CI)"]
    return _section(title, _p(intro), _table(headers, _metrics_rows(a, b, section, inputs.model, inputs.baseline)))


def _at_k_section(inputs: ReportInputs, model_name: str, figure: str) -> str:
    a = inputs.model.get("at_k") or {}
    if not a:
        return ""
    b = (inputs.baseline or {}).get("at_k") or {}
    keys = [k for k in a if "@" in k]
    rows = [[k, fmt(a.get(k)), fmt(b.get(k)) if b else "–"] for k in keys]
    new_a = inputs.model.get("new_onset_at_k") or {}
    new_b = (inputs.baseline or {}).get("new_onset_at_k") or {}
    rows += [[f"New-onset {k}", fmt(new_a.get(k)), fmt(new_b.get(k)) if new_b else "–"] for k in keys if new_a]
    intro = (
        "If a clinician looked only at each patient's k highest-scored codes: precision@k is the share of "
        "them that come true, recall@k the share of the patient's true codes among them "
        f"(recall over the {fmt(a.get('n_samples_with_positive'))} samples with at least one true code)."
    )
    table = _table(["Measure", model_name, inputs.baseline_name], rows)
    return _section("Top-k predictions per sample", _p(intro), figure, table)


def _calibration_section(inputs: ReportInputs, model_name: str, figure: str) -> str:
    a = inputs.model.get("calibration") or {}
    if not a:
        return ""
    b = (inputs.baseline or {}).get("calibration") or {}
    rows = []
    for label, key, digits in (
        ("Brier score", "brier", 4),
        ("Mean predicted probability", "mean_predicted", 4),
        ("Observed rate", "observed_rate", 4),
    ):
        rows.append(
            [
                label,
                fmt(a.get("uniform", {}).get(key), digits),
                fmt(b.get("uniform", {}).get(key), digits) if b else "–",
            ]
        )
    for strategy, name in (("uniform", "equal-width"), ("quantile", "equal-count")):
        for key in ("ece", "mce"):
            rows.append(
                [
                    f"{key.upper()} ({a.get(strategy, {}).get('n_bins', '')} {name} bins)",
                    fmt(a.get(strategy, {}).get(key), 4),
                    fmt(b.get(strategy, {}).get(key), 4) if b else "–",
                ]
            )
    intro = (
        "Whether predicted probabilities match observed frequencies, over all (sample, code) pairs. Most "
        "pairs are rare-code non-cases with small predictions, so the lowest bin holds most pairs (see the "
        "histogram); ECE is therefore small even for a poorly calibrated model at high probabilities."
    )
    return _section("Calibration", _p(intro), _table(["Measure", model_name, inputs.baseline_name], rows), figure)


def _per_code_rows(inputs: ReportInputs) -> tuple[list[str], list[list[str]]]:
    descriptions = inputs.code_descriptions or {}
    base = {r[schema.CODE]: r for r in (inputs.baseline or {}).get("per_code", [])}
    has_new = any("new_onset_ap" in r for r in inputs.model.get("per_code", []))
    headers = [schema.CODE.capitalize()] + (["Description"] if descriptions else [])
    headers += [
        "Cases",
        "Prevalence %",
        "Model AP (95% CI)",
        "Baseline AP (95% CI)",
        "Model AUROC (95% CI)",
        "Baseline AUROC (95% CI)",
    ]
    headers += ["New-onset cases", "Model new-onset AP", "Baseline new-onset AP"] if has_new else []
    rows = []
    for r in inputs.model.get("per_code", []):
        code = r[schema.CODE]
        o = base.get(code, {})
        row = [code] + ([descriptions.get(code, "")] if descriptions else [])
        row += [
            fmt(r.get("n_positive")),
            fmt(100 * r["prevalence"], 2) if r.get("prevalence") is not None else "–",
            fmt_ci(r.get("ap"), (r.get("ap_low"), r.get("ap_high"))),
            fmt_ci(o.get("ap"), (o.get("ap_low"), o.get("ap_high"))) if o else "–",
            fmt_ci(r.get("auroc"), (r.get("auroc_low"), r.get("auroc_high"))),
            fmt_ci(o.get("auroc"), (o.get("auroc_low"), o.get("auroc_high"))) if o else "–",
        ]
        if has_new:
            row += [
                fmt(r.get("new_onset_n_positive")),
                fmt(r.get("new_onset_ap")),
                fmt(o.get("new_onset_ap")) if o else "–",
            ]
        rows.append(row)
    return headers, rows


def _per_code_section(inputs: ReportInputs, figure: str) -> str:
    headers, rows = _per_code_rows(inputs)
    if not rows:
        return ""
    left = 2 if inputs.code_descriptions else 1
    top, rest = rows[: inputs.top_codes], rows[inputs.top_codes :]
    intro = (
        f"One row per label code, most prevalent first ({len(top)} shown, {len(rest)} more below). AP and "
        "AUROC are undefined (–) for a code without both cases and non-cases among the evaluated samples. "
        "Wide intervals mean too few cases to judge that code."
    )
    parts = [_p(intro), figure, _table(headers, top, left)]
    if rest:
        parts.append(
            f"<details><summary>{_e(f'All other {len(rest)} codes')}</summary>{_table(headers, rest, left)}</details>"
        )
    return _section("Per-code results", *parts)


def _dict_section(title: str, values: Mapping[str, Any] | None, intro: str) -> str:
    if not values:
        return ""
    rows = [[key, fmt(value, 4)] for key, value in values.items()]
    return _section(title, _p(intro), _table(["Item", "Value"], rows))


def _caveats(inputs: ReportInputs) -> str:
    notes = "".join(f'<div class="warn">{_e(note)}</div>' for note in inputs.notes)
    general = _p(
        "Intervals reflect resampling of this test set only, not variation between hospitals, coding "
        "practices or time periods. Codes with few cases have unstable per-code metrics. A model that is "
        "better at ranking is not automatically useful clinically: that needs decision thresholds, "
        "prospective validation and review of the errors."
    )
    defs = "".join(f"<dt><b>{_e(term)}</b></dt><dd>{_e(text)}</dd>" for term, text in DEFINITIONS)
    return _section("Caveats and definitions", notes, general, f"<dl>{defs}</dl>")


# ---------------------------------------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------------------------------------
def _series(inputs: ReportInputs, model_name: str, pick: Callable[[Mapping[str, Any]], Any]) -> dict[str, Any]:
    out = {model_name: pick(inputs.model)}
    if inputs.baseline:
        out[inputs.baseline_name] = pick(inputs.baseline)
    return {name: value for name, value in out.items() if value}


def _figures(inputs: ReportInputs, model_name: str, plot_dir: Path) -> dict[str, str]:
    """Draw every figure the data allows; returns figure name -> embedded <img> HTML."""
    figs: dict[str, str] = {}

    def label(evaluation: Mapping[str, Any], key: str, name: str) -> str:
        return f"{name} ({METRIC_LABELS[key]} {fmt(evaluation.get('overall', {}).get(key))})"

    curves = _series(inputs, model_name, lambda e: e.get("curves"))
    if curves:
        named = {model_name: inputs.model, inputs.baseline_name: inputs.baseline or {}}
        pr = {label(named[n], "micro_ap", n): (c["pr"]["recall"], c["pr"]["precision"]) for n, c in curves.items()}
        roc = {label(named[n], "micro_auroc", n): (c["roc"]["fpr"], c["roc"]["tpr"]) for n, c in curves.items()}
        chance = inputs.model.get("overall", {}).get("label_density")
        figs["pr"] = _img(plots.plot_pr_curves(pr, plot_dir / PR_PLOT, chance=chance), "Precision-recall curves")
        figs["roc"] = _img(plots.plot_roc_curves(roc, plot_dir / ROC_PLOT), "ROC curves")
    calibration = _series(inputs, model_name, lambda e: (e.get("calibration") or {}).get("uniform"))
    if calibration:
        figs["reliability"] = _img(
            plots.plot_reliability(calibration, plot_dir / RELIABILITY_PLOT), "Reliability diagram"
        )
    per_code = _series(inputs, model_name, lambda e: e.get("per_code"))
    if per_code:
        path = plots.plot_per_code_ap(
            per_code, plot_dir / PER_CODE_PLOT, top_n=inputs.plot_codes, descriptions=inputs.code_descriptions
        )
        figs["per_code"] = _img(path, "Per-code average precision")
    at_k = _series(inputs, model_name, lambda e: e.get("at_k"))
    if at_k:
        figs["at_k"] = _img(plots.plot_at_k(at_k, plot_dir / AT_K_PLOT), "Precision and recall at k")
    return figs


# ---------------------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------------------
def render_html(inputs: ReportInputs, model_name: str, figures: Mapping[str, str]) -> str:
    """The report page as a string (figures: name -> <img> HTML from ``_figures``)."""
    overall_intro = (
        "All samples and codes. Micro pools every (sample, code) pair; macro averages codes equally; "
        "per-sample averages patients equally (BEHRT's metric)."
    )
    new_intro = (
        "Only (sample, code) pairs where the code is not yet in the sample's history: can the model "
        "anticipate diagnoses the patient has not had before?"
    )
    body = [
        f"<h1>{_e(f'Diagnosis prediction report: {model_name}')}</h1>",
        _p(inputs.task, "muted"),
        _headline(inputs, model_name),
        _references_section(inputs, model_name),
        _section("How to read this report", _p(HOW_TO_READ)),
        _section("Ranking quality (all predictions pooled)", figures.get("pr", ""), figures.get("roc", "")),
        _metrics_section(inputs, model_name, "overall", "Overall metrics", overall_intro),
        _metrics_section(inputs, model_name, "new_onset", "New-onset metrics", new_intro),
        _at_k_section(inputs, model_name, figures.get("at_k", "")),
        _calibration_section(inputs, model_name, figures.get("reliability", "")),
        _per_code_section(inputs, figures.get("per_code", "")),
        _dict_section(
            "Pre-training (masked code prediction)",
            inputs.pretrain_metrics,
            "Self-supervised pre-training results on held-out visits: how well the encoder "
            "recovers masked codes from their context.",
        ),
        _dict_section("Data and run information", inputs.run_info, "Where the numbers come from."),
        _caveats(inputs),
    ]
    title = _e(f"{model_name}: {inputs.task}")
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
        f"<style>{CSS}</style></head><body>{''.join(body)}</body></html>\n"
    )


def write_report(out_dir: str | Path, model_name: str, sections: ReportInputs) -> Path:
    """Write ``out_dir/report.html`` (self-contained) and its figures under ``out_dir/plots/``.

    Returns the report's path. The figures present depend on the data given (e.g. no baseline: model
    only).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    figures = _figures(sections, model_name, out / schema.PLOTS_DIR)
    path = out / schema.REPORT_FILE
    atomic.write_text(path, render_html(sections, model_name, figures))
    return path
