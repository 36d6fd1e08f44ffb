"""``engine=ray`` on a local Ray instance limited to 2 CPUs: ETL and predict give the local engine's outputs.

The ETL is compared on every input format (visits, MEDS with its metadata, OMOP with and without a concept
table), and a bad input must stop with the local engine's message whether it is found on the driver (a
missing column) or inside a Ray task (a date column in the wrong format).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from behrt_rope import config as config_lib
from behrt_rope import schema as S
from behrt_rope.cli import main
from behrt_rope.errors import InputSchemaError
from pipelines import etl as etl_pipeline
from tests.conftest import write_visits
from tests.fixtures_training import build_finetuned
from tests.test_meds import COHORT as MEDS_COHORT
from tests.test_meds import write_meds
from tests.test_omop import CONDITIONS, PERSON, conditions, write_omop

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


def assert_same_etl(raw: Path, out: Path, *overrides: str) -> dict:
    """Run the ETL on both engines (Ray: 3 shards, 2 workers); every output must be equal. Returns the
    local manifest."""
    local = etl(raw, out / "local", *overrides)
    on_ray = etl(raw, out / "ray", *overrides, "engine=ray", "ray.workers=2", "etl.shards=3")
    assert len(list((out / "ray" / S.TOKENS_DIR).glob("part-*.parquet"))) == 3  # sharded layout
    for a, b in zip(local[:3], on_ray[:3]):  # tokens (sorted by patient), vocabulary, quarantine
        pd.testing.assert_frame_equal(a, b)
    assert local[0][S.SPLIT].tolist() == on_ray[0][S.SPLIT].tolist()
    manifest_local, manifest_ray = local[3], on_ray[3]
    assert manifest_ray["reconciles"] and manifest_ray["engine"] == {"name": "ray", "workers": 2}
    for key in ("seconds", "shards", "engine", "settings"):
        manifest_local.pop(key, None), manifest_ray.pop(key, None)
    assert manifest_local == manifest_ray
    return manifest_local


def test_ray_etl_gives_the_local_outputs(cohort, tmp_path):
    manifest = assert_same_etl(cohort, tmp_path)
    quarantine = pd.read_parquet(tmp_path / "ray" / S.QUARANTINE_FILE)
    assert quarantine[S.REASON].nunique() > 1  # the corrupt rows were quarantined by both
    assert manifest["patients"]["with_tokens"] > 150 and manifest["vocabulary"]["codes"] > 10


def test_ray_etl_reads_meds_with_its_metadata(tmp_path):
    raw = write_meds(tmp_path / "meds", MEDS_COHORT, splits={1: "held_out", 2: "train", 4: "tuning"}, parts=2)
    manifest = assert_same_etl(raw, tmp_path, "etl.format=meds")
    assert manifest["reader"]["meds.visit_rule"] == "admission (auto)"  # a dataset-wide fact, reduced
    assert manifest["reader"]["meds.split_source"] == S.MEDS_SPLITS_FILE
    assert manifest["patients"]["by_split"] == {"train": 1, "tuning": 0, "held_out": 1}  # 4 is quarantined
    assert manifest["tables"][f"{S.MEDS_DATA_DIR}/part_0/0.parquet"]["rows"] == 13
    assert set(manifest["quarantine_reasons"]) >= {S.Reason.MISSING_BIRTH, S.Reason.BEFORE_BIRTH}


def test_ray_etl_reads_omop_with_a_concept_table(tmp_path):
    raw = write_omop(tmp_path / "omop")
    concept = pa.table(
        {
            S.OMOP_CONCEPT_ID: pa.array([201826, 320128, 4000], pa.int64()),
            S.OMOP_VOCABULARY_ID: ["SNOMED", "SNOMED", "ICD10CM"],
            S.OMOP_CONCEPT_CODE: ["44054006", "38341003", "I10"],
            S.OMOP_CONCEPT_NAME: ["Diabetes", "Hypertension", "Essential hypertension"],
        }
    )
    pq.write_table(concept, raw / "concept.parquet")
    manifest = assert_same_etl(raw, tmp_path, "etl.format=omop", "etl.omop.code_source=concept_id")
    assert manifest["reader"]["omop.code_naming"] == "concept_id named through concept.parquet"
    assert manifest["reader"]["omop.concepts_not_in_concept_table"] == 2  # 4001, twice
    assert manifest["tables"]["condition_occurrence.parquet"]["rows"] == len(CONDITIONS)
    names = pd.read_parquet(tmp_path / "ray" / S.CODE_DESCRIPTIONS_FILE)
    assert "Essential hypertension" in names[S.DESCRIPTION].tolist()


def test_ray_etl_reads_omop_csv_with_float_printed_source_values(tmp_path):
    printed = [f"{v}.0" for v in ("65363002", "38341003", "1001", "1002", "5", "6", "7", "8", "9", "10", "11")]
    raw = write_omop(tmp_path / "omop", "csv", {S.OMOP_PERSON: PERSON, S.OMOP_CONDITION: conditions(printed)})
    manifest = assert_same_etl(raw, tmp_path, "etl.format=omop", "etl.omop.code_source=source_value")
    assert manifest["reader"]["omop.codes_float_printed_repaired"] == len(CONDITIONS)  # a per-file fact
    tokens = set(pd.read_parquet(tmp_path / "ray" / S.VOCAB_FILE)["token"])
    assert {"5", "7"} <= tokens and not any(t.endswith(".0") for t in tokens)  # 5.0 -> 5, on every shard


def ray_etl_error(raw: Path, out: Path) -> str:
    config = config_lib.build(etl_pipeline.Config, {}, [f"input={raw}", f"out={out}", "progress=false"])
    config.engine, config.ray.workers, config.etl.shards = "ray", 2, 3
    with pytest.raises(InputSchemaError) as err:
        etl_pipeline.run(config)
    return str(err.value)


def local_etl_error(raw: Path, out: Path) -> str:
    with pytest.raises(InputSchemaError) as err:
        etl_pipeline.run(config_lib.build(etl_pipeline.Config, {}, [f"input={raw}", f"out={out}", "progress=false"]))
    return str(err.value)


PATIENTS = [{"patient_id": f"p{i}", "birth_date": "1990-06-15"} for i in range(6)]


def test_ray_etl_stops_with_the_local_message_on_a_missing_column(tmp_path):
    events = pd.DataFrame({"patient_id": ["p1"], "day": ["2010-01-01"], "code": ["I10"]})
    raw = write_visits(tmp_path / "in", PATIENTS, events)
    message = ray_etl_error(raw, tmp_path / "ray")
    assert message == local_etl_error(raw, tmp_path / "local")
    assert message == (
        f"{raw / 'events.csv'}: missing required column 'date' (found columns ['patient_id', 'day', 'code']; "
        "example row: {'patient_id': 'p1', 'day': '2010-01-01', 'code': 'I10'})"
    )


def test_ray_etl_stops_with_the_local_message_on_a_bad_date_column(tmp_path):
    events = pd.DataFrame({"patient_id": ["p1"] * 3, "date": ["2010-01-01", "01/02/2010", "13/02/2010"], "code": "I10"})
    raw = write_visits(tmp_path / "in", PATIENTS, events)
    message = ray_etl_error(raw, tmp_path / "ray")  # found inside a Ray task: no Ray traceback in the message
    assert message == local_etl_error(raw, tmp_path / "local")
    assert message == (
        f"{raw / 'events.csv'}: column 'date' is not in ISO date format (YYYY-MM-DD or YYYY-MM-DDTHH:MM:SS): "
        "2 of 3 values do not parse (example row 1: '01/02/2010')"
    )


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
    for key in (
        "patients_scored",
        "patients_not_scored",
        "unknown_code_events",
        "rows_quarantined",
        "input_rows",
        "truncation",
    ):
        assert a[key] == b[key], key
