"""RoPE against BEHRT's absolute sinusoidal positions: tuning-split MLM loss after a fixed number of steps.

    python benchmarks/rope_vs_absolute.py [--steps 300] [--seeds 0 1 2] [--patients 2000]
                                          [--hidden-size 64] [--layers 2] [--heads 4] [--batch-size 32]
                                          [--learning-rate 1e-3] [--absolute-table-scale 1.0]

Generates a synthetic cohort (``synthetic_data.generator``, seed 0), runs the real ETL into a temporary
directory, and pre-trains, for each seed and each ``model.position_encoding`` (``rope`` and ``absolute``),
a small default-shaped model for exactly ``--steps`` optimizer steps with the library's own pieces: the
same loaders as ``behrt-rope pretrain`` (:func:`~behrt_rope.training.loaders.make_loader` with
:class:`~behrt_rope.data.datasets.MlmCollator`, length-bucketed batches), :class:`MaskedLMTask` (AdamW,
warm-up then linear decay, gradient clipping) and :func:`~behrt_rope.training.trainer.build_trainer`, with
the learning rate pinned here (``--learning-rate``) so that a change of the library default does not move
the figures; every other trainer setting is the library's default. The
final weights (no checkpoint selection) are then scored on the tuning split with its fixed masks
(``MlmCollator(fixed=True)``), exactly as ``pretrain`` reports ``mlm_loss``.

A seed sets the initial weights, the training masks and the batch order; both encodings see the same ones
(the absolute table has no parameters, so the two models draw identical initial weights). Positions are the
default ``position_source="visit"`` for both. Prints ONE JSON object: per-seed losses (and top-1 precision /
top-5 recall), their mean and standard deviation per encoding, and the paired difference absolute - rope
(positive: RoPE has the lower loss).

``--absolute-table-scale`` is a diagnostic, not a model setting: it multiplies BEHRT's sinusoidal table (whose
entries have an RMS of 0.71, against 0.02 for the freshly initialised code embeddings it is added to) by the
given factor for the absolute arm, by patching ``behrt_rope.model.embeddings.sinusoidal_table`` in this
process. 0.028 brings the table to the code embeddings' scale. See ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ENCODINGS = ("rope", "absolute")


def prepare(work: Path, patients: int) -> Path:
    """The synthetic cohort through the real ETL; returns the ETL directory."""
    from behrt_rope import schema as S
    from behrt_rope.etl.config import EtlConfig
    from behrt_rope.etl.runner import run_etl
    from synthetic_data.generator import SynthConfig, generate

    raw, etl = work / "raw", work / "etl"
    raw.mkdir()
    patients_df, events_df = generate(SynthConfig(patients=patients, seed=0))
    patients_df.to_csv(raw / f"{S.PATIENTS_TABLE}.csv", index=False)
    events_df.to_csv(raw / f"{S.EVENTS_TABLE}.csv", index=False)
    run_etl(raw, etl, EtlConfig(), progress=False)
    return etl


def train_and_score(etl: Path, out: Path, encoding: str, seed: int, args: argparse.Namespace) -> dict[str, float]:
    """Pre-train for exactly ``args.steps`` steps; the tuning-split MLM metrics of the final weights."""
    import pytorch_lightning as pl

    from behrt_rope import schema as S
    from behrt_rope.data.datasets import MlmCollator, PatientDataset
    from behrt_rope.data.sequences import load_tokens, load_vocabulary
    from behrt_rope.model import ModelConfig
    from behrt_rope.training.config import TrainerConfig
    from behrt_rope.training.loaders import make_loader
    from behrt_rope.training.tasks import MaskedLMTask
    from behrt_rope.training.trainer import build_trainer

    seqs, vocab = load_tokens(etl), len(load_vocabulary(etl))
    train, tuning = PatientDataset(seqs.split(S.TRAIN)), PatientDataset(seqs.split(S.TUNING))
    model_config = ModelConfig(
        vocab_size=vocab,
        hidden_size=args.hidden_size,
        num_layers=args.layers,
        num_heads=args.heads,
        intermediate_size=2 * args.hidden_size,
        position_encoding=encoding,
    )
    tc = TrainerConfig(
        max_epochs=1_000,
        max_steps=args.steps,
        batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        seed=seed,
        accelerator="cpu",
        devices="1",
        progress_bar=False,
        early_stopping_patience=0,
        log_every_n_steps=50,
    )
    pl.seed_everything(seed, verbose=False)
    from behrt_rope.model import embeddings

    table = embeddings.sinusoidal_table
    scale = args.absolute_table_scale

    def scaled_table(max_positions: int, dim: int) -> Any:
        return table(max_positions, dim) * scale

    with mock.patch.object(embeddings, "sinusoidal_table", scaled_table if scale != 1.0 else table):
        task = MaskedLMTask(model_config, tc)
    trainer = build_trainer(tc, out, monitor=None, mode="min")
    trainer.fit(task, make_loader(train, tc, MlmCollator(vocab, seed), shuffle=True))
    assert trainer.global_step == args.steps
    tuning_loader = make_loader(tuning, tc, MlmCollator(vocab, seed=0, fixed=True), shuffle=False)
    results = trainer.validate(task, tuning_loader, verbose=False)[0]
    return {
        "mlm_loss": round(float(results["val/loss"]), 5),
        "top1_precision": round(float(results["val/top1_precision"]), 5),
        "top5_recall": round(float(results["val/top5_recall"]), 5),
        "masked_tokens": int(results["val/masked_tokens"]),
    }


def summary(values: list[float]) -> dict[str, float]:
    return {
        "mean": round(statistics.mean(values), 5),
        "std": round(statistics.stdev(values), 5) if len(values) > 1 else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--patients", type=int, default=2000)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=1e-3, help="peak AdamW learning rate")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    parser.add_argument(
        "--absolute-table-scale",
        type=float,
        default=1.0,
        help="diagnostic: multiply the absolute arm's sinusoidal table by this (1: BEHRT's table)",
    )
    args = parser.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    started = time.perf_counter()
    per_seed: dict[str, dict[str, dict[str, float]]] = {encoding: {} for encoding in ENCODINGS}
    with tempfile.TemporaryDirectory(prefix="rope_vs_absolute_") as tmp:
        etl = prepare(Path(tmp), args.patients)
        for seed in args.seeds:
            for encoding in ENCODINGS:
                out = Path(tmp) / f"{encoding}-{seed}"
                per_seed[encoding][str(seed)] = train_and_score(etl, out, encoding, seed, args)
                print(f"seed {seed} {encoding}: {per_seed[encoding][str(seed)]}", file=sys.stderr)
    losses = {e: [per_seed[e][str(s)]["mlm_loss"] for s in args.seeds] for e in ENCODINGS}
    differences = [a - r for a, r in zip(losses["absolute"], losses["rope"])]
    report: dict[str, Any] = {
        "benchmark": "rope_vs_absolute",
        "patients": args.patients,
        "steps": args.steps,
        "seeds": args.seeds,
        "batch_size": args.batch_size,
        "learning_rate": args.learning_rate,
        "model": {
            "hidden_size": args.hidden_size,
            "num_layers": args.layers,
            "num_heads": args.heads,
            "intermediate_size": 2 * args.hidden_size,
            "position_source": "visit",
        },
        "absolute_table_scale": args.absolute_table_scale,
        "per_seed": per_seed,
        "mlm_loss": {e: summary(losses[e]) for e in ENCODINGS},
        "top1_precision": {e: summary([per_seed[e][str(s)]["top1_precision"] for s in args.seeds]) for e in ENCODINGS},
        "difference_absolute_minus_rope": {
            "per_seed": [round(d, 5) for d in differences],
            **summary(differences),
            "rope_better_in": f"{sum(d > 0 for d in differences)}/{len(differences)} seeds",
        },
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "wall_seconds": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
