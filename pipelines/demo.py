"""``make demo``: every stage end to end on a bundled synthetic cohort, then where the report is.

Each stage runs exactly as its ``behrt-rope`` command would (the equivalent command line is printed), so
the demo doubles as a worked example. Stages already finished with the same settings are skipped.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from behrt_rope import config as config_lib
from behrt_rope import schema as S
from behrt_rope.evaluation.ceiling import both_shares, format_share
from behrt_rope.stage import setup_console_logging

SHORT = {
    "model": "BEHRT-RoPE",
    "logistic_regression": "LogReg",
    "logistic_regression_one_cut": "LogReg1cut",
    "gradient_boosting": "GradBoost",
    "sparse_time_regression": "SparseTime",
    "model_deep_part": "DeepPart",
    "model_learned_parts": "Learned",
    "oracle": "Oracle",
}
SYNTHETIC_NOTE = (
    "Synthetic data: the cohort comes from behrt-rope's own generator (synthetic_data/README.md). "
    "These figures show that the pipeline works; they say nothing about clinical performance."
)


def stages(out: Path, patients: int, seed: int, fast: bool) -> list[tuple[str, list[str]]]:
    """(command, arguments) of each stage, in order. ``fast`` shrinks everything for a smoke test."""
    cohort, etl, pre, fine = out / "cohort", out / "etl", out / "pretrain", out / "finetune"
    new = out / "new_patients"
    tiny = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.intermediate_size=64"]
    pre_args = ["trainer.max_epochs=1", *tiny] if fast else []
    fine_args = ["trainer.max_epochs=1"] if fast else []
    return [
        (
            "synth",
            [
                "--out",
                str(cohort),
                "--patients",
                str(patients),
                "--seed",
                str(seed),
                "synth.corrupt_fraction=0.002",
                "oracle=true",
                *(["oracle_replicas=100"] if fast else []),
            ],
        ),
        ("synth", ["--out", str(new), "--patients", str(max(50, patients // 25)), "--seed", str(seed + 1)]),
        # Full codes (no 3-character cut), so the oracle's codes name the label columns one to one.
        ("etl", ["--input", str(cohort), "--out", str(etl)]),
        ("pretrain", ["--data", str(etl), "--out", str(pre), *pre_args]),
        (
            "finetune",
            ["--data", str(etl), "--out", str(fine), "--pretrained", str(pre), "--task", "next_visit", *fine_args],
        ),
        (
            "evaluate",
            [
                "--model",
                str(fine),
                "--data",
                str(etl),
                "--out",
                str(out / "evaluate"),
                f"oracle={cohort}",
                f"notes={SYNTHETIC_NOTE}",
                *(["n_bootstrap=20"] if fast else []),
            ],
        ),
        ("predict", ["--model", str(fine), "--input", str(new), "--out", str(out / "predictions.parquet")]),
    ]


def run_stage(command: str, args: list[str]) -> Path:
    """Run one stage through the real CLI parser and its pipeline."""
    from behrt_rope.cli import build_parser, resolve_config

    print(f"\n$ behrt-rope {command} {shlex.join(args)}", flush=True)
    parsed = build_parser(command).parse_args([command, *args])
    module = importlib.import_module(f"pipelines.{command}")
    started = time.perf_counter()
    result = Path(module.run(resolve_config(command, parsed, module)))
    print(f"  done in {time.perf_counter() - started:.0f} s -> {result}", flush=True)
    return result


def headline(out: Path) -> str:
    """The figures a reader wants first, from the stages' metrics files."""
    metrics = json.loads((out / "evaluate" / S.METRICS_FILE).read_text())
    pre = json.loads((out / "pretrain" / S.METRICS_FILE).read_text())
    manifest = json.loads((out / "etl" / S.MANIFEST_FILE).read_text())
    columns = {"BEHRT-RoPE": metrics["model"], **{SHORT.get(k, k): v for k, v in metrics["baselines"].items()}}
    lines = [
        f"ETL: {manifest['patients']['with_tokens']} patients, "
        f"{sum(t['quarantined'] for t in manifest['tables'].values())} rows quarantined "
        f"(see {out / 'etl' / S.QUARANTINE_FILE})",
        f"Pre-training (tuning split): MLM loss {pre['mlm_loss']:.3f}, top-1 precision {pre['top1_precision']:.3f}, "
        f"top-5 recall {pre['top5_recall']:.3f}",
        f"Next-visit prediction, held-out ({metrics['model']['n_samples']} samples):",
        f"  {'':22s}" + "".join(f"{name:>12s}" for name in columns),
    ]
    for name, section, key in (
        ("macro AP", "overall", "macro_ap"),
        ("micro AP", "overall", "micro_ap"),
        ("macro AUROC", "overall", "macro_auroc"),
        ("new-onset macro AP", "new_onset", "macro_ap"),
    ):
        lines.append(f"  {name:22s}" + "".join(f"{e[section][key]:12.4f}" for e in columns.values()))
    return "\n".join(lines + ceiling_lines(metrics.get("ceiling")))


def ceiling_lines(ceiling: dict[str, Any] | None) -> list[str]:
    """Each predictor's macro AP at the oracle's cuts and the share of the gap it closes, from the every-visit
    and the one-cut logistic regression; no lines without an oracle."""
    if not ceiling:
        return []
    lines = [
        f"At one random visit per held-out patient ({ceiling['n_samples']} samples), macro AP and the share of "
        "the gap to the oracle closed from the every-visit / one-cut logistic regression (and, from the "
        "every-visit one, on codes already on file / on new onsets):"
    ]
    parts = ceiling.get("by_history") or {}
    for key, entry in ceiling["predictors"].items():
        split = " / ".join(format_share(parts[p][key]["gap_closed"], ci=False, missing="n/a") for p in parts)
        line = f"  {SHORT.get(key, key):22s}{entry['overall']['macro_ap']:12.4f}  {both_shares(entry)}"
        lines.append(f"{line:50s}({split})" if split else line)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="demo_out", help="where every stage writes")
    parser.add_argument("--patients", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--fast", action="store_true", help="tiny model, one epoch: a smoke test")
    args = parser.parse_args(argv)
    setup_console_logging()
    out = Path(args.out)
    started = time.perf_counter()
    try:
        for command, stage_args in stages(out, args.patients, args.seed, args.fast):
            run_stage(command, stage_args)
    except config_lib.ConfigError as err:
        print(f"demo: error: {err}", file=sys.stderr)
        return 1
    report = out / "evaluate" / S.REPORT_FILE
    print(f"\nDemo finished in {(time.perf_counter() - started) / 60:.1f} min.\n{headline(out)}")
    print(f"\nReport: {report.resolve()}\nPredictions: {(out / 'predictions.parquet').resolve()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
