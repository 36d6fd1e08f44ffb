"""``predict`` on Ray Data: a pool of scoring actors (one per GPU, else CPU actors), one patient shard each
call, each shard's predictions written as ``part-NNNNN.parquet`` into a folder the caller renames into place.

Every actor loads the model once and calls the same functions as the local engine
(:func:`~behrt_rope.scoring.shard.prepare_shard`, :class:`~behrt_rope.scoring.scorer.Scorer`,
:func:`~pipelines.predict.score_prepared`), so probabilities equal the local engine's. The model, input and
output directories must be reachable from every Ray node.
"""

from __future__ import annotations

import io
import json
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from behrt_rope import schema as S
from behrt_rope.engine.runtime import init_ray, pool_size, user_errors

if TYPE_CHECKING:
    from pipelines.predict import Config, Job, Tally


class ShardScorer:
    """A Ray actor: the model, loaded once, scoring whole shards."""

    def __init__(self, job: Job, device: str, precision: str, max_tokens: int, max_batch: int, threads: int) -> None:
        import torch

        from behrt_rope.scoring.scorer import Scorer
        from behrt_rope.training.bundle import load_bundle
        from behrt_rope.training.inference import multilabel_model, resolve_device

        torch.set_num_threads(threads)
        self.job = job
        model = multilabel_model(load_bundle(job.model_dir, "multilabel"), job.model_dir)
        self.scorer = Scorer(model, resolve_device(device), precision, max_tokens, max_batch)  # type: ignore[arg-type]
        self.source: Any = None  # the input, planned at the first shard this actor scores

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list[Any]]:
        from behrt_rope.etl.readers import ShardSource
        from behrt_rope.scoring.shard import prepare_shard
        from pipelines.predict import score_prepared

        out: dict[str, list[Any]] = {
            "shard": [],
            "scored": [],
            "unknown": [],
            "code_events": [],
            "unscored": [],
            "quarantine": [],
            "rows": [],
            "truncation": [],
            "matched": [],
        }
        for shard in batch["shard"].tolist():
            if self.source is None:
                self.source = ShardSource.open(Path(self.job.input_dir), self.job.etl)
            prepared = prepare_shard(self.source, self.job.vocab, shard, self.job.shards, *self.job.reading())
            table = score_prepared(self.job, prepared, self.scorer)
            pq.write_table(table, Path(self.job.out_dir) / f"part-{shard:05d}.parquet")
            out["shard"].append(shard)
            out["scored"].append(len(prepared.seqs))
            out["unknown"].append(json.dumps(prepared.unknown_codes))
            out["code_events"].append(prepared.code_events)
            out["unscored"].append(_to_parquet(pa.Table.from_pandas(prepared.unscored, preserve_index=False)))
            quarantine = pa.Table.from_pandas(prepared.quarantine, schema=S.QUARANTINE, preserve_index=False)
            out["quarantine"].append(_to_parquet(quarantine))
            out["rows"].append(json.dumps(prepared.rows))
            out["truncation"].append(json.dumps(prepared.truncation))
            out["matched"].append(json.dumps(prepared.matched_codes))
        return out


def predict_on_ray(job: Job, config: Config, parts_dir: Path) -> Tally:
    """Score every shard of ``job`` on Ray, writing ``part-NNNNN.parquet`` files into ``parts_dir`` (an
    existing, empty folder: the caller's temporary name, renamed into place once the run is complete)."""
    import torch

    from pipelines.predict import Tally

    ray = init_ray(config.ray)
    use_gpus = config.device != "cpu" and ray.cluster_resources().get("GPU", 0) >= 1
    workers = pool_size(ray, config.ray, use_gpus)
    job.out_dir = str(parts_dir)
    shards = ray.data.from_items([{"shard": k} for k in range(job.shards)], override_num_blocks=job.shards)
    scored = shards.map_batches(
        ShardScorer,
        fn_constructor_args=(
            job,
            "cuda" if use_gpus else "cpu",
            config.precision,
            config.batch_tokens,
            config.batch_size,
            config.ray.cpus_per_worker if not use_gpus else torch.get_num_threads(),
        ),
        batch_size=1,
        concurrency=workers,
        num_cpus=config.ray.cpus_per_worker,
        num_gpus=1 if use_gpus else 0,
    )
    tally = Tally()
    with user_errors():  # an input error found by an actor reads as with the local engine
        rows = scored.take_all()
    for row in sorted(rows, key=lambda r: r["shard"]):
        unknown = Counter(json.loads(row["unknown"]))
        tally.add(
            int(row["scored"]),
            _from_parquet(row["unscored"]),
            _from_parquet(row["quarantine"]),
            unknown,
            int(row["code_events"]),
            {table: Counter(c) for table, c in json.loads(row["rows"]).items()},
            Counter(json.loads(row["truncation"])),
            Counter(json.loads(row["matched"])),
        )
    return tally


def _to_parquet(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()


def _from_parquet(data: bytes) -> pd.DataFrame:
    return pq.read_table(io.BytesIO(data)).to_pandas()
