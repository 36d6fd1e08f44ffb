"""The MEDS reader: selection, code systems, visit rules, quarantine, splits, shards, and the real sample."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from behrt_rope import schema as S
from behrt_rope.errors import InputSchemaError, UserError
from behrt_rope.etl.config import EtlConfig, MedsConfig, SplitConfig
from behrt_rope.etl.readers import meds
from behrt_rope.etl.runner import run_etl

REAL = Path(__file__).resolve().parents[2] / "shared" / "data" / "meds-mimic4-demo"
MEDS_SCHEMA = pa.schema(
    [
        (S.MEDS_SUBJECT_ID, pa.int64()),
        (S.MEDS_TIME, pa.timestamp("us")),
        (S.MEDS_CODE, pa.string()),
        ("numeric_value", pa.float32()),
    ]
)

ADMIT, DISCHARGE = "HOSPITAL_ADMISSION//EW EMER.//EMERGENCY ROOM", "HOSPITAL_DISCHARGE//HOME"
# (subject, time, code): subject 1 has a stay (2020-01-01 .. 2020-01-03 12:00) and a later day with two times.
COHORT = [
    (1, "1980-01-01", "MEDS_BIRTH"),
    (1, None, "GENDER//F"),
    (1, "2020-01-01T08:00", ADMIT),
    (1, "2020-01-01T09:00", "LAB//50912//mg/dL"),
    (1, "2020-01-02T10:00", "DIAGNOSIS//ICD//10//N39"),
    (1, "2020-01-03T12:00", DISCHARGE),
    (1, "2020-01-03T12:00", "DIAGNOSIS//ICD//10//I10"),
    (1, "2020-01-03T12:00", "DIAGNOSIS//ICD//10//E11.9"),
    (1, "2020-01-03T12:00", "DIAGNOSIS//ICD//9//4019"),
    (1, "2021-05-05T10:00", "DIAGNOSIS//ICD//10//J45"),
    (1, "2021-05-05T15:00", "DIAGNOSIS//ICD//10//R05"),
    (1, "2021-05-05T15:00", "PROCEDURE//ICD//10//0DTJ4ZZ"),
    (2, "1990-06-15", "MEDS_BIRTH"),
    (2, "1989-01-01", "DIAGNOSIS//ICD//9//V08"),  # before birth
    (2, "2021-01-01T11:00", "DIAGNOSIS//ICD//9//25000"),
    (2, "2021-01-01T11:00", "DIAGNOSIS//ICD//10//E119"),
    (2, "2022-01-01", "MEDS_DEATH"),
    (2, "2023-03-03", "DIAGNOSIS//ICD//10//I10"),  # after death
    (3, "2020-02-02", "DIAGNOSIS//ICD//10//I10"),  # no birth event
    (3, "2020-02-02", "LAB//1//x"),
    (4, "1970-01-01", "MEDS_BIRTH"),
    (4, "1971-01-01", "MEDS_BIRTH"),  # a second, different birth
    (4, "2020-01-01", "DIAGNOSIS//ICD//10//I10"),
    (5, "2000-01-01", "MEDS_BIRTH"),  # birth only: no tokens
    (5, "2010-01-01", "LAB//2//x"),
]
N_BIRTHS = 5
N_DIAGNOSES = sum(code.startswith("DIAGNOSIS//") for _, _, code in COHORT)


def write_meds(root: Path, rows: list[tuple], splits: dict[int, str] | None = None, parts: int = 1) -> Path:
    """A MEDS dataset under ``root``: rows spread over ``parts`` files of data/, and an optional split file."""
    frame = pd.DataFrame(rows, columns=[S.MEDS_SUBJECT_ID, S.MEDS_TIME, S.MEDS_CODE])
    frame[S.MEDS_TIME] = pd.to_datetime(frame[S.MEDS_TIME], format="ISO8601")
    frame["numeric_value"] = np.nan
    for i, chunk in enumerate(np.array_split(np.arange(len(frame)), parts)):
        path = root / S.MEDS_DATA_DIR / f"part_{i}" / "0.parquet" if parts > 1 else root / S.MEDS_DATA_DIR / "0.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pandas(frame.iloc[chunk], schema=MEDS_SCHEMA, preserve_index=False), path)
    if splits is not None:
        (root / S.MEDS_SPLITS_FILE).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(
            pa.table({S.MEDS_SUBJECT_ID: pa.array(list(splits), pa.int64()), S.MEDS_SPLIT: list(splits.values())}),
            root / S.MEDS_SPLITS_FILE,
        )
    return root


def config(all_train: bool = False, **meds_settings: object) -> EtlConfig:
    split = SplitConfig(train=1.0, tuning=0.0, held_out=0.0) if all_train else SplitConfig()
    return EtlConfig(format="meds", meds=MedsConfig(**meds_settings), split=split)  # type: ignore[arg-type]


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
def test_reader_selects_births_and_diagnoses_and_counts_the_rest_as_filtered(tmp_path: Path) -> None:
    raw = meds.read(write_meds(tmp_path, COHORT), config())
    name = f"{S.MEDS_DATA_DIR}/0.parquet"
    assert raw.rows_read == {name: len(COHORT)}
    assert len(raw.patients) == N_BIRTHS and len(raw.events) == N_DIAGNOSES
    assert raw.filtered == {name: len(COHORT) - N_BIRTHS - N_DIAGNOSES}
    assert raw.patient_id_type == "int64"
    assert raw.source_splits is None
    ev = raw.events
    first = ev[ev[S.SOURCE_ROW] == 6].iloc[0]  # DIAGNOSIS//ICD//10//I10
    assert (first[S.PATIENT_ID], first[S.CODE], first[S.CODE_SYSTEM]) == ("1", "I10", "ICD10CM")
    assert set(ev.loc[ev[S.CODE] == "4019", S.CODE_SYSTEM]) == {"ICD9CM"}  # ICD-9 kept apart from ICD-10
    death = raw.patients.set_index(S.PATIENT_ID).loc["2", S.DEATH_DATE]
    assert pd.Timestamp(death) == pd.Timestamp("2022-01-01")
    notes = raw.notes
    assert notes["meds.diagnosis_rows"] == N_DIAGNOSES
    assert notes["meds.diagnosis_rows.ICD9CM"] == 3 and notes["meds.diagnosis_rows.ICD10CM"] == N_DIAGNOSES - 3
    assert notes["meds.subjects"] == 5 and notes["meds.subjects_without_birth"] == 1
    assert notes["meds.admissions"] == 1 and notes["meds.admissions_without_discharge"] == 0


@pytest.mark.parametrize(
    ("rule", "visits_of_1"),
    [("admission", 2), ("same_day", 3), ("same_time", 4)],
)
def test_visit_rules(tmp_path: Path, rule: str, visits_of_1: int) -> None:
    cfg = config(all_train=True, visit_rule=rule)
    manifest = run_etl(write_meds(tmp_path / "in", COHORT), tmp_path / "out", cfg, progress=False)
    assert_reconciles(manifest)
    streams = token_streams(tmp_path / "out")
    assert max(streams["1"]["visit_index"]) + 1 == visits_of_1
    if rule == "admission":  # the stay holds the diagnosis of its second day and those at discharge
        stay = [t for t, v in zip(streams["1"]["tokens"], streams["1"]["visit_index"]) if v == 0]
        assert sorted(stay) == ["ICD10CM/E119", "ICD10CM/I10", "ICD10CM/N39", "ICD9CM/4019", S.CLS, S.SEP]


def test_quarantine_reasons_and_reconciliation(tmp_path: Path) -> None:
    manifest = run_etl(write_meds(tmp_path / "in", COHORT), tmp_path / "out", config(), progress=False)
    assert_reconciles(manifest)
    quarantine = pd.read_parquet(tmp_path / "out" / S.QUARANTINE_FILE)
    reasons = {(r[S.PATIENT_ID], r[S.SOURCE_ROW]): r[S.REASON] for _, r in quarantine.iterrows()}
    R = S.Reason
    assert reasons == {
        ("2", 13): R.BEFORE_BIRTH,
        ("2", 17): R.AFTER_DEATH,
        ("3", 18): R.MISSING_BIRTH,
        ("4", 20): R.CONFLICTING_PATIENT_ROWS,
        ("4", 21): R.CONFLICTING_PATIENT_ROWS,
        ("4", 22): R.PATIENT_REJECTED,
    }
    table = manifest["tables"][f"{S.MEDS_DATA_DIR}/0.parquet"]
    assert table["rows"] == len(COHORT) and table["quarantined"] == len(reasons)
    assert table["filtered"] == len(COHORT) - N_BIRTHS - N_DIAGNOSES
    assert manifest["reader"]["meds.diagnoses_without_birth"] == 1
    assert manifest["patient_id_type"] == "int64"
    assert set(token_streams(tmp_path / "out")) == {"1", "2"}


def test_quarantine_holds_the_code_as_read(tmp_path: Path) -> None:
    """Quarantined diagnoses show the MEDS code as written (blanks stripped), not the extracted code."""
    rows = [(s, t, f" {code} " if s == 2 else code) for s, t, code in COHORT]
    manifest = run_etl(write_meds(tmp_path / "in", rows), tmp_path / "out", config(), progress=False)
    assert_reconciles(manifest)
    quarantine = pd.read_parquet(tmp_path / "out" / S.QUARANTINE_FILE).set_index(S.SOURCE_ROW)
    assert quarantine.loc[13, S.CODE] == "DIAGNOSIS//ICD//9//V08"  # event_before_birth
    assert quarantine.loc[17, S.CODE] == "DIAGNOSIS//ICD//10//I10"  # event_after_death
    assert quarantine.loc[18, S.CODE] == "DIAGNOSIS//ICD//10//I10"  # missing_birth
    assert quarantine.loc[20, S.CODE] == ""  # a patient row


def test_subject_splits_are_honoured(tmp_path: Path) -> None:
    given = {1: S.HELD_OUT, 2: S.TUNING, 77: S.TRAIN}
    raw = meds.read(write_meds(tmp_path / "in", COHORT, splits=given), config())
    assert raw.source_splits is not None
    assert dict(zip(raw.source_splits[S.PATIENT_ID], raw.source_splits[S.SPLIT])) == {
        str(k): v for k, v in given.items()
    }
    run_etl(tmp_path / "in", tmp_path / "out", config(), progress=False)
    streams = token_streams(tmp_path / "out")
    assert streams["1"]["split"] == S.HELD_OUT and streams["2"]["split"] == S.TUNING


def test_unknown_split_name_stops(tmp_path: Path) -> None:
    write_meds(tmp_path, COHORT, splits={1: "validation"})
    with pytest.raises(InputSchemaError, match=r"subject_splits\.parquet.*'split'.*'validation'"):
        meds.read(tmp_path, config())


def test_shards_and_part_files_give_the_same_result(tmp_path: Path) -> None:
    one = run_etl(write_meds(tmp_path / "a", COHORT), tmp_path / "out_a", config(), progress=False)
    cfg = config()
    cfg.shards = 3
    many = run_etl(write_meds(tmp_path / "b", COHORT, parts=3), tmp_path / "out_b", cfg, progress=False)
    assert_reconciles(many)
    assert sum(t["rows"] for t in many["tables"].values()) == len(COHORT)
    for key in ("quarantine_reasons", "events_used", "patients", "vocabulary"):
        assert one[key] == many[key], key
    assert {k: v for k, v in one["reader"].items()} == many["reader"]
    assert token_streams(tmp_path / "out_a") == token_streams(tmp_path / "out_b")


@pytest.mark.parametrize("rule", ["admission", "same_day", "same_time"])
def test_same_tokens_as_the_visits_format(tmp_path: Path, rule: str) -> None:
    """The usable part of the cohort written as visits-format tables gives identical token streams."""
    run_etl(write_meds(tmp_path / "meds", COHORT), tmp_path / "out_meds", config(visit_rule=rule), progress=False)
    visits_in = tmp_path / "visits"
    visits_in.mkdir()
    pd.DataFrame(
        {
            S.PATIENT_ID: ["1", "2", "5"],
            S.BIRTH_DATE: ["1980-01-01", "1990-06-15", "2000-01-01"],
            S.DEATH_DATE: ["", "2022-01-01", ""],
        }
    ).to_csv(visits_in / "patients.csv", index=False)
    stay = "stay" if rule == "admission" else ""
    events = [
        ("1", "2020-01-02T10:00", "N39", "ICD10CM", stay),
        ("1", "2020-01-03T12:00", "I10", "ICD10CM", stay),
        ("1", "2020-01-03T12:00", "E11.9", "ICD10CM", stay),
        ("1", "2020-01-03T12:00", "4019", "ICD9CM", stay),
        ("1", "2021-05-05T10:00", "J45", "ICD10CM", ""),
        ("1", "2021-05-05T15:00", "R05", "ICD10CM", ""),
        ("2", "2021-01-01T11:00", "25000", "ICD9CM", ""),
        ("2", "2021-01-01T11:00", "E119", "ICD10CM", ""),
    ]
    frame = pd.DataFrame(events, columns=[S.PATIENT_ID, S.DATE, S.CODE, S.CODE_SYSTEM, S.VISIT_ID])
    if rule == "same_time":
        frame[S.VISIT_ID] = frame[S.DATE]
    frame.to_csv(visits_in / "events.csv", index=False)
    run_etl(visits_in, tmp_path / "out_visits", EtlConfig(format="visits"), progress=False)
    assert token_streams(tmp_path / "out_meds") == token_streams(tmp_path / "out_visits")


def test_wrong_type_names_file_column_and_example(tmp_path: Path) -> None:
    path = tmp_path / S.MEDS_DATA_DIR / "0.parquet"
    path.parent.mkdir(parents=True)
    pq.write_table(pa.table({S.MEDS_SUBJECT_ID: [1], S.MEDS_TIME: [20200101.5], S.MEDS_CODE: ["MEDS_BIRTH"]}), path)
    with pytest.raises(InputSchemaError, match=r"0\.parquet: column 'time' has type double.*20200101\.5"):
        meds.read(tmp_path, config())


def test_missing_column_and_missing_data_folder(tmp_path: Path) -> None:
    with pytest.raises(InputSchemaError, match="no MEDS event files"):
        meds.read(tmp_path, config())
    path = tmp_path / S.MEDS_DATA_DIR / "0.parquet"
    path.parent.mkdir(parents=True)
    pq.write_table(pa.table({S.MEDS_SUBJECT_ID: [1], S.MEDS_TIME: ["2020-01-01"]}), path)
    with pytest.raises(InputSchemaError, match=r"missing required column 'code'.*example row"):
        meds.read(tmp_path, config())


def test_custom_pattern_and_template(tmp_path: Path) -> None:
    root = write_meds(tmp_path, COHORT)
    raw = meds.read(root, config(code_patterns=[r"=^DIAGNOSIS//ICD//10//(?P<code>.+)$"]))
    assert set(raw.events[S.CODE_SYSTEM]) == {""} and "4019" not in set(raw.events[S.CODE])
    assert sum(raw.filtered.values()) == len(COHORT) - N_BIRTHS - (N_DIAGNOSES - 3)
    assert raw.notes["meds.code_pattern_rows.=^DIAGNOSIS//ICD//10//(?P<code>.+)$"] == N_DIAGNOSES - 3
    raw = meds.read(root, config(code_patterns=[r"WHO{v}=^DIAGNOSIS//ICD//(?P<v>9|10)//(?P<code>.+)$"]))
    assert set(raw.events[S.CODE_SYSTEM]) == {"WHO9", "WHO10"}
    with pytest.raises(UserError, match="needs a named group"):
        meds.read(root, config(code_patterns=[r"X=^DIAGNOSIS//(.+)$"]))
    with pytest.raises(UserError, match=r"code_patterns entry .*RE2 syntax"):
        meds.read(root, config(code_patterns=[r"X=^(?P<code>[A-Z]+)(?=9)"]))
    with pytest.raises(UserError, match="must be TEMPLATE=REGEX"):
        meds.read(root, config(code_patterns=[r"^DIAGNOSIS//(?P<code>.+)$"]))
    with pytest.raises(UserError, match=r"template fields \['w'\]"):
        meds.read(root, config(code_patterns=[r"{w}=^DIAGNOSIS//(?P<code>.+)$"]))


def test_text_ids_and_times(tmp_path: Path) -> None:
    path = tmp_path / S.MEDS_DATA_DIR / "0.parquet"
    path.parent.mkdir(parents=True)
    pq.write_table(
        pa.table(
            {
                S.MEDS_SUBJECT_ID: ["a", "a", "a"],
                S.MEDS_TIME: ["2000-01-01", "2020-01-01T10:00:00", "not a time"],
                S.MEDS_CODE: ["MEDS_BIRTH", "DIAGNOSIS//ICD//10//I10", "DIAGNOSIS//ICD//10//E11"],
            }
        ),
        path,
    )
    manifest = run_etl(tmp_path, tmp_path / "out", config(visit_rule="same_day"), progress=False)
    assert_reconciles(manifest)
    assert manifest["patient_id_type"] == "string"
    assert manifest["quarantine_reasons"] == {S.Reason.UNPARSEABLE_DATE: 1}


def test_codes_with_surrounding_blanks_read_as_without(tmp_path: Path) -> None:
    """Blanks around codes (a fixed-width or hand-made export) change nothing: births, stays and diagnoses
    are found as they are in the clean dataset, as the visits and OMOP readers strip their codes."""
    results = {}
    for name, rows in (("clean", COHORT), ("padded", [(s, t, f" {code}  ") for s, t, code in COHORT])):
        manifest = run_etl(write_meds(tmp_path / name, rows), tmp_path / f"out_{name}", config(True), progress=False)
        results[name] = (token_streams(tmp_path / f"out_{name}"), manifest["tables"], manifest["reader"])
    assert results["padded"] == results["clean"]
    assert results["clean"][2]["meds.visit_rule"] == "admission (auto)"
    assert results["clean"][0]["2"]["tokens"] == ["[CLS]", "ICD10CM/E119", "ICD9CM/25000", "[SEP]"]


def write_file(root: Path, name: str, ids: list, times: pa.Array | list, codes: list) -> None:
    """One MEDS event file ``data/<name>.parquet`` with the columns typed as given."""
    path = root / S.MEDS_DATA_DIR / f"{name}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({S.MEDS_SUBJECT_ID: ids, S.MEDS_TIME: times, S.MEDS_CODE: codes}), path)


def zoned(texts: list[str], zone: str) -> pa.Array:
    """Local wall-clock times as a zoned Arrow timestamp column."""
    local = pd.Series(pd.to_datetime(texts, format="ISO8601")).dt.tz_localize(zone)
    return pa.array(local, pa.timestamp("us", zone))


BIRTH_AND_I10 = ["MEDS_BIRTH", "DIAGNOSIS//ICD//10//I10"]
MIXED_LAYOUTS = {  # the second file's subject 2 differs from the first's subject 1 in one column type
    "text_times": (
        [1, 1],
        pa.array([dt.datetime(1980, 1, 1), dt.datetime(2010, 1, 1, 9)], pa.timestamp("us")),
        [2, 2],
        ["1970-01-01", "2000-01-01T09:00:00"],
    ),
    "zoned_times": (
        [1, 1],
        pa.array([dt.datetime(1980, 1, 1), dt.datetime(2010, 1, 1, 9)], pa.timestamp("us")),
        [2, 2],
        zoned(["1970-01-01", "2000-01-01 09:00"], "Europe/Paris"),
    ),
    "text_ids": (
        [1, 1],
        pa.array([dt.datetime(1980, 1, 1), dt.datetime(2010, 1, 1, 9)], pa.timestamp("us")),
        ["2", "2"],
        pa.array([dt.datetime(1970, 1, 1), dt.datetime(2000, 1, 1, 9)], pa.timestamp("ms")),
    ),
}


@pytest.mark.parametrize("layout", sorted(MIXED_LAYOUTS))
@pytest.mark.parametrize("shards", [1, 2])
def test_files_whose_column_types_differ_are_read_together(tmp_path: Path, layout: str, shards: int) -> None:
    """Each layout is accepted alone, so files mixing them are too: ids as text, times parsed per file."""
    ids_a, times_a, ids_b, times_b = MIXED_LAYOUTS[layout]
    write_file(tmp_path / "in", "0", ids_a, times_a, BIRTH_AND_I10)
    write_file(tmp_path / "in", "1", ids_b, times_b, BIRTH_AND_I10)
    cfg = config(all_train=True)
    cfg.shards = shards
    manifest = run_etl(tmp_path / "in", tmp_path / "out", cfg, progress=False)
    assert_reconciles(manifest)
    assert manifest["quarantine_reasons"] == {}
    assert [t["used"] for t in manifest["tables"].values()] == [2, 2]
    assert manifest["patient_id_type"] == ("string" if layout == "text_ids" else "int64")
    streams = token_streams(tmp_path / "out")
    assert streams["1"]["tokens"] == streams["2"]["tokens"] == [S.CLS, "ICD10CM/I10", S.SEP]
    assert (streams["1"]["ages"], streams["2"]["ages"]) == ([30.0014] * 3, [29.9986] * 3)  # 10958, 10957 days
    tokens = pd.read_parquet(tmp_path / "out" / S.TOKENS_DIR).set_index(S.PATIENT_ID)
    assert pd.Timestamp(tokens.loc["2", S.VISIT_DATES][0]) == pd.Timestamp("2000-01-01 09:00")


def test_zoned_times_keep_their_local_day(tmp_path: Path) -> None:
    """An event at 00:30 (UTC+2) on the day of birth is on that day, not the day before in UTC."""
    times = zoned(["2020-03-01", "2020-03-01 00:30", "2020-05-05 01:00", "2020-05-05 23:00"], "+02:00")
    codes = ["MEDS_BIRTH", "DIAGNOSIS//ICD//10//P073", "DIAGNOSIS//ICD//10//E11", "DIAGNOSIS//ICD//10//I10"]
    write_file(tmp_path / "in", "0", [1] * 4, times, codes)
    manifest = run_etl(tmp_path / "in", tmp_path / "out", config(all_train=True, visit_rule="same_day"), progress=False)
    assert_reconciles(manifest)
    assert manifest["quarantine_reasons"] == {}
    assert token_streams(tmp_path / "out")["1"]["visit_index"] == [0, 0, 0, 1, 1, 1]


def test_lower_case_codes_are_read_in_upper_case_and_codes_that_match_keep_their_tokens(tmp_path: Path) -> None:
    """An export that lower-cases some codes loses no diagnosis; a code that matches as written is unchanged."""
    codes = ["MEDS_BIRTH", "diagnosis//icd//10//e119", "DIAGNOSIS//ICD//10//I10", "ICD10CM/k21.9", "lab//1"]
    time = pa.array([dt.datetime(1980, 1, 1)] + [dt.datetime(2010, 1, 1)] * 4, pa.timestamp("us"))
    write_file(tmp_path / "in", "0", [1] * 5, time, codes)
    manifest = run_etl(tmp_path / "in", tmp_path / "out", config(all_train=True), progress=False)
    assert_reconciles(manifest)
    assert manifest["reader"]["meds.diagnosis_rows"] == 3 and manifest["filtered_code_prefixes"] == {"lab//": 1}
    vocabulary = set(pd.read_parquet(tmp_path / "out" / S.VOCAB_FILE)["token"])
    assert {"ICD10CM/E119", "ICD10CM/I10", "ICD10CM/k219"} <= vocabulary  # ICD codes lose their dot


def test_rows_without_a_code_are_quarantined_as_empty_code(tmp_path: Path) -> None:
    """A null, empty or blank code is a bad row (``empty_code``), as in the other formats, not a filtered
    one; the manifest still reconciles."""
    codes = ["MEDS_BIRTH", "DIAGNOSIS//ICD//10//I10", None, "", "   ", "LAB//1//x"]
    time = pa.array([dt.datetime(1980, 1, 1)] + [dt.datetime(2010, 1, 1)] * 5, pa.timestamp("us"))
    write_file(tmp_path / "in", "0", [1] * 6, time, codes)
    manifest = run_etl(tmp_path / "in", tmp_path / "out", config(), progress=False)
    assert_reconciles(manifest)
    table = manifest["tables"][f"{S.MEDS_DATA_DIR}/0.parquet"]
    assert (table["rows"], table["used"], table["quarantined"], table["filtered"]) == (6, 2, 3, 1)
    assert manifest["quarantine_reasons"] == {S.Reason.EMPTY_CODE: 3}
    assert manifest["filtered_code_prefixes"] == {"LAB//": 1}
    assert manifest["reader"]["meds.diagnosis_rows"] == 1
    quarantine = pd.read_parquet(tmp_path / "out" / S.QUARANTINE_FILE)
    assert quarantine[S.SOURCE_ROW].tolist() == [2, 3, 4]
    assert set(quarantine[S.CODE]) == {""} and set(quarantine[S.PATIENT_ID]) == {"1"}


# ---------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_real_sample(tmp_path: Path) -> None:
    if not (REAL / S.MEDS_DATA_DIR).is_dir():
        pytest.skip(f"real MEDS sample not found at {REAL}")
    manifest = run_etl(REAL, tmp_path / "out", config(), progress=False)
    assert_reconciles(manifest)
    table = manifest["tables"][f"{S.MEDS_DATA_DIR}/0.parquet"]
    assert table["rows"] == 916_166
    reader = manifest["reader"]
    assert reader["meds.subjects"] == 100 and reader["meds.birth_events"] == 100
    icd9, icd10 = reader["meds.diagnosis_rows.ICD9CM"], reader["meds.diagnosis_rows.ICD10CM"]
    assert icd9 > 1000 and icd10 > 1000 and reader["meds.diagnosis_rows"] == icd9 + icd10
    assert reader["meds.visit_rule"] == "admission (auto)"
    assert table["used"] == 100 + reader["meds.diagnosis_rows"] - table["quarantined"] - table["duplicates_dropped"]
    assert reader["meds.diagnoses_outside_admission"] < 0.05 * reader["meds.diagnosis_rows"]
    assert manifest["patients"]["with_tokens"] == 100
    assert manifest["patient_id_type"] == "int64"
    assert manifest["vocabulary"]["codes"] > 500
