"""Row checks: every quarantine reason from a hand-built row, first-reason order, duplicates, reconciliation."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import numpy as np
import pandas as pd
import pytest
from conftest import ALL_TRAIN, EtlOutput

from behrt_rope import schema as S
from behrt_rope.etl.clean import clean, event_reasons, patient_reasons
from behrt_rope.etl.raw import events_frame, patients_frame
from behrt_rope.schema import Reason

Run = Callable[..., EtlOutput]

# One row per patient reason (row numbers are the source_row the quarantine reports).
PATIENTS = [
    {"patient_id": "p1", "birth_date": "2000-01-01", "death_date": None},  # 0 ok
    {"patient_id": "p2", "birth_date": "1990-01-01", "death_date": "2015-06-30"},  # 1 ok, dies
    {"patient_id": "p3", "birth_date": "notadate", "death_date": None},  # 2
    {"patient_id": "p4", "birth_date": "1980-01-01", "death_date": None},  # 3 conflicts with 4
    {"patient_id": "p4", "birth_date": "1981-01-01", "death_date": None},  # 4
    {"patient_id": "", "birth_date": "1970-01-01", "death_date": None},  # 5
    {"patient_id": "p5", "birth_date": "2000-01-01", "death_date": "soon"},  # 6
    {"patient_id": "p6", "birth_date": "2000-01-01", "death_date": "1999-01-01"},  # 7
    {"patient_id": "p1", "birth_date": "2000-01-01", "death_date": None},  # 8 repeats 0
]
PATIENT_REASONS = {
    2: Reason.UNPARSEABLE_BIRTH_DATE,
    3: Reason.CONFLICTING_PATIENT_ROWS,
    4: Reason.CONFLICTING_PATIENT_ROWS,
    5: Reason.MISSING_PATIENT_ID,
    6: Reason.UNPARSEABLE_DEATH_DATE,
    7: Reason.DEATH_BEFORE_BIRTH,
    8: Reason.DUPLICATE,
}
EVENTS = [
    {"patient_id": "p1", "date": "2010-01-01", "code": "I10"},  # 0 ok
    {"patient_id": "p1", "date": "2010-13-45", "code": "I10"},  # 1
    {"patient_id": "p1", "date": "2010-01-01", "code": " "},  # 2
    {"patient_id": "p9", "date": "2010-01-01", "code": "I10"},  # 3
    {"patient_id": "p3", "date": "2010-01-01", "code": "I10"},  # 4 (p3's row is quarantined)
    {"patient_id": "p4", "date": "2010-01-01", "code": "I10"},  # 5 (p4's rows conflict)
    {"patient_id": "p1", "date": "1999-12-31", "code": "I10"},  # 6
    {"patient_id": "p2", "date": "2015-07-01", "code": "I10"},  # 7
    {"patient_id": "p1", "date": "2010-01-01", "code": "I10"},  # 8 repeats 0
    {"patient_id": None, "date": "2010-01-01", "code": "I10"},  # 9
    {"patient_id": "p2", "date": "2015-06-30", "code": "E11"},  # 10 ok: on the day of death
    {"patient_id": "p1", "date": "2000-01-01", "code": "Z00"},  # 11 ok: on the day of birth
]
EVENT_REASONS = {
    1: Reason.UNPARSEABLE_DATE,
    2: Reason.EMPTY_CODE,
    3: Reason.UNKNOWN_PATIENT,
    4: Reason.PATIENT_REJECTED,
    5: Reason.PATIENT_REJECTED,
    6: Reason.BEFORE_BIRTH,
    7: Reason.AFTER_DEATH,
    8: Reason.DUPLICATE,
    9: Reason.MISSING_PATIENT_ID,
}


@pytest.fixture
def messy(etl_run: Run) -> EtlOutput:
    return etl_run(PATIENTS, EVENTS, split=ALL_TRAIN)


def _reasons(out: EtlOutput, table: str) -> dict[int, str]:
    q = out.quarantine[out.quarantine[S.SOURCE_TABLE] == table]
    return dict(zip(q[S.SOURCE_ROW].tolist(), q[S.REASON].tolist()))


def test_every_patient_reason_from_its_row(messy: EtlOutput) -> None:
    assert _reasons(messy, "patients.csv") == PATIENT_REASONS


def test_every_event_reason_from_its_row(messy: EtlOutput) -> None:
    assert _reasons(messy, "events.csv") == EVENT_REASONS


def test_usable_rows_become_tokens(messy: EtlOutput) -> None:
    assert messy.tokens[S.PATIENT_ID].tolist() == ["p1", "p2"]
    assert messy.token_strings("p1") == ["[CLS]", "Z00", "[SEP]", "I10", "[SEP]"]
    assert messy.token_strings("p2") == ["[CLS]", "E11", "[SEP]"]


def test_quarantine_keeps_raw_values_as_text(messy: EtlOutput) -> None:
    q = messy.quarantine.set_index([S.SOURCE_TABLE, S.SOURCE_ROW])
    assert q.loc[("events.csv", 1), S.TIME] == "2010-13-45"
    assert q.loc[("events.csv", 3), [S.PATIENT_ID, S.CODE]].tolist() == ["p9", "I10"]
    assert q.loc[("patients.csv", 2), S.TIME] == "notadate"  # a patient row shows its birth date
    assert q.loc[("patients.csv", 2), S.CODE] == ""
    assert list(messy.quarantine.columns) == S.QUARANTINE.names
    assert messy.quarantine[[S.SOURCE_TABLE, S.SOURCE_ROW]].equals(
        messy.quarantine[[S.SOURCE_TABLE, S.SOURCE_ROW]].sort_values([S.SOURCE_TABLE, S.SOURCE_ROW])
    )


def test_manifest_reconciles_and_counts_reasons(messy: EtlOutput) -> None:
    tables = messy.manifest["tables"]
    assert tables["patients.csv"] == {
        "rows": 9,
        "used": 2,
        "quarantined": 6,
        "duplicates_dropped": 1,
        "filtered": 0,
        "reconciles": True,
    }
    assert tables["events.csv"] == {
        "rows": 12,
        "used": 3,
        "quarantined": 8,
        "duplicates_dropped": 1,
        "filtered": 0,
        "reconciles": True,
    }
    assert messy.manifest["reconciles"]
    assert messy.manifest["quarantine_reasons"] == dict(
        sorted(Counter([*PATIENT_REASONS.values(), *EVENT_REASONS.values()]).items())
    )


def test_first_reason_that_applies_is_recorded(etl_run: Run) -> None:
    events = [
        {"patient_id": "ghost", "date": "garbage", "code": ""},  # unknown patient before date and code
        {"patient_id": "p1", "date": "garbage", "code": ""},  # unparseable date before empty code
        {"patient_id": "p1", "date": "1990-01-01", "code": ""},  # empty code before before-birth
        {"patient_id": "p1", "date": "2010-01-01", "code": "I10"},
        {"patient_id": "p1", "date": "2010-01-02", "code": "I10"},
    ]
    out = etl_run(PATIENTS[:1], events, max_invalid_fraction=0.9)
    assert out.reasons() == {0: Reason.UNKNOWN_PATIENT, 1: Reason.UNPARSEABLE_DATE, 2: Reason.EMPTY_CODE}


def test_visit_longer_than_max_seq_len_quarantines_the_patient(etl_run: Run) -> None:
    patients = [{"patient_id": "long", "birth_date": "2000-01-01"}, {"patient_id": "fine", "birth_date": "2000-01-01"}]
    events = [
        {"patient_id": "long", "date": "2009-01-01", "code": "A01"},  # 0: an older visit that would fit
        {"patient_id": "long", "date": "2010-01-01", "code": "A01"},  # 1-3: the latest visit, 3 codes
        {"patient_id": "long", "date": "2010-01-01", "code": "B01"},
        {"patient_id": "long", "date": "2010-01-01", "code": "C01"},
        {"patient_id": "fine", "date": "2010-01-01", "code": "A01"},
    ]
    out = etl_run(patients, events, max_seq_len=4, split=ALL_TRAIN)  # [CLS] + 3 codes + [SEP] = 5 > 4
    assert out.reasons() == {r: Reason.VISIT_TOO_LONG for r in range(4)}
    assert out.tokens[S.PATIENT_ID].tolist() == ["fine"]
    events_table = out.manifest["tables"]["events.csv"]
    assert (events_table["used"], events_table["quarantined"], events_table["reconciles"]) == (1, 4, True)
    assert out.manifest["events_used"] == {
        "events": 1,
        "code_tokens": 1,
        "merged_within_visit": 0,
        "dropped_by_max_seq_len": 0,
        "reconciles": True,
    }


def test_duplicate_keeps_the_first_copy_in_file_order(etl_run: Run) -> None:
    events = [{"patient_id": "p1", "date": "2010-01-01", "code": "I10"}] * 3
    out = etl_run(PATIENTS[:1], events)
    assert out.reasons() == {1: Reason.DUPLICATE, 2: Reason.DUPLICATE}
    assert out.manifest["tables"]["events.csv"]["duplicates_dropped"] == 2


def test_duplicate_keeper_does_not_depend_on_row_order(etl_run: Run) -> None:
    """Two spellings of the same time are duplicates; the copy kept is chosen by its text, not its row."""
    a = {"patient_id": "p1", "date": "2010-01-01T00:00:00", "code": "I10"}
    b = {"patient_id": "p1", "date": "2010-01-01", "code": "I10"}
    for rows in ([a, b], [b, a]):
        q = etl_run(PATIENTS[:1], rows).quarantine
        assert q[[S.TIME, S.REASON]].values.tolist() == [["2010-01-01T00:00:00", Reason.DUPLICATE]]


def test_different_visit_or_system_is_not_a_duplicate(etl_run: Run) -> None:
    events = [
        {"patient_id": "p1", "date": "2010-01-01", "code": "I10", "visit_id": "v1", "code_system": ""},
        {"patient_id": "p1", "date": "2010-01-01", "code": "I10", "visit_id": "v2", "code_system": ""},
        {"patient_id": "p1", "date": "2010-01-01", "code": "I10", "visit_id": "v1", "code_system": "ICD10"},
    ]
    out = etl_run(PATIENTS[:1], events, split=ALL_TRAIN)
    assert len(out.quarantine) == 0
    assert out.manifest["events_used"]["events"] == 3


def test_patient_with_a_good_and_a_bad_row_is_usable(etl_run: Run) -> None:
    patients = [
        {"patient_id": "p1", "birth_date": "garbage"},
        {"patient_id": "p1", "birth_date": "2000-01-01"},
        {"patient_id": "p2", "birth_date": "2000-01-01"},
    ]
    out = etl_run(patients, [{"patient_id": "p1", "date": "2010-01-01", "code": "I10"}], split=ALL_TRAIN)
    assert out.reasons() == {0: Reason.UNPARSEABLE_BIRTH_DATE}
    assert out.tokens[S.PATIENT_ID].tolist() == ["p1"]


# ---------------------------------------------------------------------------------------------------------
# The step functions on canonical frames
# ---------------------------------------------------------------------------------------------------------
def _canonical_patients(rows: list[tuple[str, str]]) -> pd.DataFrame:
    ids = np.array([r[0] for r in rows], dtype=object)
    raw = np.array([r[1] for r in rows], dtype=object)
    birth = pd.to_datetime(pd.Series(raw), errors="coerce").to_numpy("datetime64[us]")
    return patients_frame(ids, birth, raw, None, None, "patients.csv", np.arange(len(rows)))


def _canonical_events(rows: list[tuple[str, str, str]]) -> pd.DataFrame:
    raw = np.array([r[1] for r in rows], dtype=object)
    time = pd.to_datetime(pd.Series(raw), errors="coerce").to_numpy("datetime64[us]")
    return events_frame(
        np.array([r[0] for r in rows], dtype=object),
        time,
        raw,
        np.array([r[2] for r in rows], dtype=object),
        None,
        None,
        "events.csv",
        np.arange(len(rows)),
    )


def test_patient_reasons_on_canonical_frame() -> None:
    p = _canonical_patients([("a", "2000-01-01"), ("a", "2000-01-01"), ("b", "x"), ("", "2000-01-01")])
    assert patient_reasons(p).tolist() == [
        "",
        Reason.DUPLICATE,
        Reason.UNPARSEABLE_BIRTH_DATE,
        Reason.MISSING_PATIENT_ID,
    ]


def test_event_reasons_on_canonical_frame() -> None:
    patients = _canonical_patients([("a", "2000-01-01")])
    events = _canonical_events(
        [
            ("a", "2010-01-01", "I10"),
            ("a", "2010-01-01", "I10"),
            ("b", "2010-01-01", "I10"),
            ("c", "2010-01-01", "I10"),
            ("a", "1999-01-01", "I10"),
        ]
    )
    reasons = event_reasons(events, patients, np.array(["c"], dtype=object))
    assert reasons.tolist() == [
        "",
        Reason.DUPLICATE,
        Reason.UNKNOWN_PATIENT,
        Reason.PATIENT_REJECTED,
        Reason.BEFORE_BIRTH,
    ]


def test_clean_splits_rows_into_usable_and_quarantine() -> None:
    patients = _canonical_patients([("a", "2000-01-01"), ("b", "bad")])
    events = _canonical_events([("a", "2010-01-01", "I10"), ("b", "2010-01-01", "I10"), ("a", "2011-01-01", "")])
    cleaned = clean(patients, events)
    assert cleaned.patients[S.PATIENT_ID].tolist() == ["a"]
    assert cleaned.events[S.SOURCE_ROW].tolist() == [0]
    assert cleaned.quarantine[S.REASON].tolist() == [
        Reason.UNPARSEABLE_BIRTH_DATE,
        Reason.PATIENT_REJECTED,
        Reason.EMPTY_CODE,
    ]
    assert cleaned.codes is not None and cleaned.codes.patient_uniques[cleaned.codes.patient].tolist() == ["a"]
