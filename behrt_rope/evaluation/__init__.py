"""Evaluation of multi-label diagnosis predictions: metrics, calibration, the bag-of-codes baseline, figures
and the self-contained HTML report. Pure functions of arrays; no model code.

Entry points for the evaluate pipeline: ``evaluate_scores`` (one model's scores to a JSON-ready dict) and
``write_evaluation_report`` (model and baseline dicts to ``report.html``).
"""

from behrt_rope.evaluation.baseline import age_features, bag_of_codes, fit_predict_baseline
from behrt_rope.evaluation.calibration import calibration_summary, reliability_bins
from behrt_rope.evaluation.evaluate import evaluate_scores, to_jsonable, write_evaluation_report
from behrt_rope.evaluation.metrics import (
    bootstrap_ci,
    bootstrap_replicates,
    per_code_table,
    precision_recall_at_k,
    summary_and_replicates,
    summary_metrics,
)
from behrt_rope.evaluation.report import ReportInputs, paired_difference, write_report

__all__ = [
    "ReportInputs",
    "age_features",
    "bag_of_codes",
    "bootstrap_ci",
    "bootstrap_replicates",
    "calibration_summary",
    "evaluate_scores",
    "fit_predict_baseline",
    "paired_difference",
    "per_code_table",
    "precision_recall_at_k",
    "reliability_bins",
    "summary_and_replicates",
    "summary_metrics",
    "to_jsonable",
    "write_evaluation_report",
    "write_report",
]
