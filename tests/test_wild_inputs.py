"""MEDS and OMOP as they come from the wild: default settings read Synthea-style and meds_etl-style MEDS
exports (encounters, no admissions), OMOP with and without a concept table names codes the same way, an
unusable input fails at the ETL naming what it found, and MEDS-layout predictions pass meds-evaluation."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pandas as pd
import polars as pl
import pyarrow.parquet as pq
import pytest
import wild_data as W
from fixtures_training import FAST_TRAINER, TINY_MODEL
from meds_evaluation.evaluate import evaluate_binary_classification
from meds_evaluation.schema import PredictionSchema

from behrt_rope import schema as S
from behrt_rope.cli import main
from behrt_rope.errors import UserError
from behrt_rope.etl.config import EtlConfig, MedsConfig, OmopConfig
from behrt_rope.etl.diagnostics import EmptyResultError
from behrt_rope.etl.runner import run_etl
from pipelines import etl as etl_pipeline


def tokens_by_patient(out: Path) -> dict[str, list[str]]:
    names = pd.read_parquet(out / S.VOCAB_FILE).set_index("token_id")[S.TOKEN]
    table = pd.concat([pd.read_parquet(p) for p in sorted((out / S.TOKENS_DIR).glob("*.parquet"))])
    return {row[S.PATIENT_ID]: names.loc[list(row[S.TOKEN_IDS])].tolist() for _, row in table.iterrows()}


def code_tokens(out: Path) -> set[str]:
    return set(pd.read_parquet(out / S.VOCAB_FILE)[S.TOKEN]) - set(S.SPECIAL_TOKENS)


@pytest.fixture(scope="module")
def small() -> W.Cohort:
    return W.cohort(30, seed=1)


# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("style", "vocabulary", "pattern"),
    [("snomed", "SNOMED", 2), ("icd10cm", "ICD10CM", 3), ("snomed_ct", "SNOMED", 2)],
)
def test_meds_styles_work_with_defaults(tmp_path: Path, small: W.Cohort, style: str, vocabulary: str, pattern: int):
    manifest = run_etl(W.write_meds(tmp_path / "in", small, style), tmp_path / "out", EtlConfig(format="meds"), False)
    assert manifest["reconciles"] and manifest["events_used"]["reconciles"]
    assert manifest["patients"]["with_tokens"] == 30
    reader = manifest["reader"]
    assert reader["meds.visit_rule"] == "encounter (auto)"
    assert reader["meds.diagnosis_rows"] == len(small.conditions) == reader[f"meds.diagnosis_rows.{vocabulary}"]
    entry = MedsConfig().code_patterns[pattern]
    assert reader[f"meds.code_pattern_rows.{entry}"] == len(small.conditions)
    assert reader["meds.diagnoses_outside_encounter"] == 0
    assert all(t.startswith(vocabulary + "/") for t in code_tokens(tmp_path / "out"))
    # filtered rows (labs, medications, encounters) are counted by prefix
    prefixes = manifest["filtered_code_prefixes"]
    assert prefixes["LOINC//"] == 4 * len(small.encounters) and prefixes["ENCOUNTER//"] == len(small.encounters)
    # one visit per encounter: a patient's visits are its encounters with a condition
    per_patient = small.conditions.groupby("person")["encounter"].nunique()
    streams = tokens_by_patient(tmp_path / "out")
    assert {int(p): s.count(S.SEP) for p, s in streams.items()} == per_patient.to_dict()
    descriptions = pd.read_parquet(tmp_path / "out" / S.CODE_DESCRIPTIONS_FILE).set_index(S.TOKEN)[S.DESCRIPTION]
    diabetes = f"{vocabulary}/{'E11' if style == 'icd10cm' else '44054006'}"
    assert descriptions[diabetes] == "Type 2 diabetes mellitus"


def test_date_only_diagnoses_join_the_days_encounter(tmp_path: Path, small: W.Cohort) -> None:
    dated = W.Cohort(
        small.persons, small.encounters, small.conditions.assign(time=small.conditions["time"].dt.floor("D"))
    )
    manifest = run_etl(W.write_meds(tmp_path / "in", dated), tmp_path / "out", EtlConfig(format="meds"), False)
    assert manifest["reader"]["meds.diagnoses_outside_encounter"] == 0
    per_patient = small.conditions.groupby("person")["encounter"].nunique()
    assert {int(p): s.count(S.SEP) for p, s in tokens_by_patient(tmp_path / "out").items()} == per_patient.to_dict()


def test_meds_and_omop_of_one_cohort_give_the_same_tokens(tmp_path: Path, small: W.Cohort) -> None:
    run_etl(W.write_meds(tmp_path / "meds", small), tmp_path / "out_meds", EtlConfig(format="meds"), False)
    run_etl(W.write_omop(tmp_path / "omop", small), tmp_path / "out_omop", EtlConfig(format="omop"), False)
    assert tokens_by_patient(tmp_path / "out_meds") == tokens_by_patient(tmp_path / "out_omop")


def test_omop_with_and_without_a_concept_table(tmp_path: Path, small: W.Cohort) -> None:
    with_table = run_etl(W.write_omop(tmp_path / "a", small), tmp_path / "a_out", EtlConfig(format="omop"), False)
    assert with_table["reader"]["omop.code_source"] == S.OMOP_CONDITION_CONCEPT_ID
    assert with_table["reader"]["omop.conditions_named_by_concept"] == len(small.conditions)
    named = code_tokens(tmp_path / "a_out")
    assert "SNOMED/44054006" in named and all(t.startswith("SNOMED/") for t in named)
    described = pd.read_parquet(tmp_path / "a_out" / S.CODE_DESCRIPTIONS_FILE)
    assert dict(zip(described[S.TOKEN], described[S.DESCRIPTION]))["SNOMED/38341003"] == "Hypertension"

    bare = W.write_omop(tmp_path / "b", small, concept_table=False)
    plain = run_etl(bare, tmp_path / "b_out", EtlConfig(format="omop"), False)  # auto: source values, no vocabulary
    assert plain["reader"]["omop.code_source"] == S.OMOP_CONDITION_SOURCE_VALUE
    assert "44054006" in code_tokens(tmp_path / "b_out")
    cfg = EtlConfig(format="omop", omop=OmopConfig(vocabulary="SNOMED"))
    run_etl(bare, tmp_path / "c_out", cfg, False)
    assert tokens_by_patient(tmp_path / "c_out") == tokens_by_patient(tmp_path / "a_out")
    assert len(pd.read_parquet(tmp_path / "c_out" / S.CODE_DESCRIPTIONS_FILE)) == 0


def test_omop_concept_missing_from_the_concept_table_is_quarantined(tmp_path: Path, small: W.Cohort) -> None:
    root = W.write_omop(tmp_path / "in", small)
    concept = pd.read_parquet(root / "concept.parquet")
    pq.write_table(pq.read_table(root / "concept.parquet").slice(1), root / "concept.parquet")  # drop diabetes
    manifest = run_etl(root, tmp_path / "out", EtlConfig(format="omop"), False)
    missing = int((small.conditions["condition"] == 0).sum())
    assert manifest["quarantine_reasons"][S.Reason.UNKNOWN_CONCEPT] == missing > 0
    assert manifest["reconciles"] and concept[S.OMOP_CONCEPT_CODE].iloc[0] == "44054006"


# ---------------------------------------------------------------------------------------------------------
def test_meds_without_diagnoses_fails_at_the_etl_naming_the_prefixes(tmp_path: Path, small: W.Cohort, capsys) -> None:
    root = W.write_meds(tmp_path / "in", small, diagnoses=False)
    with pytest.raises(EmptyResultError, match=r"no patient with a code token .*LOINC// .*etl\.meds\.code_patterns"):
        etl_pipeline.run(
            etl_pipeline.Config(
                input=str(root), out=str(tmp_path / "out"), progress=False, etl=EtlConfig(format="meds")
            )
        )
    assert not (tmp_path / "out" / S.DONE_MARKER).exists()
    assert json.loads((tmp_path / "out" / S.MANIFEST_FILE).read_text())["patients"]["with_tokens"] == 0
    argv = ["etl", "--input", str(root), "--out", str(tmp_path / "cli"), "--format", "meds", "progress=false"]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "ENCOUNTER//" in err and "etl.meds.code_patterns" in err


def test_mostly_filtered_input_warns_with_the_same_detail(tmp_path: Path, small: W.Cohort, caplog) -> None:
    few = W.Cohort(small.persons, small.encounters, small.conditions.head(3))
    root = W.write_meds(tmp_path / "in", few)
    with caplog.at_level(logging.WARNING, logger="behrt_rope"):
        etl_pipeline.run(
            etl_pipeline.Config(
                input=str(root), out=str(tmp_path / "out"), progress=False, etl=EtlConfig(format="meds")
            )
        )
    manifest = json.loads((tmp_path / "out" / S.MANIFEST_FILE).read_text())
    assert len(manifest["warnings"]) == 1 and "LOINC//" in manifest["warnings"][0]
    assert "filtered or quarantined" in caplog.text


# ---------------------------------------------------------------------------------------------------------
def _run(*argv: str) -> None:
    assert main(list(argv)) == 0, f"behrt-rope {' '.join(argv)} failed"


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path, W.Cohort]:
    """200 Synthea-style patients as MEDS (SNOMED//, encounters): etl and finetune with default data
    settings (only the model size and epochs are cut, for the suite's time)."""
    root = tmp_path_factory.mktemp("wild")
    c = W.cohort(200, seed=0)
    raw = W.write_meds(root / "meds", c)
    _run("etl", "--input", str(raw), "--out", str(root / "etl"), "--format", "meds", "progress=false")
    _run(
        "finetune",
        "--data",
        str(root / "etl"),
        "--out",
        str(root / "ft"),
        "--max-epochs",
        "1",
        *TINY_MODEL,
        *FAST_TRAINER,
    )
    return root, raw, c


@pytest.mark.slow
def test_small_meds_cohort_trains_with_defaults_and_reports_the_labels(trained) -> None:
    root, _, _ = trained
    metrics = json.loads((root / "ft" / S.METRICS_FILE).read_text())
    assert metrics["labels"] == len(metrics["label_codes"]) > 0
    assert all(code.startswith("SNOMED/") for code in metrics["label_codes"])
    assert 2 <= metrics["min_label_count"] <= 20


@pytest.mark.slow
def test_a_model_trained_from_meds_scores_omop_in_the_meds_layout(trained, tmp_path: Path) -> None:
    root, _, c = trained
    omop = W.write_omop(tmp_path / "omop", c, concept_table=False)
    out = tmp_path / "pred"
    _run("predict", "--model", str(root / "ft"), "--input", str(omop), "--format", "omop", "--out", str(out),
         "layout=meds", "etl.omop.vocabulary=SNOMED", "progress=false")  # fmt: skip
    summary = json.loads((tmp_path / "pred.summary.json").read_text())
    assert summary["input_format"] == "omop" and summary["patients_scored"] == 200
    assert summary["unknown_code_events"] == 0 and summary["code_events"] > 0
    index = json.loads((out / S.MEDS_PREDICTIONS_INDEX).read_text())
    labels = json.loads((root / "ft" / S.METRICS_FILE).read_text())["label_codes"]
    assert sorted(index) == sorted(labels)
    for name in index.values():
        table = PredictionSchema.align(pq.read_table(out / name))  # no extra columns, right types
        assert table.num_rows == 200 and table.column_names[:2] == [S.MEDS_SUBJECT_ID, S.PREDICTION_TIME]


@pytest.mark.slow
def test_meds_and_omop_of_one_cohort_get_the_same_predictions_with_defaults(trained, tmp_path: Path) -> None:
    root, raw, c = trained
    omop = W.write_omop(tmp_path / "omop", c)  # with a concept table: codes named SNOMED/... without settings
    scored = {}
    for fmt, path in (("meds", raw), ("omop", omop)):
        out = tmp_path / f"{fmt}.parquet"
        _run("predict", "--model", str(root / "ft"), "--input", str(path), "--format", fmt, "--out", str(out),
             "progress=false")  # fmt: skip
        assert json.loads((tmp_path / f"{fmt}.summary.json").read_text())["unknown_code_events"] == 0
        table = pd.read_parquet(out).sort_values([S.PATIENT_ID, S.CODE], ignore_index=True)
        scored[fmt] = table
    meds, omop_scores = scored["meds"], scored["omop"]
    assert len(meds) == 200 * len(json.loads((root / "ft" / S.METRICS_FILE).read_text())["label_codes"])
    assert (meds[S.CODE] == omop_scores[S.CODE]).all()
    assert (meds[S.PATIENT_ID].astype(str) == omop_scores[S.PATIENT_ID].astype(str)).all()
    assert np.allclose(meds[S.PROBABILITY], omop_scores[S.PROBABILITY], atol=1e-6)


@pytest.mark.slow
def test_evaluate_writes_meds_predictions_that_meds_evaluation_scores(trained) -> None:
    root, _, _ = trained
    _run("evaluate", "--model", str(root / "ft"), "--data", str(root / "etl"), "--out", str(root / "eval"),
         "n_bootstrap=5", "meds_predictions=true", "progress=false")  # fmt: skip
    folder = root / "eval" / S.MEDS_PREDICTIONS_DIR
    index = json.loads((folder / S.MEDS_PREDICTIONS_INDEX).read_text())
    table = pq.read_table(folder / index["SNOMED/38341003"])  # hypertension: common, chronic
    assert S.MEDS_BOOLEAN_VALUE in table.column_names
    result = evaluate_binary_classification(pl.from_arrow(table))["samples_equally_weighted"]
    assert 0.0 <= result["roc_auc_score"] <= 1.0 and 0.0 <= result["average_precision_score"] <= 1.0
    html = (root / "eval" / S.REPORT_FILE).read_text()
    assert "Hypertension" in html


def test_finetune_without_labels_names_the_real_cause(tmp_path: Path, small: W.Cohort) -> None:
    few = W.Cohort(small.persons.head(3), small.encounters, small.conditions[small.conditions["person"] <= 3])
    root = W.write_meds(tmp_path / "in", few)
    etl_config = etl_pipeline.Config(input=str(root), out=str(tmp_path / "etl"), progress=False)
    etl_config.etl = EtlConfig(format="meds")
    etl_pipeline.run(etl_config)  # the stage, so finetune finds a finished ETL output
    from pipelines import finetune

    config = finetune.Config(data=str(tmp_path / "etl"), out=str(tmp_path / "ft"))
    config.task.min_label_count = 50
    with pytest.raises(UserError, match=r"has 3 patients \(\d+ in train\), \d+ next_visit train samples, and no code"):
        finetune.run(config)
