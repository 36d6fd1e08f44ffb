"""``engine=ray`` on a local Ray instance limited to 2 CPUs: ETL and predict give the local engine's outputs."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from behrt_rope import schema as S
from behrt_rope.cli import main
from tests.fixtures_training import build_finetuned

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def cohort(tmp_path_factory):
    root = tmp_path_factory.mktemp("ray")
    assert main(["synth", "--out", str(root / "raw"), "--patients", "200", "synth.corrupt_fraction=0.02"]) == 0
    return root / "raw"


def etl(raw, out, *overrides):
    assert (
        main(["etl", "--input", str(raw), "--out", str(out), "progress=false", "etl.code_truncate=3", *overrides]) == 0
    )
    tokens = pd.read_parquet(out / S.TOKENS_DIR).sort_values(S.PATIENT_ID, ignore_index=True)
    manifest = json.loads((out / S.MANIFEST_FILE).read_text())
    return tokens, pd.read_parquet(out / S.VOCAB_FILE), pd.read_parquet(out / S.QUARANTINE_FILE), manifest


def test_ray_etl_gives_the_local_outputs(cohort, tmp_path):
    local = etl(cohort, tmp_path / "local")
    on_ray = etl(cohort, tmp_path / "ray", "engine=ray", "ray.workers=2", "etl.shards=3")
    assert len(list((tmp_path / "ray" / S.TOKENS_DIR).glob("part-*.parquet"))) == 3  # sharded layout
    for a, b in zip(local[:3], on_ray[:3]):
        pd.testing.assert_frame_equal(a, b)
    assert local[0][S.SPLIT].tolist() == on_ray[0][S.SPLIT].tolist()
    assert local[2][S.REASON].nunique() > 1  # the corrupt rows were quarantined by both
    manifest_local, manifest_ray = local[3], on_ray[3]
    assert manifest_ray["reconciles"] and manifest_ray["engine"] == {"name": "ray", "workers": 2}
    for key in ("seconds", "shards", "engine", "settings"):
        manifest_local.pop(key, None), manifest_ray.pop(key, None)
    assert manifest_local == manifest_ray


def test_ray_predict_gives_the_local_probabilities(tmp_path_factory, tmp_path):
    raw, model = build_finetuned(tmp_path_factory.mktemp("ray_model"), patients=120, seed=4)
    common = ["--model", str(model), "--input", str(raw), "progress=false", "shards=3", "precision=fp32"]
    assert main(["predict", "--out", str(tmp_path / "local.parquet"), *common]) == 0
    assert main(["predict", "--out", str(tmp_path / "ray.parquet"), *common, "engine=ray", "ray.workers=2"]) == 0
    assert sorted(p.name for p in (tmp_path / "ray.parquet").iterdir()) == [f"part-0000{k}.parquet" for k in range(3)]
    keys = [S.PATIENT_ID, S.CODE]
    local = pd.read_parquet(tmp_path / "local.parquet").sort_values(keys, ignore_index=True)
    on_ray = pd.read_parquet(tmp_path / "ray.parquet").sort_values(keys, ignore_index=True)
    pd.testing.assert_frame_equal(local.drop(columns=S.PROBABILITY), on_ray.drop(columns=S.PROBABILITY))
    np.testing.assert_allclose(local[S.PROBABILITY], on_ray[S.PROBABILITY], atol=1e-6, rtol=0)
    a, b = (json.loads((tmp_path / f"{n}.summary.json").read_text()) for n in ("local", "ray"))
    for key in ("patients_scored", "patients_not_scored", "unknown_code_events", "rows_quarantined"):
        assert a[key] == b[key]
