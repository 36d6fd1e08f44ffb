"""The ETL on Ray Data: the same per-shard functions as the local engine, one Ray task per patient shard.

Pass 1 maps :func:`~behrt_rope.etl.runner.read_shard` (read, clean, structure, count train codes; tables
spilled under the output directory) over the shard numbers; the code counts are summed into the vocabulary
on the driver (the global reduction); pass 2 maps :func:`~behrt_rope.etl.runner.write_shard_tokens`; the
driver then writes the quarantine, vocabulary and manifest exactly as the local engine does. The output
directory must be on storage that every Ray node can reach.
"""

from __future__ import annotations

import pickle
import time
from pathlib import Path
from typing import Any

import numpy as np

from behrt_rope.engine.config import RayConfig
from behrt_rope.engine.runtime import init_ray, pool_size
from behrt_rope.etl import runner
from behrt_rope.etl.codes import fit_vocabulary
from behrt_rope.etl.config import EtlConfig


def run_etl_on_ray(input_dir: Path, out_dir: Path, config: EtlConfig, ray_config: RayConfig) -> dict[str, Any]:
    """Like :func:`behrt_rope.etl.runner.run_etl`, with the shards processed by Ray tasks in parallel.

    Shards: ``config.shards``, or at least one per worker. Outputs equal the local engine's (token parts
    are laid out per shard, so compare tokens after sorting by patient).
    """
    started = time.perf_counter()
    ray = init_ray(ray_config)
    workers = pool_size(ray, ray_config, use_gpus=False)
    n_shards = max(config.shards, workers)
    runner.clear_outputs(out_dir)
    tmp = out_dir / runner.TMP_DIR
    options = {"num_cpus": ray_config.cpus_per_worker, "concurrency": workers, "batch_size": 1}
    shards = ray.data.from_items([{"shard": k} for k in range(n_shards)], override_num_blocks=n_shards)

    def first_pass(batch: dict[str, np.ndarray]) -> dict[str, Any]:
        shard = int(batch["shard"][0])
        result = runner.read_shard(input_dir, config, shard, n_shards, tmp)
        return {"shard": [shard], "result": [pickle.dumps(result)]}

    rows = sorted(shards.map_batches(first_pass, **options).take_all(), key=lambda r: r["shard"])
    results = [pickle.loads(r["result"]) for r in rows]  # our own objects, from our own tasks
    vocabulary = fit_vocabulary(runner.sum_train_counts(results), config.min_code_count)

    def second_pass(batch: dict[str, np.ndarray]) -> dict[str, Any]:
        shard = int(batch["shard"][0])
        stats = runner.write_shard_tokens(pickle.loads(batch["result"][0]), vocabulary, shard, out_dir, tmp)
        return {"shard": [shard], "stats": [pickle.dumps(stats)]}

    spilled = ray.data.from_items(rows, override_num_blocks=n_shards)  # each task gets its own shard's result
    rows = sorted(spilled.map_batches(second_pass, **options).take_all(), key=lambda r: r["shard"])
    token_stats = [pickle.loads(r["stats"]) for r in rows]
    manifest = runner.finish_etl(results, vocabulary, token_stats, config, input_dir, out_dir)
    manifest["engine"] = {"name": "ray", "workers": workers}
    manifest["seconds"] = round(time.perf_counter() - started, 3)
    return manifest
