"""The ETL on Ray Data: input tables read by Ray Data, grouped by patient shard, each shard through the
same pure functions as the local engine.

1. The reader's plan checks every file's schema on the driver (a missing column or a wrong type stops here
   with the local engine's message); small reference tables (MEDS metadata, the OMOP concept table) are
   read on the driver and broadcast.
2. Ray Data reads the files as patient-shard pieces (:mod:`behrt_rope.engine.ray_read`); the dataset-wide
   facts (MEDS visit-marking events, OMOP float-printed codes) are reduced from them on the driver.
3. ``groupby(shard).map_groups``: each shard's pieces go through the reader's ``build`` and
   :func:`~behrt_rope.etl.runner.first_pass` (clean, structure, count train codes; tables spilled under the
   output directory).
4. The code counts are summed into the vocabulary on the driver (the global reduction); a second map writes
   each shard's tokens (:func:`~behrt_rope.etl.runner.write_shard_tokens`); the driver writes the
   quarantine, vocabulary and manifest exactly as the local engine does.

The input and output directories must be on storage that every Ray node can reach at the same path.
"""

from __future__ import annotations

import json
import pickle
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pyarrow as pa
from ray.data.context import ShuffleStrategy
from ray.data.expressions import col

from behrt_rope.engine.config import RayConfig
from behrt_rope.engine.ray_read import FACTS_SHARD, ShardPieces, shard_input
from behrt_rope.engine.runtime import init_ray, pool_size, user_errors
from behrt_rope.etl import runner
from behrt_rope.etl.codes import fit_vocabulary
from behrt_rope.etl.config import EtlConfig
from behrt_rope.etl.readers import ShardSource, source


def run_etl_on_ray(input_dir: Path, out_dir: Path, config: EtlConfig, ray_config: RayConfig) -> dict[str, Any]:
    """Like :func:`behrt_rope.etl.runner.run_etl`, with the input read and the shards processed on Ray.

    Shards: ``config.shards``, or at least one per worker. Outputs equal the local engine's (token parts
    are laid out per shard, so compare tokens after sorting by patient).
    """
    started = time.perf_counter()
    ray = init_ray(ray_config)
    workers = pool_size(ray, ray_config, use_gpus=False)
    n_shards = max(config.shards, workers)
    options = {"num_cpus": ray_config.cpus_per_worker, "concurrency": workers}
    # a sort shuffle runs as tasks; the default hash shuffle's aggregator actors hold CPUs of their own,
    # which on a small cluster leaves the tasks that consume their output waiting
    context = ray.data.DataContext.get_current()
    caller_strategy, context.shuffle_strategy = context.shuffle_strategy, ShuffleStrategy.SORT_SHUFFLE_PULL_BASED
    try:
        with user_errors():
            results = _first_pass(ray, input_dir, out_dir, config, n_shards, options)
            vocabulary = fit_vocabulary(runner.sum_train_counts(results), config.min_code_count)
            token_stats = _second_pass(ray, results, vocabulary, out_dir, options)
    finally:
        context.shuffle_strategy = caller_strategy  # the caller's Ray Data settings, as they were
    manifest = runner.finish_etl(results, vocabulary, token_stats, config, input_dir, out_dir)
    manifest["engine"] = {"name": "ray", "workers": workers}
    manifest["seconds"] = round(time.perf_counter() - started, 3)
    return manifest


def _first_pass(
    ray: ModuleType, input_dir: Path, out_dir: Path, config: EtlConfig, n_shards: int, options: dict[str, Any]
) -> list[runner.ShardResult]:
    """Read, partition by shard and run the first pass; one result per shard, in shard order."""
    src = ShardSource.open(input_dir, config)
    reader, plan = src.reader, src.plan
    lookups = src.lookups.load() if hasattr(src.lookups, "load") else src.lookups  # broadcast whole to the tasks
    runner.clear_outputs(out_dir)
    tmp = out_dir / runner.TMP_DIR
    pieces = ray.data.read_datasource(ShardPieces(plan, reader.id_text, src.facts, n_shards))
    pieces = pieces.materialize()  # read once: the facts and the shards both come from it
    found = pieces.filter(expr=col("shard") == FACTS_SHARD).select_columns(["facts"]).take_all()
    facts = source.merge_facts([plan.facts, *(json.loads(row["facts"]) for row in found)])
    shared = ray.put(lookups)

    def first_pass(group: pa.Table) -> dict[str, list[Any]]:
        shard = int(group["shard"][0].as_py())
        raw = reader.build(shard_input(group, plan, n_shards, facts, ray.get(shared)), config)
        return {"shard": [shard], "result": [pickle.dumps(runner.first_pass(raw, config, shard, tmp))]}

    shards = pieces.filter(expr=col("shard") != FACTS_SHARD).groupby("shard", num_partitions=n_shards)
    rows = shards.map_groups(first_pass, batch_format="pyarrow", **options).take_all()
    results = {int(r["shard"]): pickle.loads(r["result"]) for r in rows}  # our own objects, from our own tasks
    for shard in sorted(set(range(n_shards)) - set(results)):  # shards without a row: nothing to read
        data = source.empty_shard(plan, shard, n_shards, facts, lookups)
        results[shard] = runner.first_pass(reader.build(data, config), config, shard, tmp)
    return [results[shard] for shard in range(n_shards)]


def _second_pass(
    ray: ModuleType, results: list[runner.ShardResult], vocabulary: Any, out_dir: Path, options: dict[str, Any]
) -> list[dict[str, Any]]:
    """Write each shard's token part; its token statistics, in shard order."""
    tmp = out_dir / runner.TMP_DIR

    def second_pass(batch: dict[str, np.ndarray]) -> dict[str, Any]:
        shard = int(batch["shard"][0])
        stats = runner.write_shard_tokens(pickle.loads(batch["result"][0]), vocabulary, shard, out_dir, tmp)
        return {"shard": [shard], "stats": [pickle.dumps(stats)]}

    items = [{"shard": k, "result": pickle.dumps(r)} for k, r in enumerate(results)]
    spilled = ray.data.from_items(items, override_num_blocks=len(items))  # one task per shard
    rows = sorted(spilled.map_batches(second_pass, batch_size=1, **options).take_all(), key=lambda r: r["shard"])
    return [pickle.loads(r["stats"]) for r in rows]
