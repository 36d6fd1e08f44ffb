"""Row-level checks: every canonical row is used, quarantined with a reason, or dropped as a duplicate.

Each check is a small vectorised function; ``clean`` applies them in a fixed order and the first reason
that applies is the one recorded.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from behrt_rope import schema as S
from behrt_rope.schema import Reason

OK = ""


@dataclass
class Cleaned:
    """The usable rows of one shard and what was set aside."""

    patients: pd.DataFrame  # PATIENT_ID, BIRTH_DATE, DEATH_DATE, SOURCE_TABLE (one row per patient)
    events: pd.DataFrame  # canonical event columns, usable rows only
    quarantine: pd.DataFrame  # S.QUARANTINE columns; duplicates listed with reason exact_duplicate


def first_reason(checks: list[tuple[str, np.ndarray]], n: int) -> np.ndarray:
    """Per row, the reason of the first check that fails, or '' when all pass.

    >>> first_reason([("a", np.array([True, False, False])), ("b", np.array([True, True, False]))], 3).tolist()
    ['a', 'b', '']
    """
    reason = np.full(n, OK, dtype=object)
    for name, failed in checks:
        reason[(reason == OK) & failed] = name
    return reason


def patient_reasons(patients: pd.DataFrame) -> np.ndarray:
    """Quarantine reason per canonical patient row ('' = usable, Reason.DUPLICATE = exact repeat).

    >>> p = pd.DataFrame({S.PATIENT_ID: ["a", "b", "", "c", "c", "d", "d"],
    ...     S.BIRTH_DATE: pd.to_datetime(["2000-01-01", None, "2000-01-01", "1990-01-01", "1990-01-01",
    ...                                   "1980-01-01", "1981-01-01"]).to_numpy("datetime64[us]"),
    ...     S.DEATH_DATE: pd.to_datetime([None] * 7).to_numpy("datetime64[us]"),
    ...     S.DEATH_RAW: [""] * 7})
    >>> patient_reasons(p).tolist()
    ['', 'unparseable_birth_date', 'missing_patient_id', '', 'exact_duplicate', 'conflicting_patient_rows', \
'conflicting_patient_rows']
    """
    ids = patients[S.PATIENT_ID].to_numpy(dtype=object)
    birth = patients[S.BIRTH_DATE].to_numpy(dtype="datetime64[us]")
    death = patients[S.DEATH_DATE].to_numpy(dtype="datetime64[us]")
    death_given = patients[S.DEATH_RAW].to_numpy(dtype=object) != ""
    reason = first_reason(
        [
            (Reason.MISSING_PATIENT_ID, ids == ""),
            (Reason.UNPARSEABLE_BIRTH_DATE, np.isnat(birth)),
            (Reason.UNPARSEABLE_DEATH_DATE, death_given & np.isnat(death)),
            (Reason.DEATH_BEFORE_BIRTH, ~np.isnat(death) & (_day(death) < _day(birth))),
        ],
        len(ids),
    )
    valid = pd.DataFrame({"id": ids, "b": birth, "d": death})[reason == OK]
    repeat = valid.duplicated(keep="first")
    distinct = valid[~repeat]
    conflicting = distinct["id"].duplicated(keep=False)
    conflict_ids = set(distinct.loc[conflicting, "id"])
    idx = valid.index.to_numpy()
    reason[idx[repeat.to_numpy()]] = Reason.DUPLICATE
    reason[idx[valid["id"].isin(conflict_ids).to_numpy() & ~repeat.to_numpy()]] = Reason.CONFLICTING_PATIENT_ROWS
    reason[idx[valid["id"].isin(conflict_ids).to_numpy() & repeat.to_numpy()]] = Reason.CONFLICTING_PATIENT_ROWS
    return reason


def event_reasons(events: pd.DataFrame, patients: pd.DataFrame, rejected_ids: np.ndarray) -> np.ndarray:
    """Quarantine reason per canonical event row, given the usable ``patients`` (one row per id)."""
    ids = events[S.PATIENT_ID].to_numpy(dtype=object)
    where = pd.Index(patients[S.PATIENT_ID]).get_indexer(ids)
    known = where >= 0
    birth = np.where(known, patients[S.BIRTH_DATE].to_numpy("datetime64[us]")[where], np.datetime64("NaT"))
    death = np.where(known, patients[S.DEATH_DATE].to_numpy("datetime64[us]")[where], np.datetime64("NaT"))
    time = events[S.TIME].to_numpy(dtype="datetime64[us]")
    day = _day(time)
    reason = first_reason(
        [
            (Reason.MISSING_PATIENT_ID, ids == ""),
            (Reason.PATIENT_REJECTED, ~known & (pd.Index(rejected_ids).get_indexer(ids) >= 0)),
            (Reason.UNKNOWN_PATIENT, ~known),
            (Reason.UNPARSEABLE_DATE, np.isnat(time)),
            (Reason.EMPTY_CODE, events[S.CODE].to_numpy(dtype=object) == ""),
            (Reason.BEFORE_BIRTH, day < _day(birth)),
            (Reason.AFTER_DEATH, ~np.isnat(death) & (day > _day(death))),
        ],
        len(ids),
    )
    keys = [S.PATIENT_ID, S.TIME, S.CODE, S.CODE_SYSTEM, S.VISIT_ID]
    usable = reason == OK
    order = np.lexsort((events[S.SOURCE_ROW].to_numpy(), events[S.SOURCE_TABLE].to_numpy(dtype=str)))
    ranked = events.iloc[order]
    repeat = np.zeros(len(events), dtype=bool)
    repeat[order] = ranked[keys].duplicated(keep="first").to_numpy() & usable[order]
    # a repeat of a row that was itself quarantined is judged on its own: only repeats of usable rows drop
    reason[repeat] = Reason.DUPLICATE
    return reason


def clean(patients: pd.DataFrame, events: pd.DataFrame) -> Cleaned:
    """Apply the patient checks, then the event checks; return usable rows and the quarantine."""
    p_reason = patient_reasons(patients)
    usable_patients = patients[p_reason == OK]
    rejected = np.setdiff1d(
        patients.loc[p_reason != OK, S.PATIENT_ID].to_numpy(dtype=object).astype(str),
        usable_patients[S.PATIENT_ID].to_numpy(dtype=object).astype(str),
    )
    e_reason = event_reasons(events, usable_patients, rejected)
    quarantine = pd.concat(
        [
            quarantine_rows(patients, p_reason, S.BIRTH_RAW, ""),
            quarantine_rows(events, e_reason, S.TIME_RAW, S.CODE),
        ],
        ignore_index=True,
    )
    return Cleaned(
        patients=usable_patients[[S.PATIENT_ID, S.BIRTH_DATE, S.DEATH_DATE, S.SOURCE_TABLE]].reset_index(drop=True),
        events=events[e_reason == OK].reset_index(drop=True),
        quarantine=quarantine,
    )


def quarantine_rows(frame: pd.DataFrame, reason: np.ndarray, time_col: str, code_col: str) -> pd.DataFrame:
    """The rejected rows of ``frame`` in the quarantine layout (raw values as text)."""
    bad = reason != OK
    sub = frame[bad]
    n = int(bad.sum())
    return pd.DataFrame(
        {
            S.SOURCE_TABLE: sub[S.SOURCE_TABLE].to_numpy(dtype=object),
            S.SOURCE_ROW: sub[S.SOURCE_ROW].to_numpy(dtype=np.int64),
            S.PATIENT_ID: sub[S.PATIENT_ID].to_numpy(dtype=object),
            S.TIME: sub[time_col].astype(str).to_numpy(dtype=object),
            S.CODE: sub[code_col].to_numpy(dtype=object) if code_col else np.full(n, "", dtype=object),
            S.REASON: reason[bad],
        }
    )


def _day(times: np.ndarray) -> np.ndarray:
    """Calendar day of each timestamp (NaT stays NaT; comparisons with NaT are False)."""
    return np.asarray(times, dtype="datetime64[us]").astype("datetime64[D]")
