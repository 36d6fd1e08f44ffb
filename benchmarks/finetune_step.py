"""Fine-tuning training steps of this tree against the same steps of a named earlier revision.

    python benchmarks/finetune_step.py [--baseline-ref f5c8d0e] [--patients 600] [--steps 30] [--rounds 3]
                                       [--threads 2] [--cohort long_dense] [--work DIR]

Draws a synthetic cohort (``benchmarks/quality.py``'s cohort arguments, ``--patients`` patients), runs the ETL
once, then times ``--steps`` training steps (forward, backward, AdamW) of the DEFAULT fine-tuning model
(``finetune``'s task, labels and length-bucketed batches, seed 0, no pre-training) in two subprocesses:

* ``this_tree``: the working tree this script sits in;
* ``baseline``: ``git archive`` of ``--baseline-ref`` (default: the last commit before the token label
  attention's scoring was reworked in session 55), unpacked into a temporary directory.

Both get the same batches in the same order after 3 untimed warm-up steps; rounds alternate the two and each
variant's best round is reported, with the median of the paired ratios as the speed-up. The first step's loss of
each is printed too: a rework of the same formula must give the same loss (float rounding aside).
Prints one JSON object. Measure with nothing else running on the machine.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_BASELINE = "f5c8d0e"
"""The session-54 head: the token label attention gathered each scored visit's aggregates by advanced indexing
and joined the sink to every chunk of scored visits."""


def worker(etl: str, steps: int, threads: int) -> dict[str, float]:
    """Time ``steps`` training steps of the default fine-tuning model on ``etl`` with the ``behrt_rope`` on
    ``sys.path``; seconds per step and the first step's loss."""
    import torch

    from behrt_rope import schema as S
    from behrt_rope.data.labels import build_samples, fit_label_vocabulary, label_index, resolve_min_label_count
    from behrt_rope.data.sequences import load_tokens, load_vocabulary
    from behrt_rope.training.loaders import make_loader
    from behrt_rope.training.tasks import MultiLabelTask
    from pipelines import finetune

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = finetune.Config(data=etl, out="unused")
    seqs, vocab = load_tokens(etl), load_vocabulary(etl)
    model_config, _ = finetune._encoder_start(config, vocab["token"].tolist())
    train_seqs = seqs.split(S.TRAIN)
    samples = build_samples(train_seqs, config.task)
    labels = fit_label_vocabulary(train_seqs, samples, resolve_min_label_count(config.task, len(samples)))
    train = finetune._split_data(train_seqs, config.task, label_index(labels, len(vocab)), config.pooling, samples)
    task = MultiLabelTask(model_config, config.trainer, len(labels), config.pooling, None, labels.tolist(), 0.0)
    task.log = lambda *args, **kwargs: None  # type: ignore[method-assign]  # no trainer attached
    task.train()
    optimiser = torch.optim.AdamW(task.parameters(), lr=1e-3)
    loader = make_loader(train.dataset, config.trainer, train.collate, True)
    batches = (batch for _ in iter(int, 1) for batch in loader)  # epoch after epoch

    def step() -> float:
        loss = task.training_step(next(batches), 0)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        return float(loss.detach())

    first_loss = step()
    for _ in range(2):
        step()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    return {"seconds_per_step": (time.perf_counter() - started) / steps, "first_loss": first_loss}


def run_variant(tree: Path, etl: Path, steps: int, threads: int) -> dict[str, float]:
    """:func:`worker` in a subprocess that imports ``behrt_rope`` and ``pipelines`` from ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(threads)}
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); from finetune_step import worker; "
        "print(json.dumps(worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))"
    )
    argv = [sys.executable, "-c", code, str(Path(__file__).parent), str(etl), str(steps), str(threads)]
    done = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the step worker failed in {tree}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def baseline_tree(ref: str, into: Path) -> Path:
    """``git archive`` of ``ref`` unpacked into ``into``/baseline."""
    tree = into / "baseline"
    tree.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", ref], cwd=ROOT, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tree, filter="data")
    return tree


def cohort(work: Path, name: str, patients: int) -> Path:
    """A ``benchmarks/quality.py`` cohort drawn and run through the ETL in ``work``; the ETL directory."""
    sys.path.insert(0, str(Path(__file__).parent))
    from quality import cohort_args

    etl = work / "etl"
    for command, args in (
        ("synth", ["--out", str(work / "cohort"), "--patients", str(patients), *cohort_args(name)]),
        ("etl", ["--input", str(work / "cohort"), "--out", str(etl), "progress=false"]),
    ):
        subprocess.run([sys.executable, "-m", "behrt_rope", command, *args], cwd=ROOT, check=True, capture_output=True)
    return etl


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline-ref", default=DEFAULT_BASELINE)
    parser.add_argument("--cohort", default="long_dense")
    parser.add_argument("--patients", type=int, default=600)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work", default="", help="keep the cohort and the baseline's tree here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(args.work or scratch)
        etl = cohort(work, args.cohort, args.patients)
        trees = {"this_tree": ROOT, "baseline": baseline_tree(args.baseline_ref, work)}
        rounds: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
        for _ in range(args.rounds):
            for name, tree in trees.items():
                rounds[name].append(run_variant(tree, etl, args.steps, args.threads))
    best = {name: min(r["seconds_per_step"] for r in runs) for name, runs in rounds.items()}
    ratios = [b["seconds_per_step"] / t["seconds_per_step"] for t, b in zip(rounds["this_tree"], rounds["baseline"])]
    print(
        json.dumps(
            {
                "settings": {**vars(args), "baseline_ref": args.baseline_ref},
                "this_tree_s_per_step": round(best["this_tree"], 4),
                "baseline_s_per_step": round(best["baseline"], 4),
                "speed_up": round(statistics.median(ratios), 3),
                "paired_ratios": [round(r, 3) for r in ratios],
                "first_loss": {name: runs[0]["first_loss"] for name, runs in rounds.items()},
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
