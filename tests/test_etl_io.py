"""Reading raw tables: file discovery, text-only CSV, Parquet types, time parsing and the error messages."""

from __future__ import annotations

import datetime as dt
import gzip
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import ALL_TRAIN, etl, write_table, write_visits

from behrt_rope import schema as S
from behrt_rope.errors import InputSchemaError
from behrt_rope.etl import io

PATIENTS = [{"patient_id": "p1", "birth_date": "2000-01-01"}, {"patient_id": "p2", "birth_date": "1990-06-15"}]
EVENTS = [
    {"patient_id": "p1", "date": "2010-01-01", "code": "0250"},
    {"patient_id": "p1", "date": "2010-01-01", "code": "250"},
    {"patient_id": "p2", "date": "2011-03-04", "code": "E11.9"},
]


# ---------------------------------------------------------------------------------------------------------
# Finding tables
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["events.csv", "events.parquet", "events.csv.gz"])
def test_find_table_single_file(tmp_path: Path, name: str) -> None:
    (tmp_path / name).write_bytes(b"")
    assert io.find_table(tmp_path, "events") == [tmp_path / name]


def test_find_table_folder_of_parts_in_name_order(tmp_path: Path) -> None:
    folder = tmp_path / "events"
    folder.mkdir()
    for name in ("part-2.csv", "part-1.parquet", "notes.txt"):
        (folder / name).write_bytes(b"")
    assert io.find_table(tmp_path, "events") == [folder / "part-1.parquet", folder / "part-2.csv"]


@pytest.mark.parametrize("second", ["events.parquet", "events/part-1.csv"])
def test_a_table_given_twice_stops_naming_both(tmp_path: Path, second: str) -> None:
    """``events.csv`` beside ``events.parquet`` (or a folder of parts): reading one would drop the other."""
    (tmp_path / "events.csv").write_bytes(b"")
    (tmp_path / second).parent.mkdir(exist_ok=True)
    (tmp_path / second).write_bytes(b"")
    with pytest.raises(InputSchemaError, match="'events' table is given 2 times") as err:
        io.find_table(tmp_path, "events")
    assert str(tmp_path / "events.csv") in str(err.value) and "keep one" in str(err.value)
    assert str(tmp_path / second.split("/")[0]) in str(err.value).replace(str(tmp_path / "events.csv"), "")


def test_missing_table_names_directory_and_what_was_looked_for(tmp_path: Path) -> None:
    with pytest.raises(InputSchemaError) as err:
        io.find_table(tmp_path, "patients")
    message = str(err.value)
    assert str(tmp_path) in message and "no 'patients' table" in message and "patients.csv" in message


def test_gzipped_csv_and_part_folders_are_read(tmp_path: Path) -> None:
    src = tmp_path / "in"
    write_table(src, "patients", pd.DataFrame(PATIENTS))
    parts = src / "events"
    write_table(parts, "a", pd.DataFrame(EVENTS[:2]))
    csv = pd.DataFrame(EVENTS[2:]).to_csv(index=False).encode()
    (parts / "b.csv.gz").write_bytes(gzip.compress(csv))
    out = etl(src, tmp_path / "out", split=ALL_TRAIN)
    assert set(out.manifest["tables"]) == {"patients.csv", "events/a.csv", "events/b.csv.gz"}
    assert out.manifest["events_used"]["events"] == 3


@pytest.mark.parametrize("marker", ["NA", "NULL", "null", "\\N"])
def test_csv_null_markers_are_missing_values(tmp_path: Path, marker: str) -> None:
    """R writes NA, SQL exports NULL or \\N: a missing death date or visit id, not a bad date or a visit id."""
    patients = [{**p, "death_date": marker} for p in PATIENTS]
    events = [
        {"patient_id": "p1", "date": "2010-01-01", "code": "E11", "visit_id": marker},
        {"patient_id": "p1", "date": "2010-03-01", "code": "I10", "visit_id": marker},
    ]
    out = etl(write_visits(tmp_path / "in", patients, events), tmp_path / "out", split=ALL_TRAIN)
    assert out.token_strings("p1") == ["[CLS]", "E11", "[SEP]", "I10", "[SEP]"]  # two dates: two visits
    assert out.tokens[S.DEATH_DATE].isna().all() and out.manifest["reconciles"]


@pytest.mark.parametrize("delimiter", ["\t", ";", "|"])
def test_csv_with_another_delimiter_reads_as_with_commas(tmp_path: Path, delimiter: str) -> None:
    """Tab-separated files (Athena's vocabulary, PostgreSQL COPY) and Excel's semicolons are read alike."""
    src = tmp_path / "in"
    src.mkdir()
    pd.DataFrame(PATIENTS).to_csv(src / "patients.csv", sep=delimiter, index=False)
    pd.DataFrame(EVENTS).to_csv(src / "events.csv", sep=delimiter, index=False)
    out = etl(src, tmp_path / "out", split=ALL_TRAIN)
    assert out.token_strings("p1") == ["[CLS]", "0250", "250", "[SEP]"]
    assert out.token_strings("p2") == ["[CLS]", "E119", "[SEP]"]


# ---------------------------------------------------------------------------------------------------------
# Types: CSV is text, Parquet ids may be integers, float codes are refused
# ---------------------------------------------------------------------------------------------------------
def test_csv_is_read_as_text_so_leading_zeros_survive(tmp_path: Path) -> None:
    patients = [{"patient_id": "007", "birth_date": "2000-01-01"}, {"patient_id": "7", "birth_date": "2001-01-01"}]
    events = [
        {"patient_id": "007", "date": "2010-01-01", "code": "0250"},
        {"patient_id": "007", "date": "2010-01-01", "code": "250"},
        {"patient_id": "7", "date": "2010-01-01", "code": "250.0"},
    ]
    out = etl(write_visits(tmp_path / "in", patients, events), tmp_path / "out", split=ALL_TRAIN)
    assert out.tokens[S.PATIENT_ID].tolist() == ["007", "7"]
    assert out.token_strings("007") == ["[CLS]", "0250", "250", "[SEP]"]
    assert out.token_strings("7") == ["[CLS]", "2500", "[SEP]"]  # dots stripped, never a float
    assert out.manifest["patient_id_type"] == "string"


def test_to_text_strips_and_blanks_nulls() -> None:
    assert io.to_text(pa.array([" E11 ", None, "", "0250"])).tolist() == ["E11", "", "", "0250"]
    assert io.to_text(pa.array([250, None, 7], pa.int64())).tolist() == ["250", "", "7"]
    assert io.to_text(pa.chunked_array([pa.array(["a"]), pa.array(["b", "a"])])).tolist() == ["a", "b", "a"]
    assert io.to_text(pa.array([], pa.string())).tolist() == []
    assert io.to_text(pa.nulls(2)).tolist() == ["", ""]


def test_parquet_integer_ids_are_accepted(tmp_path: Path) -> None:
    patients = pd.DataFrame({"patient_id": np.array([12, 3], dtype=np.int64), "birth_date": ["2000-01-01"] * 2})
    events = pd.DataFrame(
        {
            "patient_id": np.array([12, 3, 3], dtype=np.int64),
            "date": ["2010-01-01", "2010-02-02", "2011-02-02"],
            "code": ["I10", "E11", "I10"],
        }
    )
    out = etl(write_visits(tmp_path / "in", patients, events, "parquet"), tmp_path / "out", split=ALL_TRAIN)
    assert out.tokens[S.PATIENT_ID].tolist() == ["12", "3"]
    assert out.manifest["patient_id_type"] == "int64"
    assert out.token_strings("3") == ["[CLS]", "E11", "[SEP]", "I10", "[SEP]"]


def test_parquet_integer_codes_are_text(tmp_path: Path) -> None:
    events = pd.DataFrame({"patient_id": ["p1"], "date": ["2010-01-01"], "code": np.array([250], dtype=np.int32)})
    out = etl(
        write_visits(tmp_path / "in", pd.DataFrame(PATIENTS), events, "parquet"), tmp_path / "out", split=ALL_TRAIN
    )
    assert out.token_strings("p1") == ["[CLS]", "250", "[SEP]"]


def test_parquet_category_columns_are_decoded(tmp_path: Path) -> None:
    events = pd.DataFrame(EVENTS).astype({"code": "category", "patient_id": "category"})
    out = etl(
        write_visits(tmp_path / "in", pd.DataFrame(PATIENTS), events, "parquet"), tmp_path / "out", split=ALL_TRAIN
    )
    assert out.token_strings("p2") == ["[CLS]", "E119", "[SEP]"]


def test_float_code_column_is_refused_with_file_column_and_example(tmp_path: Path) -> None:
    events = pd.DataFrame({"patient_id": ["p1", "p1"], "date": ["2010-01-01"] * 2, "code": [None, 250.0]})
    src = write_visits(tmp_path / "in", pd.DataFrame(PATIENTS), events, "parquet")
    with pytest.raises(InputSchemaError) as err:
        etl(src, tmp_path / "out")
    assert str(err.value) == (
        f"{src / 'events.parquet'}: column 'code' has type double, expected text or integer (example value: 250.0)"
    )


def test_float_patient_id_is_refused(tmp_path: Path) -> None:
    patients = pd.DataFrame({"patient_id": [1.0, 2.0], "birth_date": ["2000-01-01"] * 2})
    src = write_visits(tmp_path / "in", patients, pd.DataFrame(EVENTS), "parquet")
    with pytest.raises(InputSchemaError, match=r"patients\.parquet: column 'patient_id' has type double"):
        etl(src, tmp_path / "out")


# ---------------------------------------------------------------------------------------------------------
# Times
# ---------------------------------------------------------------------------------------------------------
def test_parse_times_formats() -> None:
    parsed = io.parse_times(
        pa.array(
            [
                "2020-01-02",
                " 2020-01-02 ",
                "2020-01-02T10:30:00",
                "2020-01-02 10:30",
                "2020-01-02T10:30:00.250",
                "2020-13-01",
                "2020-02-30",
                "01/02/2020",
                "2020",
                "2020-01",
                "",
                None,
            ]
        )
    )
    expected = [
        "2020-01-02",
        "2020-01-02",
        "2020-01-02T10:30",
        "2020-01-02T10:30",
        "2020-01-02T10:30:00.250",
        "NaT",
        "NaT",
        "NaT",
        "NaT",
        "NaT",
        "NaT",
        "NaT",
    ]
    np.testing.assert_array_equal(parsed, np.array(expected, dtype="datetime64[us]"))


def test_impossible_calendar_dates_are_not_rolled_over() -> None:
    """Arrow's strptime reads 2021-02-29 as 2021-03-01; the parser must refuse it instead."""
    parsed = io.parse_times(pa.array(["2021-02-29", "2020-02-29", "2021-04-31"]))
    assert parsed.tolist() == [None, dt.datetime(2020, 2, 29), None]


def test_text_with_utc_offset_keeps_its_local_wall_time() -> None:
    """The offset is dropped, not applied: birth dates are local dates, so event days must be local too.
    Offsets may differ from row to row; times without one are unchanged."""
    parsed = io.parse_times(
        pa.array(
            [
                "2020-01-01T23:30:00-05:00",
                "2020-01-01T23:30:00Z",
                "2020-01-01T23:30",
                "2020-01-01 23:30:00.5 +0530",
                "2020-01-01T23+02",
                "2020-01-01",
                "2020-01-01T23:30:00+02:00:00",
            ]
        )
    )
    assert parsed.tolist() == [
        dt.datetime(2020, 1, 1, 23, 30),
        dt.datetime(2020, 1, 1, 23, 30),
        dt.datetime(2020, 1, 1, 23, 30),
        dt.datetime(2020, 1, 1, 23, 30, 0, 500000),
        dt.datetime(2020, 1, 1, 23, 0),
        dt.datetime(2020, 1, 1),
        None,
    ]


def test_zoned_parquet_timestamps_keep_their_local_wall_time() -> None:
    local = pd.Series(pd.to_datetime(["2020-01-01 23:30", "2020-07-01 12:00"])).dt.tz_localize("America/New_York")
    assert io.parse_times(pa.array(local)).tolist() == [dt.datetime(2020, 1, 1, 23, 30), dt.datetime(2020, 7, 1, 12)]
    offset = pa.array([dt.datetime(2020, 1, 1, 22, 30)], pa.timestamp("us", "UTC")).cast(pa.timestamp("ms", "+02:00"))
    assert io.parse_times(offset).tolist() == [dt.datetime(2020, 1, 2, 0, 30)]


def test_dates_and_naive_timestamps_pass_through() -> None:
    assert io.parse_times(pa.array([dt.date(2020, 1, 2), None])).tolist() == [dt.datetime(2020, 1, 2), None]
    ts = pa.array([dt.datetime(2020, 1, 2, 3, 4, 5)], pa.timestamp("ms"))
    assert io.parse_times(ts).tolist() == [dt.datetime(2020, 1, 2, 3, 4, 5)]


def test_zoned_event_times_group_into_local_days(tmp_path: Path) -> None:
    """Two New York events on one local day (the second after 19:00, the next day in UTC) form one visit."""
    events = pd.DataFrame(
        {
            "patient_id": ["p1", "p1"],
            "date": pd.Series(pd.to_datetime(["2010-01-01 10:00", "2010-01-01 23:30"])).dt.tz_localize(
                "America/New_York"
            ),
            "code": ["I10", "E11"],
        }
    )
    out = etl(
        write_visits(tmp_path / "in", pd.DataFrame(PATIENTS), events, "parquet"), tmp_path / "out", split=ALL_TRAIN
    )
    row = out.tokens.iloc[0]
    assert out.token_strings("p1") == ["[CLS]", "E11", "I10", "[SEP]"]
    assert pd.Timestamp(row[S.VISIT_DATES][0]) == pd.Timestamp("2010-01-01 10:00")


def test_offset_event_on_the_day_of_birth_is_kept(tmp_path: Path) -> None:
    """00:30 at UTC+2 on the day of birth is that day (not the day before in UTC); two events of one local
    day with an offset form one visit; naive times beside them are read as before."""
    patients = pd.DataFrame([{"patient_id": "p1", "birth_date": "2020-03-01"}, *PATIENTS[1:]])
    events = pd.DataFrame(
        [
            {"patient_id": "p1", "date": "2020-03-01T00:30:00+02:00", "code": "P07.3"},
            {"patient_id": "p2", "date": "2010-05-05T01:00:00+02:00", "code": "E11.9"},
            {"patient_id": "p2", "date": "2010-05-05T23:00:00-05:00", "code": "I10"},
            {"patient_id": "p2", "date": "2010-05-06T00:30:00", "code": "J45"},
        ]
    )
    out = etl(write_visits(tmp_path / "in", patients, events, "csv"), tmp_path / "out", split=ALL_TRAIN)
    assert out.manifest["quarantine_reasons"] == {}
    assert out.manifest["tables"]["events.csv"]["used"] == 4
    assert out.token_strings("p1") == ["[CLS]", "P073", "[SEP]"]
    assert out.token_strings("p2") == ["[CLS]", "E119", "I10", "[SEP]", "J45", "[SEP]"]
    dates = out.tokens.set_index(S.PATIENT_ID).loc["p2", S.VISIT_DATES]
    assert pd.Timestamp(dates[0]) == pd.Timestamp("2010-05-05 01:00")


def test_parquet_date_columns_are_accepted(tmp_path: Path) -> None:
    patients = pd.DataFrame({"patient_id": ["p1"], "birth_date": [dt.date(2000, 1, 1)], "death_date": [None]})
    events = pd.DataFrame({"patient_id": ["p1"], "date": [dt.date(2010, 1, 1)], "code": ["I10"]})
    out = etl(write_visits(tmp_path / "in", patients, events, "parquet"), tmp_path / "out", split=ALL_TRAIN)
    assert out.tokens[S.AGES].iloc[0][0] == pytest.approx(3653 / 365.25)


# ---------------------------------------------------------------------------------------------------------
# Error messages a user reads
# ---------------------------------------------------------------------------------------------------------
def test_missing_column_names_file_column_and_example_row(tmp_path: Path) -> None:
    events = pd.DataFrame({"patient_id": ["p1"], "day": ["2010-01-01"], "code": ["I10"]})
    src = write_visits(tmp_path / "in", pd.DataFrame(PATIENTS), events)
    with pytest.raises(InputSchemaError) as err:
        etl(src, tmp_path / "out")
    assert str(err.value) == (
        f"{src / 'events.csv'}: missing required column 'date' (found columns ['patient_id', 'day', 'code']; "
        "example row: {'patient_id': 'p1', 'day': '2010-01-01', 'code': 'I10'})"
    )


def test_wrong_date_format_in_most_rows_names_file_column_and_example(tmp_path: Path) -> None:
    events = pd.DataFrame(
        {"patient_id": ["p1"] * 3, "date": ["2010-01-01", "01/02/2010", "13/02/2010"], "code": ["I10"] * 3}
    )
    src = write_visits(tmp_path / "in", pd.DataFrame(PATIENTS), events)
    with pytest.raises(InputSchemaError) as err:
        etl(src, tmp_path / "out")
    assert str(err.value) == (
        f"{src / 'events.csv'}: column 'date' is not in ISO date format (YYYY-MM-DD or YYYY-MM-DDTHH:MM:SS): "
        "2 of 3 values do not parse (example row 1: '01/02/2010')"
    )


def test_wrong_birth_date_format_is_reported_for_the_patients_file(tmp_path: Path) -> None:
    patients = pd.DataFrame({"patient_id": ["p1", "p2"], "birth_date": ["01.01.2000", "15.06.1990"]})
    src = write_visits(tmp_path / "in", patients, pd.DataFrame(EVENTS))
    with pytest.raises(InputSchemaError, match=r"patients\.csv: column 'birth_date' is not in ISO date format"):
        etl(src, tmp_path / "out")


def test_a_few_bad_dates_are_quarantined_not_fatal(tmp_path: Path) -> None:
    events = pd.DataFrame(
        {"patient_id": ["p1"] * 3, "date": ["2010-01-01", "2010-02-02", "garbage"], "code": ["I10"] * 3}
    )
    out = etl(write_visits(tmp_path / "in", pd.DataFrame(PATIENTS), events), tmp_path / "out")
    assert out.reasons() == {2: S.Reason.UNPARSEABLE_DATE}


def test_partial_dates_are_quarantined_not_read_as_their_first_day(tmp_path: Path) -> None:
    """pandas reads '2010' as 2010-01-01 and '2010-06' as 2010-06-01: a day the input never gave."""
    events = pd.DataFrame(
        {
            "patient_id": ["p1"] * 4,
            "date": ["2010-01-01", "2010", "2010-06", "2010-06-15"],
            "code": ["I10", "E11", "J45", "I10"],
        }
    )
    out = etl(write_visits(tmp_path / "in", pd.DataFrame(PATIENTS), events), tmp_path / "out")
    assert out.reasons() == {1: S.Reason.UNPARSEABLE_DATE, 2: S.Reason.UNPARSEABLE_DATE}


def test_ragged_csv_row_is_a_user_error_naming_the_file(tmp_path: Path) -> None:
    src = write_visits(tmp_path / "in", pd.DataFrame(PATIENTS), pd.DataFrame(EVENTS))
    with (src / "events.csv").open("a") as f:
        f.write("p1,2010-01-01,I10,extra,fields\n")
    with pytest.raises(InputSchemaError, match=r"events\.csv: cannot read the file: CSV parse error"):
        etl(src, tmp_path / "out")


def test_empty_csv_file_is_a_user_error(tmp_path: Path) -> None:
    src = write_visits(tmp_path / "in", pd.DataFrame(PATIENTS), pd.DataFrame(EVENTS))
    (src / "events.csv").write_text("")
    with pytest.raises(InputSchemaError, match=r"events\.csv: cannot read the file: Empty CSV file"):
        etl(src, tmp_path / "out")


def test_header_only_tables_give_an_empty_dataset(tmp_path: Path) -> None:
    src = tmp_path / "in"
    src.mkdir()
    (src / "patients.csv").write_text("patient_id,birth_date\n")
    (src / "events.csv").write_text("patient_id,date,code\n")
    out = etl(src, tmp_path / "out")
    assert out.manifest["reconciles"] and out.manifest["patients"]["with_tokens"] == 0
    assert len(out.tokens) == 0 and len(out.quarantine) == 0
    assert pq.read_schema(next((out.out / S.TOKENS_DIR).iterdir())).equals(S.TOKENS, check_metadata=False)
