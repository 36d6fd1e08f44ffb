"""Training throughput: our BEHRT-RoPE MLM against Hugging Face ``RoFormerForMaskedLM`` of the same size.

    python benchmarks/train_throughput.py [--steps 30] [--warmup 5] [--device cpu|cuda|auto]
                                          [--batch-size 64] [--patients 2000] [--threads N] [--rounds 3]
                                          [--profile]

Generates a synthetic cohort (``synthetic_data.generator``), runs the real ETL into a temporary directory
and draws real training batches from its train split exactly as ``behrt-rope pretrain`` does
(:class:`~behrt_rope.data.datasets.MlmCollator` + :class:`~behrt_rope.data.batching.BucketBatchSampler`),
so sequence lengths and padding are realistic. The batches are saved once; then each variant runs in a
fresh subprocess (so that peak memories stay apart) on the same batches in the same order, alternating
``ours, reference, ours, reference, ...`` for ``--rounds`` rounds. Each variant's figures are those of its
best round (the least disturbed by other load), every round's tokens/s alongside; the speed-up is the
median over rounds of the paired ratio ours / reference of adjacent runs, which other load on the machine
disturbs least (with the 1-minute load average at the start of each run, to judge it by):

* ``behrt_rope``: :class:`~behrt_rope.model.BehrtForMaskedLM` with the DEFAULT
  :class:`~behrt_rope.model.ModelConfig` (only ``vocab_size`` set from the ETL vocabulary);
* ``hf_roformer``: ``transformers.RoFormerForMaskedLM`` with the same hidden size, layers, heads,
  intermediate size, vocabulary, dropout (0.1 hidden, 0.0 attention) and 512 positions, fed the same padded
  ids (``token_type_ids`` = segments), the same attention mask and the same labels at the masked positions.

A step is forward + backward + ``torch.optim.AdamW`` step (lr 5e-4, weight decay 0.01, all parameters,
for both). ``--warmup`` steps are run first and not timed. Tokens/s counts non-padding tokens. On CUDA both
run under bf16 autocast and are synchronised around each step; peak memory is then
``torch.cuda.max_memory_allocated``. On CPU it is the subprocess's ``ru_maxrss`` (which includes the
interpreter, torch and the batches: ``rss_after_imports_mb`` gives that floor). ``--profile`` adds the top
operators of a few profiled steps (``torch.profiler``) per variant. Prints ONE JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VARIANTS = ("behrt_rope", "hf_roformer")
LEARNING_RATE, WEIGHT_DECAY = 5e-4, 0.01


# ---------------------------------------------------------------------------------------------------------
# Batches: real ETL output of the synthetic cohort
# ---------------------------------------------------------------------------------------------------------
def make_batches(work: Path, patients: int, batch_size: int, count: int, seed: int) -> dict[str, Any]:
    """ETL the cohort and save ``count`` training batches to ``work/batches.pt``; returns data facts."""
    import numpy as np
    import torch

    from behrt_rope import schema as S
    from behrt_rope.data.batching import BucketBatchSampler
    from behrt_rope.data.datasets import MlmCollator, PatientDataset
    from behrt_rope.data.sequences import load_tokens, load_vocabulary
    from behrt_rope.etl.config import EtlConfig
    from behrt_rope.etl.runner import run_etl
    from synthetic_data.generator import SynthConfig, generate

    raw, etl = work / "raw", work / "etl"
    raw.mkdir()
    patients_df, events_df = generate(SynthConfig(patients=patients, seed=seed))
    patients_df.to_csv(raw / f"{S.PATIENTS_TABLE}.csv", index=False)
    events_df.to_csv(raw / f"{S.EVENTS_TABLE}.csv", index=False)
    run_etl(raw, etl, EtlConfig(), progress=False)
    vocab_size = len(load_vocabulary(etl))
    train = PatientDataset(load_tokens(etl).split(S.TRAIN))
    collate = MlmCollator(vocab_size, seed)
    batches: list[dict[str, torch.Tensor]] = []
    epoch = 0
    while len(batches) < count:  # as many epochs as it takes
        sampler = BucketBatchSampler(train.lengths, batch_size, 50, shuffle=True, seed=seed)
        sampler.set_epoch(epoch)
        for indices in sampler:
            batch = collate([train[i] for i in indices])
            batch.pop("index", None)
            batches.append(batch)
            if len(batches) == count:
                break
        epoch += 1
    torch.save({"vocab_size": vocab_size, "batches": batches}, work / "batches.pt")
    lengths = np.array([int(b["attention_mask"].sum()) for b in batches])
    slots = np.array([b["attention_mask"].numel() for b in batches])
    return {
        "patients": patients,
        "train_patients": len(train),
        "vocab_size": vocab_size,
        "mean_tokens_per_patient": round(float(train.lengths.mean()), 1),
        "max_tokens_per_patient": int(train.lengths.max()),
        "mean_padded_length": round(float(np.mean([b["token_ids"].shape[1] for b in batches])), 1),
        "padding_share": round(1.0 - float(lengths.sum() / slots.sum()), 4),
        "real_tokens_per_batch": round(float(lengths.mean()), 1),
    }


# ---------------------------------------------------------------------------------------------------------
# The two models (built inside the measuring subprocess)
# ---------------------------------------------------------------------------------------------------------
def build(variant: str, vocab_size: int) -> tuple[Any, Any]:
    """(model, step function computing the loss of one batch)."""
    from behrt_rope.model import BehrtForMaskedLM, ModelConfig

    config = ModelConfig(vocab_size=vocab_size)
    if variant == "behrt_rope":
        model = BehrtForMaskedLM(config)

        def loss_of(batch: dict[str, Any]) -> Any:
            return model(
                batch["token_ids"],
                batch["ages"],
                batch["segments"],
                batch["visit_index"],
                batch["attention_mask"],
                batch["labels"],
            ).loss

        return model, loss_of
    from transformers import RoFormerConfig, RoFormerForMaskedLM

    reference = RoFormerForMaskedLM(
        RoFormerConfig(
            vocab_size=vocab_size,
            embedding_size=config.hidden_size,
            hidden_size=config.hidden_size,
            num_hidden_layers=config.num_layers,
            num_attention_heads=config.num_heads,
            intermediate_size=config.intermediate_size,
            hidden_act="gelu",
            hidden_dropout_prob=config.dropout,
            attention_probs_dropout_prob=config.attention_dropout,
            max_position_embeddings=config.max_positions,
            type_vocab_size=config.num_segments,
            layer_norm_eps=config.layer_norm_eps,
            pad_token_id=0,
        )
    )

    def reference_loss(batch: dict[str, Any]) -> Any:
        return reference(
            input_ids=batch["token_ids"],
            attention_mask=batch["attention_mask"].long(),
            token_type_ids=batch["segments"],
            labels=batch["labels"],
        ).loss

    return reference, reference_loss


def measure(
    variant: str, batches_file: Path, steps: int, warmup: int, device_name: str, threads: int, profile: bool
) -> dict[str, Any]:
    """Train ``warmup + steps`` steps; the timing, memory and (optionally) profile of the timed ones."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    rss_after_imports = _max_rss_mb()
    device = torch.device(device_name)
    saved = torch.load(batches_file, weights_only=True)
    batches = [{k: v.to(device) for k, v in b.items()} for b in saved["batches"]]
    torch.manual_seed(0)
    model, loss_of = build(variant, saved["vocab_size"])
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY)
    cuda = device.type == "cuda"

    def step(batch: dict[str, Any]) -> float:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = loss_of(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss)  # a host sync: the step is finished when this returns

    for batch in batches[:warmup]:
        step(batch)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    timed = batches[warmup : warmup + steps]
    seconds, losses = [], []
    for batch in timed:
        start = time.perf_counter()
        losses.append(step(batch))
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    total = sum(seconds)
    tokens = sum(int(b["attention_mask"].sum()) for b in timed)
    result: dict[str, Any] = {
        "tokens_per_s": round(tokens / total, 1),
        "ms_per_step": round(1000 * total / len(timed), 2),
        "ms_per_step_median": round(1000 * statistics.median(seconds), 2),
        "peak_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1) if cuda else round(_max_rss_mb(), 1),
        "parameters": sum(p.numel() for p in model.parameters()),
        "first_timed_loss": round(losses[0], 4),
        "torch_threads": torch.get_num_threads(),
    }
    if not cuda:
        result["rss_after_imports_mb"] = round(rss_after_imports, 1)
    if profile:
        result["profile_top_ops"] = _profile(step, timed[:5], cuda)
    return result


def _profile(step: Any, batches: list[dict[str, Any]], cuda: bool) -> dict[str, list[str]]:
    """The ten operators with the most self time over ``batches`` (CPU time; on CUDA also device time), and
    on CUDA the per-step count of kernel launches and host syncs, which bound a small model's step there."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch_profile(activities=activities) as prof:
        for batch in batches:
            step(batch)
    averages, n = prof.key_averages(), len(batches)

    def top(key: str) -> list[str]:
        events = sorted(averages, key=lambda e: getattr(e, key), reverse=True)[:10]
        return [f"{e.key}: {getattr(e, key) / 1000 / n:.2f} ms/step ({e.count // n} calls)" for e in events]

    out = {"self_cpu": top("self_cpu_time_total")}
    if cuda:
        out["self_cuda"] = top("self_device_time_total")
        counts = {e.key: e.count // n for e in averages}
        out["per_step"] = [
            f"{name}: {counts.get(name, 0)}"
            for name in ("cudaLaunchKernel", "cudaStreamSynchronize", "cudaMemcpyAsync", "aten::item", "aten::nonzero")
        ]
    return out


def _max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


# ---------------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto (cuda when available)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--patients", type=int, default=2000, help="synthetic cohort size")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs per variant; the best is kept")
    parser.add_argument("--profile", action="store_true", help="add each variant's top operators")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--batches", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:  # inside a measuring subprocess
        result = measure(args.worker, args.batches, args.steps, args.warmup, args.device, args.threads, args.profile)
        print(json.dumps(result))
        return

    import torch

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory(prefix="train_throughput_") as tmp:
        work = Path(tmp)
        data = make_batches(work, args.patients, args.batch_size, args.warmup + args.steps, args.seed)
        rounds: dict[str, list[dict[str, Any]]] = {variant: [] for variant in VARIANTS}
        loads = []
        for _ in range(args.rounds):
            for variant in VARIANTS:
                command = [
                    sys.executable,
                    __file__,
                    "--worker",
                    variant,
                    "--batches",
                    str(work / "batches.pt"),
                    "--steps",
                    str(args.steps),
                    "--warmup",
                    str(args.warmup),
                    "--device",
                    device,
                    "--threads",
                    str(args.threads),
                    *(["--profile"] if args.profile else []),
                ]
                loads.append(os.getloadavg()[0])
                done = subprocess.run(command, capture_output=True, text=True, check=False)
                if done.returncode:
                    raise SystemExit(f"{variant} failed:\n{done.stderr[-4000:]}")
                rounds[variant].append(json.loads(done.stdout.strip().splitlines()[-1]))
        results = {}
        for variant, runs in rounds.items():
            best = max(runs, key=lambda r: r["tokens_per_s"])
            results[variant] = {**best, "tokens_per_s_all_rounds": [r["tokens_per_s"] for r in runs]}
    ours, reference = results["behrt_rope"], results["hf_roformer"]
    paired = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(rounds["behrt_rope"], rounds["hf_roformer"])]
    import transformers

    report = {
        "benchmark": "train_throughput",
        "device": device,
        "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
        "precision": "bf16-autocast" if device == "cuda" else "fp32",
        "cpu_count": os.cpu_count(),
        "torch_threads": ours["torch_threads"],
        "load_average_1m_at_start_of_each_run": [round(x, 2) for x in loads],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "batch_size": args.batch_size,
        "warmup_steps": args.warmup,
        "timed_steps": args.steps,
        "rounds": args.rounds,
        "data": data,
        "variants": results,
        "speedup_tokens_per_s": round(statistics.median(paired), 2),
        "speedup_per_round": [round(x, 2) for x in paired],
        "speedup_best_vs_best": round(ours["tokens_per_s"] / reference["tokens_per_s"], 2),
        "peak_memory_ratio": round(ours["peak_mb"] / reference["peak_mb"], 2),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
