"""Token layout: [CLS] visit [SEP] ..., ages, segments, visit grouping, merging, truncation, code normalisation."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from conftest import ALL_TRAIN, EtlOutput

from behrt_rope import schema as S
from behrt_rope.data.labels import TaskConfig, build_samples
from behrt_rope.data.sequences import load_tokens
from behrt_rope.etl.clean import clean
from behrt_rope.etl.codes import fit_vocabulary, normalise_code, token_categorical, tokens_of
from behrt_rope.etl.config import EtlConfig
from behrt_rope.etl.raw import events_frame, patients_frame
from behrt_rope.etl.tokenize import DAYS_PER_YEAR, structure, to_token_table, visit_keys

Run = Callable[..., EtlOutput]
P1 = [{"patient_id": "p1", "birth_date": "2000-01-01"}]


def ev(date: str, code: str, visit_id: str = "", patient: str = "p1") -> dict[str, str]:
    return {"patient_id": patient, "date": date, "code": code, "visit_id": visit_id}


def _row(out: EtlOutput, patient: str = "p1") -> pd.Series:
    return out.tokens.set_index(S.PATIENT_ID).loc[patient]


# ---------------------------------------------------------------------------------------------------------
# Layout of one patient's stream
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture
def two_visits(etl_run: Run) -> EtlOutput:
    events = [ev("2010-01-01", "I10"), ev("2010-01-01", "E11"), ev("2012-07-01", "J45")]
    return etl_run(P1, events, split=ALL_TRAIN)


def test_cls_visit_sep_layout(two_visits: EtlOutput) -> None:
    assert two_visits.token_strings("p1") == ["[CLS]", "E11", "I10", "[SEP]", "J45", "[SEP]"]
    row = _row(two_visits)
    # vocabulary: 5 special tokens, then codes alphabetically: E11=5, I10=6, J45=7
    assert row[S.TOKEN_IDS].tolist() == [S.CLS_ID, 5, 6, S.SEP_ID, 7, S.SEP_ID]
    assert (row[S.N_VISITS], row[S.N_TOKENS]) == (2, 6)


def test_ages_to_the_day(two_visits: EtlOutput) -> None:
    ages = _row(two_visits)[S.AGES]
    first, second = np.float32(3653 / DAYS_PER_YEAR), np.float32(4565 / DAYS_PER_YEAR)  # 2010-01-01, 2012-07-01
    assert ages.dtype == np.float32
    assert ages.tolist() == [first, first, first, first, second, second]  # [CLS] takes the first visit's age


def test_segments_visit_index_and_dates(two_visits: EtlOutput) -> None:
    row = _row(two_visits)
    assert row[S.SEGMENTS].tolist() == [0, 0, 0, 0, 1, 1]
    assert row[S.VISIT_INDEX].tolist() == [0, 0, 0, 0, 1, 1]
    dates = pd.to_datetime(row[S.VISIT_DATES]).strftime("%Y-%m-%d").tolist()
    assert dates == ["2010-01-01"] * 4 + ["2012-07-01"] * 2
    assert row[S.LAST_EVENT_TIME] == pd.Timestamp("2012-07-01")
    assert row[S.BIRTH_DATE] == pd.Timestamp("2000-01-01") and pd.isna(row[S.DEATH_DATE])


def test_segments_alternate_over_many_visits(etl_run: Run) -> None:
    events = [ev(f"201{i}-01-01", "I10") for i in range(5)]
    row = _row(etl_run(P1, events, split=ALL_TRAIN))
    assert row[S.SEGMENTS].tolist() == [0, 0, 0, 1, 1, 0, 0, 1, 1, 0, 0]
    assert row[S.VISIT_INDEX].tolist() == [0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4]


def test_token_table_schema(two_visits: EtlOutput) -> None:
    import pyarrow.parquet as pq

    schema = pq.read_schema(two_visits.out / S.TOKENS_DIR / "part-00000.parquet")
    assert schema.equals(S.TOKENS, check_metadata=False)


# ---------------------------------------------------------------------------------------------------------
# Visits
# ---------------------------------------------------------------------------------------------------------
def test_same_visit_id_on_different_days_is_one_visit_dated_by_the_earliest(etl_run: Run) -> None:
    events = [ev("2010-01-03", "I10", "v1"), ev("2010-01-01", "E11", "v1"), ev("2010-01-02", "J45", "v2")]
    out = etl_run(P1, events, split=ALL_TRAIN)
    assert out.token_strings("p1") == ["[CLS]", "E11", "I10", "[SEP]", "J45", "[SEP]"]
    dates = pd.to_datetime(_row(out)[S.VISIT_DATES]).strftime("%Y-%m-%d").tolist()
    assert dates == ["2010-01-01"] * 4 + ["2010-01-02"] * 2


def test_same_day_events_without_visit_id_are_one_visit(etl_run: Run) -> None:
    events = [ev("2010-01-01T08:00", "I10"), ev("2010-01-01T17:30", "E11"), ev("2010-01-02T00:00", "J45")]
    out = etl_run(P1, events, split=ALL_TRAIN)
    assert out.token_strings("p1") == ["[CLS]", "E11", "I10", "[SEP]", "J45", "[SEP]"]
    times = pd.to_datetime(_row(out)[S.VISIT_DATES])
    assert times[0] == pd.Timestamp("2010-01-01T08:00")  # the visit's time is its earliest event


def test_visit_id_and_no_visit_id_on_the_same_day_are_two_visits(etl_run: Run) -> None:
    events = [ev("2010-01-01", "I10", "v9"), ev("2010-01-01", "E11")]
    out = etl_run(P1, events, split=ALL_TRAIN)
    # same time: the visit without an id comes first, then visits by id
    assert out.token_strings("p1") == ["[CLS]", "E11", "[SEP]", "I10", "[SEP]"]


def test_same_time_visits_are_ordered_by_visit_id(etl_run: Run) -> None:
    events = [ev("2010-01-01", "A01", "vb"), ev("2010-01-01", "B01", "va")]
    out = etl_run(P1, events, split=ALL_TRAIN)
    assert out.token_strings("p1") == ["[CLS]", "B01", "[SEP]", "A01", "[SEP]"]


def test_visit_ids_are_per_patient(etl_run: Run) -> None:
    patients = [*P1, {"patient_id": "p2", "birth_date": "1990-01-01"}]
    events = [ev("2010-01-01", "I10", "v1"), ev("2011-01-01", "E11", "v1", patient="p2")]
    out = etl_run(patients, events, split=ALL_TRAIN)
    assert out.token_strings("p1") == ["[CLS]", "I10", "[SEP]"]
    assert out.token_strings("p2") == ["[CLS]", "E11", "[SEP]"]


def test_repeated_codes_in_a_visit_are_merged_and_counted(etl_run: Run) -> None:
    events = [
        ev("2010-01-01", "I10"),
        ev("2010-01-01T10:00", "I10"),
        ev("2010-01-01", "I10.0"),
        ev("2011-01-01", "I10"),
    ]
    out = etl_run(P1, events, code_truncate=3, split=ALL_TRAIN)
    assert out.token_strings("p1") == ["[CLS]", "I10", "[SEP]", "I10", "[SEP]"]
    assert out.manifest["events_used"] == {
        "events": 4,
        "code_tokens": 2,
        "merged_within_visit": 2,
        "dropped_by_max_seq_len": 0,
        "reconciles": True,
    }


def test_visit_keys_groups_by_visit_id_else_day() -> None:
    t = np.array(["2020-01-01T08", "2020-01-01T17", "2020-01-02", "2020-01-05", "2020-01-01"], dtype="datetime64[us]")
    keys = visit_keys(np.array([0, 0, 0, 0, 1]), np.array(["", "", "v1", "v1", ""], dtype=object), t)
    assert keys.tolist() == [0, 0, 1, 1, 2]


# ---------------------------------------------------------------------------------------------------------
# Truncation
# ---------------------------------------------------------------------------------------------------------
def test_truncation_drops_whole_oldest_visits(etl_run: Run) -> None:
    events = [
        ev("2010-01-01", "A01"),
        ev("2010-01-01", "A02"),  # visit 0: 3 tokens
        ev("2011-01-01", "B01"),  # visit 1: 2 tokens
        ev("2012-01-01", "C01"),
        ev("2012-01-01", "C02"),
    ]  # visit 2: 3 tokens
    out = etl_run(P1, events, max_seq_len=6, split=ALL_TRAIN)  # [CLS] + 2 + 3 = 6 fits; + 3 would not
    assert out.token_strings("p1") == ["[CLS]", "B01", "[SEP]", "C01", "C02", "[SEP]"]
    row = _row(out)
    assert row[S.VISIT_INDEX].tolist() == [0, 0, 0, 1, 1, 1]  # renumbered from 0 after truncation
    assert row[S.AGES][0] == np.float32(4018 / DAYS_PER_YEAR)  # [CLS] takes the oldest kept visit's age
    assert out.manifest["truncation"] == {
        "max_seq_len": 6,
        "patients_truncated": 1,
        "visits_dropped": 1,
        "events_dropped": 2,
        "visits_thinned_to_first_records": 0,
    }
    assert out.manifest["events_used"]["dropped_by_max_seq_len"] == 2
    assert out.manifest["events_used"]["reconciles"]


THINNING_EVENTS = [
    ev("2010-01-01", "A01"),
    ev("2010-01-01", "B01"),  # visit 0: A01 and B01 first recorded
    ev("2011-01-01", "A01"),
    ev("2011-01-01", "C01"),  # visit 1: C01 first recorded
    ev("2012-01-01", "A01"),  # visit 2: nothing new
    ev("2013-01-01", "A01"),
    ev("2013-01-01", "D01"),  # visit 3
    ev("2014-01-01", "E01"),  # visit 4
]


def test_first_records_thin_older_visits_instead_of_dropping_them(etl_run: Run) -> None:
    # 14 tokens whole. At 12, dropping keeps visits 1-4 (11 tokens). Thinning keeps visits 3-4 whole (5 tokens)
    # beside visits 0-1 as their first records (A01 B01 [SEP] C01 [SEP], 5 of at most 6); visit 2 has none.
    dropped = etl_run(P1, THINNING_EVENTS, max_seq_len=12, split=ALL_TRAIN)
    newest = ["A01", "D01", "[SEP]", "E01", "[SEP]"]  # visits 3 and 4
    assert dropped.token_strings("p1") == ["[CLS]", "A01", "C01", "[SEP]", "A01", "[SEP]", *newest]
    out = etl_run(P1, THINNING_EVENTS, max_seq_len=12, keep_first_records=True, split=ALL_TRAIN)
    assert out.token_strings("p1") == ["[CLS]", "A01", "B01", "[SEP]", "C01", "[SEP]", *newest]
    row = _row(out)
    assert row[S.N_THINNED_VISITS] == 2 and _row(dropped)[S.N_THINNED_VISITS] == 0
    assert row[S.VISIT_INDEX].tolist() == [0, 0, 0, 0, 1, 1, 2, 2, 2, 3, 3]
    assert row[S.AGES][4] == np.float32(4018 / DAYS_PER_YEAR)  # C01 keeps its own visit's age (2011-01-01)
    assert out.manifest["truncation"] == {
        "max_seq_len": 12,
        "patients_truncated": 1,
        "visits_dropped": 1,
        "events_dropped": 2,  # A01 at visits 1 and 2: recorded before, so not a first record
        "visits_thinned_to_first_records": 2,
    }
    assert out.manifest["events_used"]["reconciles"]


def test_first_records_fall_back_to_dropping_when_they_do_not_fit(etl_run: Run) -> None:
    # At 9 the thinned older visits would need more than half the stream: the newest visits only, as without
    out = etl_run(P1, THINNING_EVENTS, max_seq_len=9, keep_first_records=True, split=ALL_TRAIN)
    assert out.token_strings("p1") == ["[CLS]", "A01", "[SEP]", "A01", "D01", "[SEP]", "E01", "[SEP]"]
    assert out.manifest["truncation"]["visits_thinned_to_first_records"] == 0
    assert _row(out)[S.N_THINNED_VISITS] == 0


def test_no_label_comes_from_a_thinned_visit(etl_run: Run) -> None:
    out = etl_run(P1, THINNING_EVENTS, max_seq_len=12, keep_first_records=True, split=ALL_TRAIN)
    seqs = load_tokens(out.out)
    samples = build_samples(seqs, TaskConfig())
    # the thinned visits are history only: the one prediction time is the first whole visit (A01 D01)
    assert samples.cuts.tolist() == [9]
    names = out.vocab.set_index("token_id")["token"]
    assert [names[i] for i in seqs.token_ids[slice(*samples.label_spans[0])]] == ["E01"]
    # without thinning, every visit but the last is a prediction time
    dropped = etl_run(P1, THINNING_EVENTS, max_seq_len=12, split=ALL_TRAIN)
    assert len(build_samples(load_tokens(dropped.out), TaskConfig())) == 3


def test_token_files_from_before_thinning_load_with_none_thinned(etl_run: Run) -> None:
    out = etl_run(P1, THINNING_EVENTS, max_seq_len=12, keep_first_records=True, split=ALL_TRAIN)
    part = next((out.out / S.TOKENS_DIR).glob("*.parquet"))
    pq.write_table(pq.read_table(part).drop_columns([S.N_THINNED_VISITS]), part)
    seqs = load_tokens(out.out)
    assert seqs.thinned_visits.tolist() == [0]
    assert len(build_samples(seqs, TaskConfig())) == 3  # read as whole visits: a prediction time at each but the last


def test_truncation_never_splits_a_visit(etl_run: Run) -> None:
    events = [ev("2010-01-01", "A01"), ev("2010-01-01", "A02"), ev("2011-01-01", "B01")]
    out = etl_run(P1, events, max_seq_len=5, split=ALL_TRAIN)  # 1 + 3 + 2 = 6 > 5: the whole first visit goes
    assert out.token_strings("p1") == ["[CLS]", "B01", "[SEP]"]


def test_streams_fit_max_seq_len(etl_run: Run) -> None:
    events = [ev(f"2010-01-{d:02d}", f"C{c:02d}") for d in range(1, 29) for c in range(d % 4 + 1)]
    out = etl_run(P1, events, max_seq_len=20, split=ALL_TRAIN)
    assert 17 <= _row(out)[S.N_TOKENS] <= 20


# ---------------------------------------------------------------------------------------------------------
# Codes
# ---------------------------------------------------------------------------------------------------------
def test_code_truncation_to_three_characters(etl_run: Run) -> None:
    events = [ev("2010-01-01", "E11.9"), ev("2010-01-01", "E119"), ev("2010-01-01", "I1"), ev("2011-01-01", "J45.909")]
    out = etl_run(P1, events, code_truncate=3, split=ALL_TRAIN)
    assert out.token_strings("p1") == ["[CLS]", "E11", "I1", "[SEP]", "J45", "[SEP]"]


def test_codes_kept_whole_without_truncation(etl_run: Run) -> None:
    events = [ev("2010-01-01", "E11.9"), ev("2010-01-01", "E119")]
    assert etl_run(P1, events, split=ALL_TRAIN).token_strings("p1") == ["[CLS]", "E119", "[SEP]"]  # dots stripped
    out = etl_run(P1, events, strip_code_dots=False, split=ALL_TRAIN)
    assert out.token_strings("p1") == ["[CLS]", "E11.9", "E119", "[SEP]"]


def test_code_systems_stay_apart(etl_run: Run) -> None:
    events = [{**ev("2010-01-01", "4019"), "code_system": "ICD9"}, {**ev("2010-01-01", "4019"), "code_system": ""}]
    out = etl_run(P1, events, split=ALL_TRAIN)
    assert out.token_strings("p1") == ["[CLS]", "4019", "ICD9/4019", "[SEP]"]


def test_one_code_system_spelt_three_ways_is_one_vocabulary(etl_run: Run) -> None:
    events = [
        {**ev("2010-01-01", "4019"), "code_system": "ICD-9-CM"},
        {**ev("2010-02-01", "4019"), "code_system": " icd9cm "},
        {**ev("2010-03-01", "4019"), "code_system": "ICD9CM"},
        {**ev("2010-04-01", "4019"), "code_system": "ICD10CM"},
    ]
    out = etl_run(P1, events, split=ALL_TRAIN)
    assert out.token_strings("p1") == [
        "[CLS]", "ICD9CM/4019", "[SEP]", "ICD9CM/4019", "[SEP]", "ICD9CM/4019", "[SEP]", "ICD10CM/4019", "[SEP]",
    ]  # fmt: skip


def test_normalise_code() -> None:
    assert normalise_code("E11.9", "", 3, False) == "E11"
    assert normalise_code("E11.9", "", None, True) == "E119"
    assert normalise_code("E11.9", "", None, False) == "E11.9"
    assert normalise_code("4589", "ICD9", 3, True) == "ICD9/458"


def test_tokens_of_and_token_categorical_agree() -> None:
    codes = np.array(["I10.1", "E11", "I10", "E11"], dtype=object)
    systems = np.array(["", "", "", "X"], dtype=object)
    config = EtlConfig(code_truncate=3)
    assert tokens_of(codes, systems, config).tolist() == ["I10", "E11", "I10", "X/E11"]
    cat = token_categorical(codes, systems, config)
    assert list(cat.categories) == ["E11", "I10", "X/E11"]
    assert np.asarray(cat).tolist() == ["I10", "E11", "I10", "X/E11"]


# ---------------------------------------------------------------------------------------------------------
# The library functions directly (the path ``predict`` re-uses)
# ---------------------------------------------------------------------------------------------------------
def test_structure_accepts_plain_token_strings() -> None:
    patients = patients_frame(
        np.array(["a"], dtype=object),
        np.array(["2000-01-01"], dtype="datetime64[us]"),
        np.array(["2000-01-01"], dtype=object),
        None,
        None,
        "patients",
        np.array([0]),
    )
    raw_t = np.array(["2010-01-02", "2010-01-01", "2010-01-01"], dtype=object)
    events = events_frame(
        np.array(["a"] * 3, dtype=object),
        raw_t.astype("datetime64[us]"),
        raw_t,
        np.array(["J45", "I10", "E11"], dtype=object),
        None,
        None,
        "events",
        np.arange(3),
    )
    cleaned = clean(patients, events)
    tokens = tokens_of(
        cleaned.events[S.CODE].to_numpy(dtype=object), cleaned.events[S.CODE_SYSTEM].to_numpy(dtype=object), EtlConfig()
    )
    structured = structure(cleaned.events, tokens, cleaned.patients, 10)
    vocab = fit_vocabulary(pd.Series({"E11": 1, "I10": 1, "J45": 1}), 1)
    table = to_token_table(structured, vocab, np.array(["train"], dtype=object))
    assert table.column(S.TOKEN_IDS).to_pylist() == [[S.CLS_ID, 5, 6, S.SEP_ID, 7, S.SEP_ID]]
    assert table.schema.equals(S.TOKENS)
