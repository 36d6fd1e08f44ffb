"""Report figures as PNG files (matplotlib, Agg backend: no display needed).

Every function takes plain data keyed by a series name (the legend label, e.g. the model and the
baseline), writes one PNG at ``path`` (7 in wide, 110 dpi) and returns the path. Series are drawn in the
order given, with fixed colours, so the model and the baseline look the same in every figure.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from behrt_rope import atomic, schema

WIDTH_IN = 7.0
DPI = 110
COLORS = ("#1f5fa8", "#e07b00", "#2e8b57", "#8e44ad", "#b03a2e")
Curve = tuple[Sequence[float], Sequence[float]]


def _save(fig: Figure, path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    with atomic.atomic_path(out) as tmp:
        fig.savefig(tmp, format=out.suffix.lstrip(".") or "png", dpi=DPI, bbox_inches="tight", pad_inches=0.1)
    plt.close(fig)
    return out


def _color(i: int) -> str:
    return COLORS[i % len(COLORS)]


def _unit_axes(ax: Any, xlabel: str, ylabel: str) -> None:
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)


def plot_pr_curves(
    curves: Mapping[str, Curve],
    path: str | Path,
    *,
    chance: float | None = None,
    title: str = "Precision-recall, all (sample, code) pairs pooled (micro)",
) -> Path:
    """Precision-recall curves: ``curves`` maps a legend label to (recall, precision) point lists.

    ``chance`` (the positive share of the pairs) draws the precision of a random ranking.
    """
    fig, ax = plt.subplots(figsize=(WIDTH_IN, 5.0))
    for i, (name, (recall, precision)) in enumerate(curves.items()):
        ax.step(recall, precision, where="pre", color=_color(i), lw=1.8, label=name)
    if chance is not None and math.isfinite(chance):
        ax.axhline(chance, color="grey", ls="--", lw=1, label=f"Random ranking (precision {chance:.3f})")
    _unit_axes(ax, "Recall (share of true diagnoses found)", "Precision (share of flagged that are true)")
    ax.set_title(title)
    ax.legend(loc="upper right", fontsize=9)
    return _save(fig, path)


def plot_roc_curves(
    curves: Mapping[str, Curve],
    path: str | Path,
    *,
    title: str = "ROC, all (sample, code) pairs pooled (micro)",
) -> Path:
    """ROC curves: ``curves`` maps a legend label to (false positive rate, true positive rate) lists."""
    fig, ax = plt.subplots(figsize=(WIDTH_IN, 5.0))
    for i, (name, (fpr, tpr)) in enumerate(curves.items()):
        ax.plot(fpr, tpr, color=_color(i), lw=1.8, label=name)
    ax.plot([0, 1], [0, 1], color="grey", ls="--", lw=1, label="Random ranking (AUROC 0.5)")
    _unit_axes(ax, "False positive rate (share of negatives flagged)", "True positive rate (recall)")
    ax.set_title(title)
    ax.legend(loc="lower right", fontsize=9)
    return _save(fig, path)


def plot_reliability(
    calibrations: Mapping[str, Mapping[str, Any]],
    path: str | Path,
    *,
    title: str = "Reliability: predicted probability vs observed frequency (pooled pairs)",
) -> Path:
    """Reliability diagram over a histogram of predictions, from ``calibration_summary`` dicts.

    Top: each non-empty bin's mean predicted probability against its observed positive rate (the
    diagonal is perfect calibration). Bottom: pairs per bin, log scale.
    """
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(WIDTH_IN, 7.0), sharex=True, gridspec_kw={"height_ratios": [3, 1.3]}
    )
    top.plot([0, 1], [0, 1], color="grey", ls="--", lw=1, label="Perfect calibration")
    n_series = max(len(calibrations), 1)
    for i, (name, summary) in enumerate(calibrations.items()):
        bins = [b for b in summary["bins"] if b["count"]]
        pred = [b["mean_predicted"] for b in bins]
        obs = [b["observed_rate"] for b in bins]
        label = f"{name} (ECE {summary['ece']:.3f})" if summary.get("ece") is not None else name
        top.plot(pred, obs, marker="o", ms=4, color=_color(i), lw=1.5, label=label)
        lower = np.array([b["lower"] for b in summary["bins"]])
        width = np.array([b["upper"] for b in summary["bins"]]) - lower
        counts = [b["count"] for b in summary["bins"]]
        bottom.bar(lower + width * i / n_series, counts, width=width / n_series, align="edge", color=_color(i))
    _unit_axes(top, "", "Observed frequency (share of pairs positive)")
    top.set_title(title)
    top.legend(loc="upper left", fontsize=9)
    bottom.set_yscale("log")
    bottom.set_xlim(0, 1)
    bottom.set_xlabel("Predicted probability")
    bottom.set_ylabel("Pairs per bin (log)")
    bottom.grid(alpha=0.3, axis="y")
    return _save(fig, path)


def _short(text: str, width: int = 38) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def plot_per_code_ap(
    tables: Mapping[str, Sequence[Mapping[str, Any]]],
    path: str | Path,
    *,
    top_n: int = 20,
    descriptions: Mapping[str, str] | None = None,
    title: str | None = None,
) -> Path:
    """Horizontal grouped bars of per-code AP with 95 % CI error bars, for the ``top_n`` most prevalent
    codes of the first series (``per_code_table`` records: code, prevalence, ap, ap_low, ap_high)."""
    first = next(iter(tables.values()), [])
    rows = list(first)[:top_n]
    codes = [str(r[schema.CODE]) for r in rows]
    n_series = max(len(tables), 1)
    height = 0.8 / n_series
    fig, ax = plt.subplots(figsize=(WIDTH_IN, 1.4 + 0.32 * max(len(codes), 1) * max(1, n_series / 2)))
    ys = np.arange(len(codes))
    for i, (name, records) in enumerate(tables.items()):
        by_code = {str(r[schema.CODE]): r for r in records}
        ap = np.array([_num(by_code.get(c, {}).get("ap")) for c in codes])
        low = np.array([_num(by_code.get(c, {}).get("ap_low")) for c in codes])
        high = np.array([_num(by_code.get(c, {}).get("ap_high")) for c in codes])
        err = np.vstack([np.clip(ap - low, 0, None), np.clip(high - ap, 0, None)])
        err = np.nan_to_num(err)
        ax.barh(
            ys + (i - (n_series - 1) / 2) * height,
            np.nan_to_num(ap),
            height=height,
            xerr=err,
            color=_color(i),
            ecolor="#333333",
            capsize=2,
            label=name,
        )
    labels = []
    for row, code in zip(rows, codes):
        text = code if not descriptions or code not in descriptions else f"{code} {descriptions[code]}"
        labels.append(f"{_short(text)} ({100 * _num(row.get('prevalence')):.1f}%)")
    ax.set_yticks(ys, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_xlabel("Average precision (AP; bars: 95% bootstrap CI)")
    ax.set_ylabel("Code (prevalence among samples)")
    ax.set_title(title or f"Per-code AP, {len(codes)} most prevalent codes", pad=28)
    ax.grid(alpha=0.3, axis="x")
    ax.legend(loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=n_series, fontsize=9, frameon=False)
    return _save(fig, path)


def plot_at_k(
    at_k: Mapping[str, Mapping[str, float | None]],
    path: str | Path,
    *,
    title: str = "Top-k predicted codes per sample",
) -> Path:
    """Grouped bars of precision@k (left) and recall@k (right) for each k found in the dicts
    (``precision_recall_at_k`` output: keys ``precision@k`` and ``recall@k``)."""
    first = next(iter(at_k.values()), {})
    ks = sorted({int(key.split("@")[1]) for key in first if "@" in key})
    fig, axes = plt.subplots(1, 2, figsize=(WIDTH_IN, 3.8), sharey=True)
    n_series = max(len(at_k), 1)
    width = 0.8 / n_series
    x = np.arange(len(ks))
    for ax, kind in zip(axes, ("precision", "recall")):
        for i, (name, values) in enumerate(at_k.items()):
            heights = [_num(values.get(f"{kind}@{k}")) for k in ks]
            bars = ax.bar(x + (i - (n_series - 1) / 2) * width, np.nan_to_num(heights), width, label=name)
            for bar in bars:
                bar.set_color(_color(i))
            ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=1)
        ax.set_xticks(x, [f"k={k}" for k in ks])
        ax.set_ylim(0, 1.08)
        ax.set_title(f"{kind.capitalize()}@k")
        ax.set_xlabel("Number of top-ranked codes per sample (k)")
        ax.grid(alpha=0.3, axis="y")
    axes[0].set_ylabel("Mean over samples (0 to 1)")
    axes[0].legend(loc="upper left", fontsize=8)
    fig.suptitle(title)
    return _save(fig, path)


def _num(value: Any) -> float:
    return float("nan") if value is None else float(value)
