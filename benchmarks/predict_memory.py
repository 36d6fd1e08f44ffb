"""Peak memory of ``behrt-rope predict`` against population size: bounded by the shard, not the population.

One random-weight model of the default size (see ``predict_throughput.py``; ``--small-model``: a smaller
one, for a shorter run: the data path whose memory is measured is the same) scores synthetic cohorts of
each size, each run in a fresh subprocess whose peak resident memory (``VmHWM``) is reported, with the
default settings (shards sized by ``shard_rows``) and, as the named baseline, with ``shards=1`` (the
whole input in memory at once, as ``predict`` worked before) for the sizes given to ``--baseline``.

    python benchmarks/predict_memory.py [--patients 20000 200000] [--baseline 20000 60000] [--small-model]
                                       [--shard-rows N]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from predict_throughput import build_model_dir

from synthetic_data.generator import SynthConfig, generate

CHILD = """
import json, sys, time
from behrt_rope import config as config_lib
from pipelines import predict
cfg = config_lib.build(predict.Config, {}, sys.argv[1:])
started = time.perf_counter()
predict.run(cfg)
seconds = time.perf_counter() - started
peak = next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM'))
print(json.dumps({'peak_mb': round(peak / 1024), 'seconds': round(seconds, 1)}))
"""


def run_predict(model_dir: Path, raw: Path, out: Path, *overrides: str) -> dict:
    argv = [f"model={model_dir}", f"input={raw}", f"out={out}", "progress=false", *overrides]
    done = subprocess.run([sys.executable, "-c", CHILD, *argv], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--patients", type=int, nargs="+", default=[20000, 200000])
    parser.add_argument("--baseline", type=int, nargs="*", default=[20000, 60000])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shard-rows", type=int, default=0, help="predict's shard_rows; 0: its default")
    parser.add_argument(
        "--small-model", action="store_true", help="hidden 32, 1 layer: same data path, scoring 10x+ faster"
    )
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        small = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64}
        _, model_dir = build_model_dir(root, 2000, args.seed, **(small if args.small_model else {}))
        for n in sorted(set(args.patients) | set(args.baseline)):
            raw = root / f"raw{n}"
            raw.mkdir()
            p, e = generate(SynthConfig(patients=n, seed=args.seed + 1))
            p.to_csv(raw / "patients.csv", index=False)
            e.to_csv(raw / "events.csv", index=False)
            del p
            row = {"patients": n, "events": len(e)}
            del e
            if n in args.patients:
                sized = [f"shard_rows={args.shard_rows}"] if args.shard_rows else []
                row["ours"] = run_predict(model_dir, raw, root / "pred.parquet", *sized)
                row["ours"]["shards"] = json.loads((root / "pred.summary.json").read_text())["shards"]
            if n in args.baseline:
                row["baseline_shards_1"] = run_predict(model_dir, raw, root / "pred.parquet", "shards=1")
            results.append(row)
            print(json.dumps(row), file=sys.stderr)
            for path in raw.iterdir():
                path.unlink()
    ours = [r for r in results if "ours" in r]
    report: dict = {"model": "small" if args.small_model else "default", "runs": results}
    if len(ours) >= 2:
        report["peak_ratio_largest_to_smallest"] = round(ours[-1]["ours"]["peak_mb"] / ours[0]["ours"]["peak_mb"], 2)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
