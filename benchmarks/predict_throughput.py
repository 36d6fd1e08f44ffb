"""Batch risk scoring throughput: patients per second, end to end and for the model alone.

Trains nothing: a fine-tuned model of the default size is built with random weights (speed does not depend
on the weights) over the vocabulary of a synthetic cohort, saved as a bundle, and ``behrt-rope predict`` is
run on that cohort. Compared in the same run against a named baseline, scoring one patient at a time
(batch size 1, the straightforward loop), on the same patients.

    python benchmarks/predict_throughput.py [--patients 5000] [--device cpu] [--batch-size 256]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from behrt_rope import schema as S
from behrt_rope.data.sequences import load_tokens, load_vocabulary
from behrt_rope.etl.config import EtlConfig
from behrt_rope.etl.runner import run_etl
from behrt_rope.model.config import ModelConfig
from behrt_rope.model.heads import BehrtForMultiLabel
from behrt_rope.training.bundle import save_bundle
from behrt_rope.training.inference import score
from pipelines import predict
from synthetic_data.generator import SynthConfig, generate

N_LABELS = 80


def build_model_dir(root: Path, patients: int, seed: int) -> tuple[Path, Path]:
    """A synthetic cohort on disk and a (random-weight) fine-tuned model bundle over its vocabulary."""
    raw = root / "raw"
    raw.mkdir()
    p, e = generate(SynthConfig(patients=patients, seed=seed))
    p.to_csv(raw / "patients.csv", index=False)
    e.to_csv(raw / "events.csv", index=False)
    etl_config = EtlConfig(code_truncate=3)
    run_etl(raw, root / "etl", etl_config, progress=False)
    vocab = load_vocabulary(root / "etl")["token"].tolist()
    torch.manual_seed(seed)
    config = ModelConfig(vocab_size=len(vocab))
    model = BehrtForMultiLabel(config, N_LABELS)
    labels = list(range(S.N_SPECIAL, S.N_SPECIAL + N_LABELS))
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


def time_it(fn, repeat: int) -> float:  # type: ignore[no-untyped-def]
    """Best wall time of ``repeat`` runs (seconds)."""
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--patients", type=int, default=5000)
    parser.add_argument("--baseline-patients", type=int, default=300, help="patients scored one at a time")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        raw, model_dir = build_model_dir(root, args.patients, args.seed)
        seqs = load_tokens(root / "etl")
        from behrt_rope.training.bundle import load_bundle
        from behrt_rope.training.inference import multilabel_model

        model = multilabel_model(load_bundle(model_dir, "multilabel"))
        batched = time_it(lambda: score(model, seqs, batch_size=args.batch_size, device=device), args.repeat)
        subset = seqs.select(np.arange(min(args.baseline_patients, len(seqs))))
        one_by_one = time_it(lambda: score(model, subset, batch_size=1, device=device), 1)
        out = root / "pred.parquet"
        config = predict.Config(
            model=str(model_dir),
            input=str(raw),
            out=str(out),
            device=args.device,
            batch_size=args.batch_size,
            progress=False,
        )
        end_to_end = time_it(lambda: predict.run(config), args.repeat)
    n = len(seqs)
    result = {
        "device": str(device),
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "patients": n,
        "mean_tokens_per_patient": round(float(seqs.lengths.mean()), 1),
        "model": "default ModelConfig, visit pooling, 80 labels",
        "ours_model_only": {"seconds": round(batched, 3), "patients_per_second": round(n / batched)},
        "ours_end_to_end": {
            "seconds": round(end_to_end, 3),
            "patients_per_second": round(n / end_to_end),
            "includes": "read CSV, ETL with the model's settings, scoring, write Parquet",
        },
        "baseline_one_patient_per_batch": {
            "patients": len(subset),
            "seconds": round(one_by_one, 3),
            "patients_per_second": round(len(subset) / one_by_one),
        },
    }
    result["speedup_model_vs_baseline"] = round(
        result["ours_model_only"]["patients_per_second"]
        / result["baseline_one_patient_per_batch"]["patients_per_second"],
        1,
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
