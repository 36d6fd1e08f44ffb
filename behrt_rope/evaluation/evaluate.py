"""One call per model to score its predictions, one call to turn two models' scores into the report.

Typical use by the evaluate pipeline::

    model_eval = evaluate_scores(y_true, model_probs, history, label_codes, n_bootstrap=200, seed=0)
    base_eval = evaluate_scores(y_true, baseline_probs, history, label_codes, n_bootstrap=200, seed=0)
    write_json(out_dir / METRICS_FILE, {"model": model_eval, "baseline": base_eval})
    write_evaluation_report(out_dir, "BEHRT-RoPE", "Diagnoses at the next visit", model_eval, base_eval)

Give both models the same rows in the same order, the same history, ``n_bootstrap`` and ``seed``: the
bootstrap then resamples the same samples for both, and the report shows paired difference intervals.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from sklearn.metrics import precision_recall_curve, roc_curve

from behrt_rope import schema
from behrt_rope.evaluation.calibration import calibration_summary
from behrt_rope.evaluation.metrics import (
    CI_LEVEL,
    HEADLINE_METRICS,
    check_inputs,
    per_code_frame,
    percentile_interval,
    precision_recall_at_k,
    summary_and_replicates,
)
from behrt_rope.evaluation.report import BASELINE_NAME, ReportInputs, write_report

CURVE_POINTS = 200


def to_jsonable(value: Any) -> Any:
    """Plain JSON types all the way down: numpy scalars and arrays become Python numbers and lists,
    DataFrames lists of row dicts, tuples lists, and NaN or infinite floats None."""
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, pd.DataFrame):
        return to_jsonable(value.to_dict(orient="records"))
    if isinstance(value, (np.ndarray, list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    return value


def pairing_key(y_true: np.ndarray, history: np.ndarray | None, n_bootstrap: int, seed: int) -> str:
    """Hash of what makes two evaluations' bootstrap replicates paired (labels, history, B, seed)."""
    digest = hashlib.sha256()
    digest.update(np.asarray(y_true.shape, dtype=np.int64).tobytes())
    digest.update(np.packbits(np.asarray(y_true, dtype=bool)).tobytes())
    if history is not None:
        digest.update(np.packbits(np.asarray(history, dtype=bool)).tobytes())
    digest.update(f"{n_bootstrap}/{seed}".encode())
    return digest.hexdigest()[:16]


def _thin(x: np.ndarray, y: np.ndarray, n_points: int = CURVE_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """At most about ``n_points`` points of a curve with increasing x, evenly spread along x, ends kept."""
    if len(x) <= n_points:
        return x, y
    grid = np.linspace(x[0], x[-1], n_points)
    idx = np.unique(np.concatenate([[0, len(x) - 1], np.searchsorted(x, grid).clip(0, len(x) - 1)]))
    return x[idx], y[idx]


def micro_curves(y_true: np.ndarray, y_score: np.ndarray) -> dict[str, dict[str, list[float]]] | None:
    """Pooled precision-recall and ROC curves, thinned for plotting; None without both classes."""
    yp, sp = np.asarray(y_true, dtype=bool).ravel(), np.asarray(y_score, dtype=float).ravel()
    if yp.all() or not yp.any():
        return None
    precision, recall, _ = precision_recall_curve(yp, sp)
    recall, precision = _thin(recall[::-1], precision[::-1])
    fpr, tpr, _ = roc_curve(yp, sp)
    fpr, tpr = _thin(fpr, tpr)
    return {
        "pr": {"recall": recall.tolist(), "precision": precision.tolist()},
        "roc": {"fpr": fpr.tolist(), "tpr": tpr.tolist()},
    }


def _with_ci(summary: dict[str, Any], replicates: Mapping[str, np.ndarray]) -> dict[str, Any]:
    summary["ci"] = {name: percentile_interval(replicates[name], CI_LEVEL, summary[name]) for name in HEADLINE_METRICS}
    return summary


def _new_onset_columns(y: np.ndarray, s: np.ndarray, codes: Sequence[str], mask: np.ndarray) -> pd.DataFrame:
    frame = per_code_frame(y, s, codes, None, mask)[[schema.CODE, "n_positive", "n_samples", "ap", "auroc"]]
    return frame.rename(columns={c: f"new_onset_{c}" for c in frame.columns if c != schema.CODE})


def evaluate_scores(
    y_true: np.ndarray,
    y_score: np.ndarray,
    history: np.ndarray | None = None,
    label_codes: Sequence[str] | None = None,
    n_bootstrap: int = 200,
    seed: int = 0,
    *,
    ks: Sequence[int] = (1, 5, 10),
    n_bins: int = 10,
) -> dict[str, Any]:
    """Every metric of one model's (N, L) probabilities, as a JSON-serialisable dict.

    Inputs: ``y_true`` (N, L) 0/1 outcomes, ``y_score`` (N, L) probabilities, ``history`` (N, L) bool
    (code already in the sample's input history; None skips the new-onset parts), ``label_codes`` (L,)
    (default "0", "1", ...). Intervals: ``n_bootstrap`` resamples of the N samples with ``seed``.

    Keys of the result (NaN written as None):

    * ``n_samples``, ``n_codes``, ``n_bootstrap``, ``seed``, ``ci_level``, ``pairing_key`` (equal for two
      evaluations whose bootstrap draws are paired), ``repeat_share`` (share of true pairs whose code is
      in the history; None without history).
    * ``overall``: ``summary_metrics`` plus ``ci`` {metric: [low, high]} for the six headline metrics.
    * ``new_onset``: the same with ``mask = ~history`` (None without history).
    * ``bootstrap``: {"overall"|"new_onset": {metric: [B replicate values]}} for paired comparisons.
    * ``per_code``: ``per_code_table`` rows (most prevalent first) as dicts, plus ``new_onset_n_positive``,
      ``new_onset_n_samples``, ``new_onset_ap`` and ``new_onset_auroc`` (point values) with history.
    * ``at_k`` / ``new_onset_at_k``: ``precision_recall_at_k`` (new-onset: history codes not ranked).
    * ``calibration``: {"uniform": ..., "quantile": ...} ``calibration_summary`` with ``n_bins`` bins.
    * ``curves``: pooled {"pr": {"recall", "precision"}, "roc": {"fpr", "tpr"}} thinned to ~200 points.
    """
    y, s, h = check_inputs(y_true, y_score, history)
    codes = [str(c) for c in label_codes] if label_codes is not None else [str(j) for j in range(y.shape[1])]
    overall, reps = summary_and_replicates(y, s, None, n_bootstrap, seed)
    per_code = per_code_frame(y, s, codes, reps)
    result: dict[str, Any] = {
        "n_samples": y.shape[0],
        "n_codes": y.shape[1],
        "n_bootstrap": n_bootstrap,
        "seed": seed,
        "ci_level": CI_LEVEL,
        "pairing_key": pairing_key(y, h, n_bootstrap, seed),
        "repeat_share": float((y & h).sum() / y.sum()) if h is not None and y.any() else None,
        "overall": _with_ci(overall, reps),
        "new_onset": None,
        "bootstrap": {"overall": {name: reps[name] for name in HEADLINE_METRICS}},
        "at_k": precision_recall_at_k(y, s, ks),
        "new_onset_at_k": None,
        "calibration": {st: calibration_summary(y, s, n_bins, st) for st in ("uniform", "quantile")},
        "curves": micro_curves(y, s),
    }
    if h is not None:
        new_onset, new_reps = summary_and_replicates(y, s, ~h, n_bootstrap, seed)
        result["new_onset"] = _with_ci(new_onset, new_reps)
        result["bootstrap"]["new_onset"] = {name: new_reps[name] for name in HEADLINE_METRICS}
        result["new_onset_at_k"] = precision_recall_at_k(y, s, ks, ~h)
        per_code = per_code.merge(_new_onset_columns(y, s, codes, ~h), on=schema.CODE, how="left")
    result["per_code"] = per_code
    return to_jsonable(result)


def write_evaluation_report(
    out_dir: str | Path,
    model_name: str,
    task: str,
    model_eval: Mapping[str, Any],
    baseline_eval: Mapping[str, Any] | None = None,
    *,
    n_patients: int | None = None,
    pretrain_metrics: Mapping[str, Any] | None = None,
    run_info: Mapping[str, Any] | None = None,
    notes: Sequence[str] = (),
    code_descriptions: Mapping[str, str] | None = None,
    baseline_name: str = BASELINE_NAME,
    references: Mapping[str, Mapping[str, Any]] | None = None,
    ceiling: Mapping[str, Any] | None = None,
    record_ceiling: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``out_dir/report.html`` (self-contained) and ``out_dir/plots/*.png``; returns the html path.

    ``model_eval`` and ``baseline_eval`` are ``evaluate_scores`` outputs (or the same dicts read back
    from JSON); ``notes`` are shown as warnings under Caveats (e.g. "Synthetic data: ..."); the other
    arguments are optional extras described in ``ReportInputs``.
    """
    inputs = ReportInputs(
        task=task,
        model=model_eval,
        baseline=baseline_eval,
        baseline_name=baseline_name,
        n_patients=n_patients,
        pretrain_metrics=pretrain_metrics,
        run_info=dict(run_info or {}),
        notes=tuple(notes),
        code_descriptions=code_descriptions,
        references=dict(references or {}),
        ceiling=ceiling,
        record_ceiling=record_ceiling,
    )
    return write_report(out_dir, model_name, inputs)
