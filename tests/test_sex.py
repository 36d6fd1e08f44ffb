"""A patient's sex: read from every format's spelling, carried into the token dataset and the model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch

from behrt_rope import schema as S
from behrt_rope.data.batching import model_inputs, pad_batch
from behrt_rope.data.datasets import PatientDataset
from behrt_rope.data.sequences import from_table, load_tokens
from behrt_rope.etl.config import EtlConfig, SplitConfig
from behrt_rope.etl.runner import run_etl
from behrt_rope.etl.sex import normalise_sex, sex_ids, unrecognised_values
from behrt_rope.model.config import ModelConfig
from behrt_rope.model.heads import BehrtForMultiLabel
from behrt_rope.scoring.batches import padded_batch
from behrt_rope.training.bundle import load_bundle, save_bundle
from tests.test_meds import COHORT, write_meds
from tests.test_omop import write_omop

ALL_TRAIN = SplitConfig(train=1.0, tuning=0.0, held_out=0.0)


@pytest.mark.parametrize(
    ("raw", "category"),
    [
        ("F", "female"), ("female", "female"), (" Female ", "female"), ("w", "female"), ("2", "female"),
        ("8532", "female"), ("8532.0", "female"), ("GENDER//F", "female"),
        ("M", "male"), ("MALE", "male"), ("1", "male"), ("8507", "male"),
        ("O", "other"), ("intersex", "other"), ("X", "other"), ("8521", "other"), ("Z9", "other"),
        ("", "unknown"), (None, "unknown"), ("U", "unknown"), ("Unknown", "unknown"), ("0", "unknown"),
        ("9", "unknown"), ("8551", "unknown"), ("n/a", "unknown"), (float("nan"), "unknown"),
    ],
)  # fmt: skip
def test_spellings_of_every_source_map_to_four_categories(raw: object, category: str) -> None:
    assert normalise_sex([raw]).tolist() == [category]


def test_unrecognised_values_are_counted_as_written_and_ids_follow_the_schema() -> None:
    assert unrecognised_values(["F", "Z9", "Z9", " q ", None, "U"]) == {"Z9": 2, " q ": 1}
    assert sex_ids(["unknown", "female", "male", "other", None, "bogus"]).tolist() == [0, 1, 2, 3, 0, 0]
    assert [S.SEX_VALUES[i] for i in sex_ids(normalise_sex(["M", "F"]))] == ["male", "female"]


def write_visits(root: Path, sex: list[object] | None) -> Path:
    """Four patients with one visit each; ``sex`` per patient (None: no sex column)."""
    root.mkdir(parents=True)
    patients = pd.DataFrame({S.PATIENT_ID: ["a", "b", "c", "d"], S.BIRTH_DATE: ["1980-01-01"] * 4})
    if sex is not None:
        patients[S.SEX] = sex
    patients.to_csv(root / "patients.csv", index=False)
    events = pd.DataFrame({S.PATIENT_ID: list("abcd"), S.DATE: ["2020-01-01"] * 4, S.CODE: ["I10"] * 4})
    events.to_csv(root / "events.csv", index=False)
    return root


def sex_by_patient(out: Path) -> dict[str, str]:
    table = pd.concat(pd.read_parquet(p) for p in sorted((out / S.TOKENS_DIR).glob("*.parquet")))
    return dict(zip(table[S.PATIENT_ID], table[S.SEX], strict=True))


def test_visits_sex_reaches_the_tokens_and_the_manifest(tmp_path: Path) -> None:
    raw = write_visits(tmp_path / "raw", ["F", "male", "Z9", None])
    manifest = run_etl(raw, tmp_path / "out", EtlConfig(split=ALL_TRAIN), progress=False)
    assert sex_by_patient(tmp_path / "out") == {"a": "female", "b": "male", "c": "other", "d": "unknown"}
    assert manifest["patients"]["by_sex"] == {"female": 1, "male": 1, "other": 1, "unknown": 1}
    assert manifest["patients"]["sex_values_read_as_other"] == {"Z9": 1}
    seqs = load_tokens(tmp_path / "out")
    starts = seqs.offsets[:-1]
    # one id per token, the patient's: a=female(1), b=male(2), c=other(3), d=unknown(0)
    assert seqs.sex[starts].tolist() == [1, 2, 3, 0]
    assert all(len(set(seqs.sex[s:e])) == 1 for s, e in zip(seqs.offsets[:-1], seqs.offsets[1:], strict=True))
    assert seqs.select(np.array([2, 0])).sex[[0, 3]].tolist() == [3, 1]  # each stream is 3 tokens


def test_without_a_sex_column_every_patient_is_unknown(tmp_path: Path) -> None:
    raw = write_visits(tmp_path / "raw", None)
    manifest = run_etl(raw, tmp_path / "out", EtlConfig(split=ALL_TRAIN), progress=False)
    assert set(sex_by_patient(tmp_path / "out").values()) == {"unknown"}
    assert manifest["patients"]["by_sex"] == {"unknown": 4} and manifest["reconciles"]


def test_patient_rows_differing_only_in_sex_conflict(tmp_path: Path) -> None:
    raw = write_visits(tmp_path / "raw", ["F", "M", "F", "M"])
    patients = pd.read_csv(raw / "patients.csv")
    extra = pd.DataFrame({S.PATIENT_ID: ["a", "b"], S.BIRTH_DATE: ["1980-01-01"] * 2, S.SEX: ["M", "M"]})
    pd.concat([patients, extra]).to_csv(raw / "patients.csv", index=False)
    manifest = run_etl(raw, tmp_path / "out", EtlConfig(split=ALL_TRAIN), progress=False)
    assert manifest["quarantine_reasons"][S.Reason.CONFLICTING_PATIENT_ROWS] == 2  # a's two rows
    assert manifest["quarantine_reasons"][S.Reason.DUPLICATE] == 1  # b's repeat
    assert sex_by_patient(tmp_path / "out") == {"b": "male", "c": "female", "d": "male"}
    assert manifest["reconciles"]


def test_meds_sex_events(tmp_path: Path) -> None:
    rows = [*COHORT, (2, None, "GENDER//M"), (4, "2020-01-01", "GENDER//X")]
    config = EtlConfig(format="meds", split=ALL_TRAIN)
    manifest = run_etl(write_meds(tmp_path / "raw", rows), tmp_path / "out", config, progress=False)
    assert sex_by_patient(tmp_path / "out")["1"] == "female" and sex_by_patient(tmp_path / "out")["2"] == "male"
    assert manifest["reader"]["meds.subjects_with_sex"] == 3
    assert manifest["reconciles"]  # sex rows are lookups, counted as filtered


def test_omop_gender_concept_with_source_value_fallback(tmp_path: Path) -> None:
    person = pd.DataFrame(
        {
            S.OMOP_PERSON_ID: [1, 2, 3],
            S.OMOP_YEAR_OF_BIRTH: [1980, 1981, 1982],
            S.OMOP_GENDER_CONCEPT_ID: [8532, 0, 8551],
            S.OMOP_GENDER_SOURCE_VALUE: ["F", "M", None],
        }
    )
    conditions = pd.DataFrame(
        {
            S.OMOP_PERSON_ID: [1, 2, 3],
            S.OMOP_CONDITION_CONCEPT_ID: [4000, 4000, 4000],
            S.OMOP_CONDITION_START_DATE: ["2020-01-01"] * 3,
        }
    )
    raw = write_omop(tmp_path / "raw", tables={S.OMOP_PERSON: person, S.OMOP_CONDITION: conditions})
    config = EtlConfig(format="omop", split=ALL_TRAIN)
    config.omop.code_source = "concept_id"
    run_etl(raw, tmp_path / "out", config, progress=False)
    assert sex_by_patient(tmp_path / "out") == {"1": "female", "2": "male", "3": "unknown"}


def test_token_files_from_before_sex_load_as_unknown(tmp_path: Path) -> None:
    raw = write_visits(tmp_path / "raw", ["F", "M", "F", "M"])
    run_etl(raw, tmp_path / "out", EtlConfig(split=ALL_TRAIN), progress=False)
    part = next((tmp_path / "out" / S.TOKENS_DIR).glob("*.parquet"))
    old = pq.read_table(part).drop_columns([S.SEX])
    pq.write_table(old, part)
    seqs = load_tokens(tmp_path / "out")
    assert (seqs.sex == 0).all() and set(seqs.patients[S.SEX]) == {"unknown"}
    assert from_table(old).sex.dtype == np.int8


def tiny_model(sex_embedding: bool = True) -> BehrtForMultiLabel:
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=12, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32,
                         sex_embedding=sex_embedding, label_own_code=False, dropout=0.0)  # fmt: skip
    return BehrtForMultiLabel(config, num_labels=3).eval()


def batch() -> dict[str, torch.Tensor]:
    ids = torch.tensor([[S.CLS_ID, 7, S.SEP_ID, 8, S.SEP_ID]] * 3)
    visit = torch.tensor([[0, 0, 0, 1, 1]] * 3)
    return {
        "token_ids": ids,
        "ages": torch.full((3, 5), 40.0),
        "segments": visit % 2,
        "visit_index": visit,
        "score_at": ids == S.SEP_ID,
    }


def test_model_reads_sex_and_unknown_adds_nothing() -> None:
    model = tiny_model()
    with torch.no_grad():
        none = model(**batch())
        unknown = model(**batch(), sex=torch.zeros(3, 5, dtype=torch.long))
        mixed = model(**batch(), sex=torch.tensor([[1] * 5, [2] * 5, [0] * 5]))
    assert torch.equal(none, unknown)  # the unknown row of the embedding is zero
    assert torch.equal(mixed[4:], none[4:])  # patient 3 is unknown (2 scored visits per patient)
    assert not torch.allclose(mixed[:2], mixed[2:4])  # female and male histories score differently
    assert model.encoder.embeddings.sex is not None and not model.encoder.embeddings.sex.weight[0].any()


def test_bundle_written_before_sex_loads_without_it(tmp_path: Path) -> None:
    model = tiny_model(sex_embedding=False)
    save_bundle(tmp_path, "multilabel", model.config, model.state_dict())
    meta = json.loads((tmp_path / S.MODEL_META_FILE).read_text())
    del meta["model_config"]["sex_embedding"]  # as a model.json of an earlier version
    (tmp_path / S.MODEL_META_FILE).write_text(json.dumps(meta))
    (tmp_path / S.DONE_MARKER).write_text("finetune")
    loaded = load_bundle(tmp_path, "multilabel")
    assert loaded["model_config"].sex_embedding is False
    rebuilt = BehrtForMultiLabel(loaded["model_config"], num_labels=3)
    rebuilt.load_state_dict(loaded["state_dict"])  # strict: the same keys


def test_scoring_and_training_batches_carry_each_patients_sex(tmp_path: Path) -> None:
    raw = write_visits(tmp_path / "raw", ["F", "M", None, "X"])
    run_etl(raw, tmp_path / "out", EtlConfig(split=ALL_TRAIN), progress=False)
    seqs = load_tokens(tmp_path / "out")
    scored = padded_batch(seqs, np.array([3, 0, 1]), score_last=True)
    assert scored["sex"].tolist() == [[3, 3, 3], [1, 1, 1], [2, 2, 2]]
    trained = pad_batch([PatientDataset(seqs)[i] for i in (1, 2)])
    assert model_inputs(trained)["sex"].tolist() == [[2, 2, 2], [0, 0, 0]]
