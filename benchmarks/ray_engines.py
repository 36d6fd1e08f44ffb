"""The ETL (events/s) and ``predict`` (patients/s) on the local engine against Ray with 1 and 2 workers.

One synthetic cohort (visits format, CSV) and one random-weight model of the default size (see
``predict_throughput.py``) are run through ``behrt-rope etl`` and ``behrt-rope predict`` with the same
number of patient shards on every engine:

- ``local`` (the named baseline): shards one after another in this process (torch with every thread);
- ``ray_1_worker``: one Ray task / scoring actor holding ``--cpus`` CPUs;
- ``ray_2_workers``: two Ray tasks / actors of ``--cpus / 2`` CPUs each, in parallel.

Ray runs on a local instance of ``--cpus`` CPUs, started once before the timings (its start-up is reported
apart). Outputs of the engines are checked to agree (token tables; probabilities to 1e-6) before anything
is printed. Each figure is the best of ``--repeat`` runs.

    python benchmarks/ray_engines.py [--patients 20000] [--shards 4] [--cpus 2] [--repeat 2]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from predict_throughput import build_model_dir

from behrt_rope import config as config_lib
from behrt_rope import schema as S
from pipelines import etl, predict


def best_of(fn: Callable[[], Any], repeat: int) -> float:
    """Best wall time of ``repeat`` calls (seconds)."""
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def engines(cpus: int) -> dict[str, list[str]]:
    """Overrides per engine variant."""
    return {
        "local": ["engine=local"],
        "ray_1_worker": ["engine=ray", "ray.workers=1", f"ray.cpus_per_worker={cpus}"],
        "ray_2_workers": ["engine=ray", "ray.workers=2", f"ray.cpus_per_worker={max(1, cpus // 2)}"],
    }


def time_etl(raw: Path, out: Path, shards: int, overrides: list[str], repeat: int) -> float:
    argv = [f"input={raw}", f"out={out}", "progress=false", "overwrite=true", "etl.code_truncate=3"]
    config = config_lib.build(etl.Config, {}, [*argv, f"etl.shards={shards}", *overrides])
    return best_of(lambda: etl.run(config), repeat)


def time_predict(model: Path, raw: Path, out: Path, shards: int, overrides: list[str], repeat: int) -> float:
    argv = [f"model={model}", f"input={raw}", f"out={out}", "progress=false", "precision=fp32"]
    config = config_lib.build(predict.Config, {}, [*argv, f"shards={shards}", *overrides])
    return best_of(lambda: predict.run(config), repeat)


def check_same(results: dict[str, Path], read: Callable[[Path], pd.DataFrame], value: str | None) -> None:
    """Every engine's output equals the local one (``value`` column to 1e-6, the rest exactly)."""
    reference = read(results["local"])
    for name, path in results.items():
        other = read(path)
        if value is None:
            pd.testing.assert_frame_equal(reference, other)
        else:
            pd.testing.assert_frame_equal(reference.drop(columns=value), other.drop(columns=value))
            np.testing.assert_allclose(reference[value], other[value], atol=1e-6, rtol=0, err_msg=name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--patients", type=int, default=20000)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--cpus", type=int, default=2, help="CPUs of the local Ray instance")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import ray

    result: dict[str, Any] = {"cpus": os.cpu_count(), "ray": ray.__version__, "shards": args.shards}
    result["load_average_1m_start"] = round(os.getloadavg()[0], 2)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        raw, model = build_model_dir(root, args.patients, args.seed)
        events = sum(1 for _ in (raw / "events.csv").open()) - 1
        result.update(patients=args.patients, events=events)
        started = time.perf_counter()
        ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
        result["ray_start_seconds"] = round(time.perf_counter() - started, 2)
        etl_out: dict[str, Path] = {}
        pred_out: dict[str, Path] = {}
        for name, overrides in engines(args.cpus).items():
            etl_out[name] = root / f"etl_{name}"
            seconds = time_etl(raw, etl_out[name], args.shards, overrides, args.repeat)
            result[f"etl_{name}"] = {"seconds": round(seconds, 2), "events_per_second": round(events / seconds)}
            pred_out[name] = root / f"pred_{name}.parquet"
            seconds = time_predict(model, raw, pred_out[name], args.shards, overrides, args.repeat)
            scored = json.loads(pred_out[name].with_suffix(".summary.json").read_text())["patients_scored"]
            result[f"predict_{name}"] = {"seconds": round(seconds, 2), "patients_per_second": round(scored / seconds)}
            print(json.dumps({name: [result[f"etl_{name}"], result[f"predict_{name}"]]}), file=sys.stderr)
        ray.shutdown()
        check_same(
            etl_out, lambda p: pd.read_parquet(p / S.TOKENS_DIR).sort_values(S.PATIENT_ID, ignore_index=True), None
        )
        keys = [S.PATIENT_ID, S.CODE]
        check_same(pred_out, lambda p: pd.read_parquet(p).sort_values(keys, ignore_index=True), S.PROBABILITY)
        result["outputs_identical"] = True
    result["load_average_1m_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
