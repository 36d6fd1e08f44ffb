"""Does a fine-tuned model's head gain from more training on its own, frozen encoder states?

    python benchmarks/head_refit.py --etl ETL_DIR --model FINETUNE_DIR [--epochs 12] [--lr 1e-3]
                                    [--weight-decay 0.01] [--seed 0]

A diagnostic for the question "is the head under-trained or over-fitted at the checkpoint ``finetune`` kept?"
The encoder of a visit-pooled model (``FINETUNE_DIR``) runs once, without dropout, over the train and tuning
splits of ``ETL_DIR``; its states are kept in memory. The head (classifier, age basis, label attention,
label-code maps; not the encoder, not the frozen sparse time path) then trains on those states for
``--epochs`` passes of AdamW (constant ``--lr``; ``--weight-decay`` on its weight matrices: the classifier's,
the votes' and the queries'), batches of 32 patients, with dropout, and is scored on the tuning split after
every pass (the deep part on the train split too, to tell over-fitting from under-fitting). With the states
cached a pass costs a few seconds for 4,000 patients, so schedules and regularisers of the head can be
compared in minutes instead of full fine-tuning runs.

The baseline is the saved head itself (``epoch 0``). Tuning macro AP that rises over the passes means the
head stopped short of what the states allow; that falls means it over-fits as a whole from there. Only the
train and tuning splits are read. Prints JSON: tuning macro AP of the deep part and of the model (deep part
mixed with the saved sparse time path at its saved share) and train macro AP of the deep part per pass, the
best pass and the CPU seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from behrt_rope import schema as S  # noqa: E402
from behrt_rope.data.batching import model_inputs  # noqa: E402
from behrt_rope.data.datasets import labelled_dataset  # noqa: E402
from behrt_rope.data.labels import TaskConfig, build_samples, label_index  # noqa: E402
from behrt_rope.data.sequences import Sequences, load_tokens  # noqa: E402
from behrt_rope.model.heads import BehrtForMultiLabel, multilabel_loss  # noqa: E402
from behrt_rope.training.bundle import load_bundle  # noqa: E402
from behrt_rope.training.inference import multilabel_model  # noqa: E402
from behrt_rope.training.tasks import macro_average_precision  # noqa: E402

DECAYED = ("classifier.weight", "label_attention.value.weight", "label_attention.query")
"""The head's per-label weight matrices, which ``--weight-decay`` shrinks."""


class CachedBatch(NamedTuple):
    """One batch of patients with the frozen encoder's states: what the head needs to score it."""

    inputs: dict[str, torch.Tensor]
    score_at: torch.Tensor  # (B, T) bool
    targets: torch.Tensor  # (N, L)
    hidden: torch.Tensor  # (B, T, H)
    path: torch.Tensor | None  # (N, L) sparse time path logits, or None without the path


@torch.no_grad()
def cache_states(
    model: BehrtForMultiLabel, seqs: Sequences, label_of_token: np.ndarray, batch_size: int
) -> list[CachedBatch]:
    """Every next-visit sample of ``seqs`` in batches of ``batch_size`` patients (length-sorted), with states."""
    samples = build_samples(seqs, TaskConfig())
    dataset, collate = labelled_dataset(seqs, samples.rows, samples.cuts, samples.label_spans, label_of_token, "visit")
    order = np.argsort(dataset.lengths, kind="stable")  # type: ignore[attr-defined]
    model.eval()
    batches = []
    for start in range(0, len(order), batch_size):
        batch = collate([dataset[int(i)] for i in order[start : start + batch_size]])
        inputs, score_at = model_inputs(batch), batch["score_at"]
        hidden = model.encoder(**inputs, visit_causal=True)
        path = None
        if model.sparse_time is not None:
            ids, visits, ages = inputs["token_ids"], inputs["visit_index"], inputs["ages"]
            path = model.path_logits(ids, visits, ages, score_at, inputs.get("sex"))
        batches.append(CachedBatch(inputs, score_at, batch["targets"], hidden, path))
    return batches


def head_logits(model: BehrtForMultiLabel, batch: CachedBatch) -> torch.Tensor:
    """``(N, L)`` deep-part logits of a cached batch."""
    x = batch.inputs
    return model.visit_head_logits(
        batch.hidden, x["token_ids"], x["ages"], x["visit_index"], batch.score_at, x.get("sex")
    )


def split_scores(model: BehrtForMultiLabel, batches: list[CachedBatch], with_model: bool = True) -> dict[str, float]:
    """Macro AP of the deep part on ``batches`` and, with ``with_model``, of the model (the deep part mixed with
    the saved path)."""
    model.eval()
    with torch.no_grad():
        deep = torch.cat([head_logits(model, b) for b in batches]).float()
    y = torch.cat([b.targets for b in batches]).numpy()
    result = {"deep": round(macro_average_precision(y, deep.numpy()), 4)}
    if with_model and model.sparse_time is not None:
        path = torch.cat([b.path for b in batches if b.path is not None])
        result["model"] = round(macro_average_precision(y, model.mix_logits(deep, path).numpy()), 4)
    return result


def head_optimizer(model: BehrtForMultiLabel, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW over the head (not the encoder, not the sparse time path); decay on :data:`DECAYED` only. Sets
    ``requires_grad`` off on the encoder's parameters, so a backward pass stops at the cached states."""
    for param in model.encoder.parameters():
        param.requires_grad_(False)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad and not n.startswith("sparse_time")]
    decayed = [p for n, p in named if n in DECAYED]
    others = [p for n, p in named if n not in DECAYED]
    groups = [{"params": decayed, "weight_decay": weight_decay}, {"params": others, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr)


def train_pass(
    model: BehrtForMultiLabel, optimizer: torch.optim.Optimizer, batches: list[CachedBatch], order: np.ndarray
) -> None:
    """One pass of the head over ``batches`` in ``order``, dropout on, with the fine-tuning loss."""
    model.train()
    for i in order:
        loss = multilabel_loss(head_logits(model, batches[i]), batches[i].targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--etl", required=True)
    parser.add_argument("--model", required=True, help="a `behrt-rope finetune` output on the same ETL (visit pooling)")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    started = time.process_time()
    bundle = load_bundle(args.model, "multilabel")
    model = multilabel_model(bundle)
    if model.pooling != "visit":
        sys.exit(f"{args.model}: head_refit needs a visit-pooled model, this one pools by {model.pooling!r}")
    seqs = load_tokens(args.etl)
    label_of_token = label_index(np.asarray(bundle["label_token_ids"]), len(bundle["vocab"]))
    train = cache_states(model, seqs.split(S.TRAIN), label_of_token, batch_size=32)
    tuning = cache_states(model, seqs.split(S.TUNING), label_of_token, batch_size=256)

    def scores(epoch: int) -> dict[str, float]:
        train_deep = split_scores(model, train, with_model=False)["deep"]
        return {"epoch": epoch, **split_scores(model, tuning), "train_deep": train_deep}

    passes = [scores(0)]  # the saved head: the baseline
    optimizer = head_optimizer(model, args.lr, args.weight_decay)
    for epoch in range(1, args.epochs + 1):
        train_pass(model, optimizer, train, rng.permutation(len(train)))
        passes.append(scores(epoch))
        print(json.dumps(passes[-1]), flush=True)
    best = max(passes, key=lambda p: p["deep"])
    result = {
        "settings": vars(args),
        "tuning_samples": int(sum(len(b.targets) for b in tuning)),
        "labels": model.num_labels,
        "saved_head": passes[0],
        "passes": passes,
        "best_pass_by_deep_ap": best["epoch"],
        "cpu_seconds": round(time.process_time() - started, 1),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
