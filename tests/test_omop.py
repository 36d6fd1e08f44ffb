"""The OMOP CDM reader: births, deaths, codes (float-printed too), concept 0, visits, and the real sample."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from behrt_rope import schema as S
from behrt_rope.errors import InputSchemaError
from behrt_rope.etl.config import EtlConfig, OmopConfig
from behrt_rope.etl.readers import omop
from behrt_rope.etl.runner import run_etl

REAL = Path(__file__).resolve().parents[2] / "shared" / "data" / "omop-synthea27"

PERSON = pd.DataFrame(
    {
        S.OMOP_PERSON_ID: [1, 2, 3, 4],
        S.OMOP_YEAR_OF_BIRTH: [1980, 1990, None, 1950],
        S.OMOP_MONTH_OF_BIRTH: [5, None, None, 3],
        S.OMOP_DAY_OF_BIRTH: [5, None, None, 3],
        S.OMOP_BIRTH_DATETIME: ["1980-05-05 00:00:00", None, None, None],
    }
)
VISIT = pd.DataFrame(
    {
        S.OMOP_VISIT_OCCURRENCE_ID: [10, 20, 40],
        S.OMOP_PERSON_ID: [1, 2, 4],
        S.OMOP_VISIT_START_DATE: ["2020-01-01", "2020-05-05", "2020-06-06"],
        S.OMOP_VISIT_END_DATE: ["2020-01-02", "2020-05-05", None],
    }
)
DEATH = pd.DataFrame({S.OMOP_PERSON_ID: [4, 98], S.OMOP_DEATH_DATE: ["2021-01-01", "2020-01-01"]})
# person, concept, source value, start date, visit
CONDITIONS = [
    (1, 201826, "44054006", "2020-01-01", 10),
    (1, 320128, "38341003", "2019-12-31", 10),  # a day before its visit: still one visit with the row above
    (1, 4000, "1001", "2020-03-03", None),  # no visit: the two rows of that date form one visit
    (1, 4001, "1002", "2020-03-03", None),
    (2, 0, "XYZ", "2020-05-05", 20),  # concept 0
    (2, 201826, "44054006", "1989-06-01", None),  # before birth (1990-01-01 from the year alone)
    (2, 4000, "1001", "2020-05-05", 20),
    (3, 201826, "44054006", "2020-01-01", None),  # person without a year of birth
    (4, 4001, "1002", "2020-06-06", 40),
    (4, 4000, "1001", "2021-06-01", None),  # after death
    (99, 4000, "1001", "2020-01-01", None),  # no such person
]


def conditions(source_values: list[str] | None = None) -> pd.DataFrame:
    frame = pd.DataFrame(
        CONDITIONS,
        columns=[
            S.OMOP_PERSON_ID,
            S.OMOP_CONDITION_CONCEPT_ID,
            S.OMOP_CONDITION_SOURCE_VALUE,
            S.OMOP_CONDITION_START_DATE,
            S.OMOP_VISIT_OCCURRENCE_ID,
        ],
    )
    frame[S.OMOP_VISIT_OCCURRENCE_ID] = frame[S.OMOP_VISIT_OCCURRENCE_ID].astype("Int64")
    if source_values is not None:
        frame[S.OMOP_CONDITION_SOURCE_VALUE] = source_values
    return frame


def write_omop(root: Path, fmt: str = "parquet", tables: dict[str, pd.DataFrame] | None = None) -> Path:
    """The test cohort (or ``tables``) as OMOP CDM files under ``root``."""
    tables = (
        tables
        if tables is not None
        else {
            S.OMOP_PERSON: PERSON,
            S.OMOP_CONDITION: conditions(),
            S.OMOP_VISIT: VISIT,
            S.OMOP_DEATH: DEATH,
        }
    )
    root.mkdir(parents=True, exist_ok=True)
    for name, frame in tables.items():
        if fmt == "csv":
            frame.to_csv(root / f"{name}.csv", index=False)
        else:
            frame = frame.copy()
            for column in (S.OMOP_YEAR_OF_BIRTH, S.OMOP_MONTH_OF_BIRTH, S.OMOP_DAY_OF_BIRTH):
                if column in frame.columns:
                    frame[column] = frame[column].astype("Int64")
            pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), root / f"{name}.parquet")
    return root


def config(all_train: bool = False, **omop_settings: object) -> EtlConfig:
    """Concept ids by default: this cohort has no concept table (tests/test_wild_inputs.py covers one)."""
    omop_settings.setdefault("code_source", "concept_id")
    cfg = EtlConfig(format="omop", omop=OmopConfig(**omop_settings))  # type: ignore[arg-type]
    if all_train:
        cfg.split.train, cfg.split.tuning, cfg.split.held_out = 1.0, 0.0, 0.0
    return cfg


def token_streams(out: Path) -> dict[str, dict[str, object]]:
    """Per patient: tokens as strings, ages (rounded), visit indices, split."""
    names = pd.read_parquet(out / S.VOCAB_FILE).set_index("token_id")["token"]
    table = pd.concat([pd.read_parquet(p) for p in sorted((out / S.TOKENS_DIR).glob("*.parquet"))])
    return {
        row[S.PATIENT_ID]: {
            "tokens": names.loc[list(row[S.TOKEN_IDS])].tolist(),
            "ages": np.round(np.asarray(row[S.AGES], dtype=float), 4).tolist(),
            "visit_index": list(row[S.VISIT_INDEX]),
            "split": row[S.SPLIT],
        }
        for _, row in table.iterrows()
    }


def assert_reconciles(manifest: dict) -> None:
    assert manifest["reconciles"], manifest["tables"]
    assert all(t["reconciles"] for t in manifest["tables"].values())
    assert manifest["events_used"]["reconciles"], manifest["events_used"]


# ---------------------------------------------------------------------------------------------------------
def test_reader_rows_births_codes_and_visit_notes(tmp_path: Path) -> None:
    raw = omop.read(write_omop(tmp_path), config())
    assert raw.rows_read == {
        "person.parquet": 4,
        "condition_occurrence.parquet": len(CONDITIONS),
        "visit_occurrence.parquet": 3,
        "death.parquet": 2,
    }
    assert raw.filtered == {"visit_occurrence.parquet": 3, "death.parquet": 2}  # lookups
    assert raw.patient_id_type == "int64"
    births = raw.patients.set_index(S.PATIENT_ID)[S.BIRTH_DATE]
    assert births["1"] == pd.Timestamp("1980-05-05") and births["2"] == pd.Timestamp("1990-01-01")
    assert births["4"] == pd.Timestamp("1950-03-03") and pd.isna(births["3"])
    assert raw.patients.set_index(S.PATIENT_ID).loc["4", S.DEATH_DATE] == pd.Timestamp("2021-01-01")
    ev = raw.events
    assert ev[S.CODE].tolist()[:3] == ["201826", "320128", "4000"]
    assert ev[S.VISIT_ID].tolist()[:3] == ["10", "10", ""]
    assert ev[S.REASON].tolist().count(S.Reason.NO_MATCHING_CONCEPT) == 1
    notes = raw.notes
    assert notes["omop.conditions_before_visit_start"] == 1 and notes["omop.conditions_after_visit_end"] == 0
    assert notes["omop.conditions_without_visit"] == 6
    assert notes["omop.births_from_year_month_day"] == 2 and notes["omop.births_unparseable"] == 1
    assert notes["omop.death_rows_without_person"] == 1 and notes["omop.persons_with_death"] == 1


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_quarantine_and_reconciliation(tmp_path: Path, fmt: str) -> None:
    manifest = run_etl(write_omop(tmp_path / "in", fmt), tmp_path / "out", config(all_train=True), progress=False)
    assert_reconciles(manifest)
    quarantine = pd.read_parquet(tmp_path / "out" / S.QUARANTINE_FILE)
    got = {(r[S.SOURCE_TABLE].split(".")[0], r[S.SOURCE_ROW]): r[S.REASON] for _, r in quarantine.iterrows()}
    R, C = S.Reason, S.OMOP_CONDITION
    assert got == {
        (S.OMOP_PERSON, 2): R.UNPARSEABLE_BIRTH_DATE,
        (C, 4): R.NO_MATCHING_CONCEPT,
        (C, 5): R.BEFORE_BIRTH,
        (C, 7): R.PATIENT_REJECTED,
        (C, 9): R.AFTER_DEATH,
        (C, 10): R.UNKNOWN_PATIENT,
    }
    conditions_table = manifest["tables"][f"{C}.{fmt}"]
    assert conditions_table == {
        "rows": 11,
        "used": 6,
        "quarantined": 5,
        "duplicates_dropped": 0,
        "filtered": 0,
        "reconciles": True,
    }
    assert manifest["tables"][f"{S.OMOP_VISIT}.{fmt}"]["filtered"] == 3
    assert manifest["patient_id_type"] == ("int64" if fmt == "parquet" else "string")
    streams = token_streams(tmp_path / "out")
    assert streams["1"]["tokens"] == [S.CLS, "201826", "320128", S.SEP, "4000", "4001", S.SEP]
    assert streams["1"]["visit_index"] == [0, 0, 0, 0, 1, 1, 1]
    assert set(streams) == {"1", "2", "4"}


def test_zero_concept_kept_when_asked(tmp_path: Path) -> None:
    manifest = run_etl(
        write_omop(tmp_path / "in"), tmp_path / "out", config(True, skip_zero_concept=False), progress=False
    )
    assert_reconciles(manifest)
    assert S.Reason.NO_MATCHING_CONCEPT not in manifest["quarantine_reasons"]
    assert "0" in token_streams(tmp_path / "out")["2"]["tokens"]


def test_float_printed_source_values_and_float_columns(tmp_path: Path) -> None:
    printed = [f"{v}.0" for v in ("65363002", "38341003", "1001", "1002", "5", "6", "7", "8", "9", "10", "11")]
    raw = omop.read(
        write_omop(
            tmp_path / "a",
            "csv",
            {
                S.OMOP_PERSON: PERSON,
                S.OMOP_CONDITION: conditions(printed),
            },
        ),
        config(code_source="source_value", vocabulary="SNOMED"),
    )
    assert raw.events[S.CODE].tolist()[:2] == ["65363002", "38341003"]
    assert set(raw.events[S.CODE_SYSTEM]) == {"SNOMED"}
    assert raw.notes["omop.codes_float_printed_repaired"] == len(CONDITIONS)
    assert raw.notes["omop.visit_occurrence"].startswith("absent")

    # a file mixing decimals and integers is not float-printed: ICD-9 250.0 stays 250.0
    mixed = ["250.0", "4019", "250.01", "V45.0", "1", "2", "3", "4", "5", "6", "7"]
    raw = omop.read(
        write_omop(tmp_path / "b", "csv", {S.OMOP_PERSON: PERSON, S.OMOP_CONDITION: conditions(mixed)}),
        config(code_source="source_value"),
    )
    assert raw.events[S.CODE].tolist()[:4] == ["250.0", "4019", "250.01", "V45.0"]
    assert raw.notes["omop.codes_float_printed_repaired"] == 0

    # float-typed columns: concept ids and source values print integral values as integers
    frame = conditions()
    frame[S.OMOP_CONDITION_CONCEPT_ID] = frame[S.OMOP_CONDITION_CONCEPT_ID].astype("float64")
    frame[S.OMOP_CONDITION_SOURCE_VALUE] = [65363002.0, 250.01, *range(9)]
    frame[S.OMOP_VISIT_OCCURRENCE_ID] = frame[S.OMOP_VISIT_OCCURRENCE_ID].astype("float64")  # NaN for none
    root = write_omop(tmp_path / "c", "parquet", {S.OMOP_PERSON: PERSON, S.OMOP_CONDITION: frame})
    assert pq.read_schema(root / "condition_occurrence.parquet").field(S.OMOP_CONDITION_CONCEPT_ID).type == pa.float64()
    raw = omop.read(root, config())
    assert raw.events[S.CODE].tolist()[:2] == ["201826", "320128"]
    assert raw.events[S.VISIT_ID].tolist()[:3] == ["10", "10", ""]
    raw = omop.read(root, config(code_source="source_value"))
    assert raw.events[S.CODE].tolist()[:2] == ["65363002", "250.01"]
    assert raw.notes["omop.codes_non_integral_float"] == 1


def test_case_insensitive_names_and_text_integers(tmp_path: Path) -> None:
    root = tmp_path / "in"
    root.mkdir()
    PERSON.rename(columns=str.upper).to_csv(root / "PERSON.csv", index=False)
    frame = conditions().rename(columns=str.upper)
    frame[S.OMOP_PERSON_ID.upper()] = [f"{v}.0" for v in frame[S.OMOP_PERSON_ID.upper()]]  # float-printed ids
    frame.to_csv(root / "Condition_Occurrence.csv", index=False)
    raw = omop.read(root, config())
    assert raw.rows_read == {"PERSON.csv": 4, "Condition_Occurrence.csv": len(CONDITIONS)}
    assert raw.events[S.PATIENT_ID].tolist()[:2] == ["1", "1"]
    assert raw.patients[S.BIRTH_DATE].notna().sum() == 3


def test_athena_concept_table_and_r_written_csv(tmp_path: Path) -> None:
    """Athena's CONCEPT.csv is tab-separated with upper-case columns; R writes a missing value as NA. The
    result is that of the same cohort written with commas and empty fields."""
    concept = pd.DataFrame(
        {
            "CONCEPT_ID": [201826, 4000, 4001],
            "CONCEPT_NAME": ["Type 2 diabetes mellitus", "A", "B"],
            "VOCABULARY_ID": ["SNOMED"] * 3,
            "CONCEPT_CODE": ["44054006", "1001", "1002"],
            "VALID_START_DATE": ["19700101"] * 3,
        }
    )
    condition = conditions().iloc[[0, 2, 3]].drop(columns=[S.OMOP_CONDITION_SOURCE_VALUE])  # visit 10; none; none
    tables = {
        S.OMOP_PERSON: PERSON.iloc[:1],
        S.OMOP_CONDITION: condition,
        S.OMOP_VISIT: VISIT.iloc[:1].assign(visit_end_date=None),
    }
    outputs = {}
    for name, na in (("clean", ""), ("athena_and_r", "NA")):
        root = tmp_path / name
        root.mkdir()
        for table, frame in tables.items():
            frame.to_csv(root / f"{table}.csv", index=False, na_rep=na)
        concept.to_csv(root / ("CONCEPT.csv" if na else "concept.csv"), index=False, sep="\t" if na else ",")
        run_etl(root, tmp_path / f"out_{name}", config(all_train=True, code_source="auto"), progress=False)
        outputs[name] = token_streams(tmp_path / f"out_{name}")
    assert outputs["athena_and_r"] == outputs["clean"]
    tokens = ["[CLS]", "SNOMED/44054006", "[SEP]", "SNOMED/1001", "SNOMED/1002", "[SEP]"]
    assert outputs["clean"]["1"]["tokens"] == tokens


def test_impossible_birth_parts_are_unparseable(tmp_path: Path) -> None:
    person = pd.DataFrame(
        {
            S.OMOP_PERSON_ID: [1, 2, 3],
            S.OMOP_YEAR_OF_BIRTH: ["1980", "1980", "abc"],
            S.OMOP_MONTH_OF_BIRTH: ["2", "13", ""],
            S.OMOP_DAY_OF_BIRTH: ["30", "1", ""],
        }
    )
    raw = omop.read(write_omop(tmp_path, "csv", {S.OMOP_PERSON: person, S.OMOP_CONDITION: conditions()}), config())
    assert raw.patients[S.BIRTH_DATE].isna().all()
    assert raw.patients[S.BIRTH_RAW].iloc[1] == "year_of_birth=1980 month_of_birth=13 day_of_birth=1"


def test_wrong_type_names_file_column_and_example(tmp_path: Path) -> None:
    frame = conditions()
    frame[S.OMOP_CONDITION_START_DATE] = 20200101
    write_omop(tmp_path, "parquet", {S.OMOP_PERSON: PERSON, S.OMOP_CONDITION: frame})
    with pytest.raises(
        InputSchemaError, match=r"condition_occurrence\.parquet: column 'condition_start_date' has type int64.*20200101"
    ):
        omop.read(tmp_path, config())


def test_missing_table_and_column(tmp_path: Path) -> None:
    write_omop(tmp_path / "a", "csv", {S.OMOP_PERSON: PERSON})
    with pytest.raises(InputSchemaError, match="no 'condition_occurrence' table"):
        omop.read(tmp_path / "a", config())
    write_omop(
        tmp_path / "b",
        "csv",
        {S.OMOP_PERSON: PERSON, S.OMOP_CONDITION: conditions().drop(columns=S.OMOP_CONDITION_CONCEPT_ID)},
    )
    with pytest.raises(InputSchemaError, match=r"missing required column 'condition_concept_id'.*example row"):
        omop.read(tmp_path / "b", config())


def test_missing_source_value_chosen_by_auto_says_how_to_read_concept_ids(tmp_path: Path) -> None:
    """Without a concept table ``code_source=auto`` reads source values; an export without them is told to
    read concept ids instead."""
    frame = conditions().drop(columns=S.OMOP_CONDITION_SOURCE_VALUE)
    root = write_omop(tmp_path, "csv", {S.OMOP_PERSON: PERSON, S.OMOP_CONDITION: frame})
    with pytest.raises(InputSchemaError) as caught:
        omop.read(root, config(code_source="auto"))
    message = str(caught.value)
    assert message.startswith(f"{root / 'condition_occurrence.csv'}: missing required column 'condition_source_value'")
    assert message.endswith("set etl.omop.code_source=concept_id to read condition_concept_id")
    assert len(omop.read(root, config(code_source="concept_id")).events) == len(CONDITIONS)


def test_shards_give_the_same_result(tmp_path: Path) -> None:
    root = write_omop(tmp_path / "in")
    one = run_etl(root, tmp_path / "one", config(), progress=False)
    cfg = config()
    cfg.shards = 3
    many = run_etl(root, tmp_path / "many", cfg, progress=False)
    assert_reconciles(many)
    for key in ("tables", "quarantine_reasons", "events_used", "patients", "vocabulary", "reader"):
        assert one[key] == many[key], key
    assert token_streams(tmp_path / "one") == token_streams(tmp_path / "many")


def test_same_tokens_as_the_visits_format(tmp_path: Path) -> None:
    run_etl(write_omop(tmp_path / "omop"), tmp_path / "out_omop", config(), progress=False)
    visits_in = tmp_path / "visits"
    visits_in.mkdir()
    pd.DataFrame(
        {
            S.PATIENT_ID: ["1", "2", "4"],
            S.BIRTH_DATE: ["1980-05-05", "1990-01-01", "1950-03-03"],
            S.DEATH_DATE: ["", "", "2021-01-01"],
        }
    ).to_csv(visits_in / "patients.csv", index=False)
    usable = [(p, c, d, "" if v is None else str(v)) for p, c, _, d, v in CONDITIONS if p in (1, 2, 4) and c != 0]
    events = pd.DataFrame(usable, columns=[S.PATIENT_ID, S.CODE, S.DATE, S.VISIT_ID])
    events = events[(events[S.DATE] >= "1990") & (events[S.DATE] < "2021-06")]  # drop the rows quarantined above
    events.to_csv(visits_in / "events.csv", index=False)
    run_etl(visits_in, tmp_path / "out_visits", EtlConfig(format="visits"), progress=False)
    assert token_streams(tmp_path / "out_omop") == token_streams(tmp_path / "out_visits")


# ---------------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("code_source", ["concept_id", "source_value"])
def test_real_sample(tmp_path: Path, code_source: str) -> None:
    if not (REAL / "person.parquet").is_file():
        pytest.skip(f"real OMOP sample not found at {REAL}")
    manifest = run_etl(REAL, tmp_path / "out", config(code_source=code_source), progress=False)
    assert_reconciles(manifest)
    tables = manifest["tables"]
    assert tables["person.parquet"]["rows"] == 28  # the README's 27 patients: the person table holds 28 rows
    assert tables["condition_occurrence.parquet"]["rows"] == 470
    assert tables["visit_occurrence.parquet"] == {
        "rows": 1791,
        "used": 0,
        "quarantined": 0,
        "duplicates_dropped": 0,
        "filtered": 1791,
        "reconciles": True,
    }
    reader = manifest["reader"]
    assert reader["omop.conditions_before_visit_start"] > 0
    assert 20 <= manifest["patients"]["with_tokens"] <= 28
    if code_source == "source_value":
        assert reader["omop.codes_float_printed_repaired"] == 470
        vocab = pd.read_parquet(tmp_path / "out" / S.VOCAB_FILE)["token"]
        assert not vocab.str.endswith(".0").any()
    # the sample has a concept table: both sources give SNOMED/<concept_code>, the same tokens
    vocab = set(pd.read_parquet(tmp_path / "out" / S.VOCAB_FILE)["token"])
    assert "SNOMED/65363002" in vocab and all(t.startswith("SNOMED/") for t in vocab - set(S.SPECIAL_TOKENS))
    assert reader["omop.conditions_named_by_concept"] == 470
    described = pd.read_parquet(tmp_path / "out" / S.CODE_DESCRIPTIONS_FILE).set_index(S.TOKEN)[S.DESCRIPTION]
    assert len(described) == len(vocab) - S.N_SPECIAL and described["SNOMED/65363002"] == "Otitis media"
