"""Batch risk scoring throughput: patients per second, end to end and for the model alone.

Trains nothing: a fine-tuned model of the default size is built with random weights (speed does not depend
on the weights) over the vocabulary of a synthetic cohort, saved as a bundle, and ``behrt-rope predict`` is
run on that cohort. In the same run, on the same patients and the same length-bucketed batches:

- ``ours_model_only``: :class:`behrt_rope.scoring.scorer.Scorer` (what ``predict`` uses);
- ``baseline_previous_scorer``: ``behrt_rope.training.inference.score``, the per-item Dataset + collate
  loop ``predict`` used before (batches of 256, sorted by length);
- ``hf_roformer_model_only``: Hugging Face ``RoFormerModel`` of the same size (hidden, layers, heads,
  feed-forward, vocabulary) on the same padded batches, encoder only (needs the ``bench`` extra);
- with a CPU or GPU that computes bf16 natively, ``ours_model_only_bf16`` and the ranking check.

    python benchmarks/predict_throughput.py [--patients 50000] [--device cpu] [--threads N]

Each variant reports wall seconds and CPU seconds of this process (all its threads): on a shared machine
patients per CPU second with ``--threads 1`` is the steady per-core figure. ``ours_model_only`` is also
timed at the other ``--compare-batch-tokens``.

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from behrt_rope import schema as S
from behrt_rope.data.sequences import Sequences, load_tokens, load_vocabulary
from behrt_rope.etl.config import EtlConfig
from behrt_rope.etl.runner import run_etl
from behrt_rope.model.config import ModelConfig
from behrt_rope.model.heads import BehrtForMultiLabel
from behrt_rope.scoring.batches import iter_batches
from behrt_rope.scoring.precision import native_bf16
from behrt_rope.scoring.scorer import Scorer
from behrt_rope.training.bundle import save_bundle
from behrt_rope.training.inference import score
from pipelines import predict
from synthetic_data.generator import SynthConfig, generate

N_LABELS = 80


def build_model_dir(root: Path, patients: int, seed: int, **model: Any) -> tuple[Path, Path]:
    """A synthetic cohort on disk and a (random-weight) fine-tuned model bundle over its vocabulary;
    ``model``: ModelConfig fields other than the default's."""
    raw = root / "raw"
    raw.mkdir()
    p, e = generate(SynthConfig(patients=patients, seed=seed))
    p.to_csv(raw / "patients.csv", index=False)
    e.to_csv(raw / "events.csv", index=False)
    etl_config = EtlConfig(code_truncate=3)
    run_etl(raw, root / "etl", etl_config, progress=False)
    vocab = load_vocabulary(root / "etl")["token"].tolist()
    torch.manual_seed(seed)
    config = ModelConfig(vocab_size=len(vocab), **model)
    labels = list(range(S.N_SPECIAL, S.N_SPECIAL + N_LABELS))
    model = BehrtForMultiLabel(config, N_LABELS, label_token_ids=labels)
    model_dir = root / "model"
    model_dir.mkdir()
    (model_dir / S.DONE_MARKER).write_text("finetune\n")  # a finished fine-tuning output, as predict expects
    save_bundle(
        model_dir,
        "multilabel",
        config,
        model.state_dict(),
        vocab=vocab,
        label_token_ids=labels,
        labels=[vocab[i] for i in labels],
        task={"name": "next_visit"},
        pooling=model.pooling,
        etl_settings={"etl": {"format": "visits", "code_truncate": 3}},
    )
    return raw, model_dir


def time_it(fn: Callable[[], Any], repeat: int) -> tuple[float, float]:
    """Best wall time and best CPU time (this process, all threads) of ``repeat`` runs, in seconds."""
    wall, cpu = float("inf"), float("inf")
    for _ in range(repeat):
        started, started_cpu = time.perf_counter(), time.process_time()
        fn()
        wall = min(wall, time.perf_counter() - started)
        cpu = min(cpu, time.process_time() - started_cpu)
    return wall, cpu


def hf_roformer(config: ModelConfig) -> Callable[[Sequences, int], None]:
    """Hugging Face RoFormerModel of the same size, run over the same length buckets as ours."""
    from transformers import RoFormerConfig, RoFormerModel

    hf = RoFormerModel(
        RoFormerConfig(
            vocab_size=config.vocab_size,
            embedding_size=config.hidden_size,
            hidden_size=config.hidden_size,
            num_hidden_layers=config.num_layers,
            num_attention_heads=config.num_heads,
            intermediate_size=config.intermediate_size,
            max_position_embeddings=512,
            type_vocab_size=config.num_segments,
        )
    ).eval()

    @torch.inference_mode()
    def run(seqs: Sequences, max_tokens: int) -> None:
        for _, batch in iter_batches(seqs, max_tokens, score_last=False):
            hf(
                input_ids=batch["token_ids"],
                attention_mask=batch["attention_mask"].long(),
                token_type_ids=batch["segments"],
            )

    return run


def rate(n: int, times: tuple[float, float]) -> dict[str, float]:
    """Patients per wall second and per CPU second (the steadier figure on a shared machine)."""
    wall, cpu = times
    return {
        "seconds": round(wall, 3),
        "patients_per_second": round(n / wall),
        "cpu_seconds": round(cpu, 3),
        "patients_per_cpu_second": round(n / cpu),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--patients", type=int, default=50000)
    parser.add_argument("--baseline-patients", type=int, default=5000, help="patients for the previous scorer")
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--compare-batch-tokens", type=int, nargs="*", default=[32768], help="other batch sizes")
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0: torch's default")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    result: dict[str, Any] = {"device": str(device), "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        raw, model_dir = build_model_dir(root, args.patients, args.seed)
        seqs = load_tokens(root / "etl")
        n = len(seqs)
        from behrt_rope.training.bundle import load_bundle
        from behrt_rope.training.inference import multilabel_model

        model = multilabel_model(load_bundle(model_dir, "multilabel"))
        result.update(
            patients=n,
            events=int(sum(1 for _ in (raw / "events.csv").open()) - 1),
            mean_tokens_per_patient=round(float(seqs.lengths.mean()), 1),
            model=f"default ModelConfig ({sum(p.numel() for p in model.parameters()):,} parameters), "
            f"{model.pooling} pooling, {N_LABELS} labels",
            native_bf16=native_bf16(device),
            load_average_1m_start=round(os.getloadavg()[0], 2),
        )
        config = predict.Config(
            model=str(model_dir),
            input=str(raw),
            out=str(root / "pred.parquet"),
            device=args.device,
            progress=False,
            batch_tokens=args.batch_tokens,
        )
        result["ours_end_to_end"] = rate(n, time_it(lambda: predict.run(config), args.repeat))
        result["ours_end_to_end"]["includes"] = "read CSV, ETL with the model's settings, scoring, write Parquet"
        result["ours_end_to_end"]["shards"] = json.loads((root / "pred.summary.json").read_text())["shards"]
        fp32 = Scorer(model, device, "fp32", args.batch_tokens)
        result["ours_model_only"] = rate(n, time_it(lambda: fp32.score(seqs), args.repeat))
        result["ours_model_only"]["batch_tokens"] = args.batch_tokens
        for tokens in args.compare_batch_tokens:
            other = Scorer(model, device, "fp32", tokens).score
            result[f"ours_model_only_batch_tokens_{tokens}"] = rate(n, time_it(partial(other, seqs), args.repeat))
        subset = seqs.select(np.arange(min(args.baseline_patients, n)))
        result["baseline_previous_scorer"] = rate(len(subset), time_it(lambda: score(model, subset, device=device), 1))
        result["baseline_previous_scorer"]["patients"] = len(subset)
        if not args.skip_hf:
            hf = hf_roformer(model.config)
            result["hf_roformer_model_only"] = rate(n, time_it(lambda: hf(seqs, args.batch_tokens), args.repeat))
        if native_bf16(device):
            bf16 = Scorer(model, device, "bf16", args.batch_tokens)
            result["ours_model_only_bf16"] = rate(n, time_it(lambda: bf16.score(seqs), args.repeat))
            a, b = fp32.score(seqs), bf16.score(seqs)
            result["bf16_max_abs_difference"] = float(np.abs(a - b).max())
        result["load_average_1m_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
