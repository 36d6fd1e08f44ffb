"""Row-level checks: every canonical row is used, quarantined with a reason, or dropped as a duplicate.

Each check is a small vectorised function; ``clean`` applies them in a fixed order and the first reason
that applies is the one recorded. Text columns are turned into integer codes once (:class:`EventCodes`), so
the checks, and the visit grouping after them, work on integers.

Which copy of an exact duplicate is kept does not depend on row order: the copy whose raw time text is
smallest, then the first by source table and row. So the quarantine holds the same rows (up to their
``source_row``) whatever order the input rows come in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from behrt_rope import schema as S
from behrt_rope.etl.codes import factorize_text, pack_keys, repeated
from behrt_rope.etl.raw import CODE_RAW
from behrt_rope.schema import Reason

OK = ""


@dataclass
class EventCodes:
    """Integer codes of an events frame's text columns, row-aligned, each with its distinct values.

    Patient codes follow text order (sorting by the code sorts by the id); the others are in no particular
    order (visit ids are many, and sorting them all would cost more than the rest of the grouping).
    """

    patient: np.ndarray  # int64 per row, index into patient_uniques
    patient_uniques: np.ndarray  # object, sorted
    code: np.ndarray
    code_uniques: np.ndarray
    system: np.ndarray
    system_uniques: np.ndarray
    visit: np.ndarray
    visit_uniques: np.ndarray

    @classmethod
    def of(cls, events: pd.DataFrame) -> EventCodes:
        """Encode PATIENT_ID, CODE, CODE_SYSTEM and VISIT_ID of a canonical events frame.

        >>> e = pd.DataFrame({S.PATIENT_ID: ["b", "a", "b"], S.CODE: ["I10", "E11", "I10"],
        ...                   S.CODE_SYSTEM: ["", "", ""], S.VISIT_ID: ["", "v1", ""]})
        >>> c = EventCodes.of(e)
        >>> c.patient.tolist(), c.patient_uniques.tolist(), c.visit_uniques[c.visit].tolist()
        ([1, 0, 1], ['a', 'b'], ['', 'v1', ''])
        """
        parts = [factorize_text(events[S.PATIENT_ID])]
        parts += [factorize_text(events[c], sort=False) for c in (S.CODE, S.CODE_SYSTEM, S.VISIT_ID)]
        return cls(*(a for pair in parts for a in pair))

    def take(self, rows: np.ndarray) -> EventCodes:
        """The codes of a subset of rows (a boolean mask or row numbers); the uniques are kept whole."""
        return EventCodes(
            self.patient[rows],
            self.patient_uniques,
            self.code[rows],
            self.code_uniques,
            self.system[rows],
            self.system_uniques,
            self.visit[rows],
            self.visit_uniques,
        )


@dataclass
class Cleaned:
    """The usable rows of one shard and what was set aside."""

    patients: pd.DataFrame  # PATIENT_ID, BIRTH_DATE, DEATH_DATE, SEX, SOURCE_TABLE (one row per patient)
    events: pd.DataFrame  # canonical event columns, usable rows only
    quarantine: pd.DataFrame  # S.QUARANTINE columns; duplicates listed with reason exact_duplicate
    codes: EventCodes | None = field(default=None, repr=False)  # integer codes of ``events``, when known


def first_reason(checks: list[tuple[str, np.ndarray]], n: int) -> np.ndarray:
    """Per row, the reason of the first check that fails, or '' when all pass.

    >>> first_reason([("a", np.array([True, False, False])), ("b", np.array([True, True, False]))], 3).tolist()
    ['a', 'b', '']
    """
    index = _first_failed([failed for _, failed in checks], n)
    return np.asarray([OK, *(name for name, _ in checks)], dtype=object)[index]


def _first_failed(failures: Sequence[np.ndarray], n: int) -> np.ndarray:
    """Per row, 1 + the position of the first failed check, or 0 when all pass (int8)."""
    index = np.zeros(n, dtype=np.int8)
    for i, failed in enumerate(failures, start=1):
        index[(index == 0) & failed] = i
    return index


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
    keys = {"id": ids, "b": birth, "d": death}
    if S.SEX in patients.columns:  # rows that differ only in sex conflict too
        keys["s"] = patients[S.SEX].to_numpy(dtype=object)
    valid = pd.DataFrame(keys)[reason == OK]
    tiebreak = [c for c in (S.BIRTH_RAW, S.DEATH_RAW, S.SEX_RAW, S.SOURCE_TABLE, S.SOURCE_ROW) if c in patients.columns]
    repeat = _repeats(valid, patients.loc[reason == OK, tiebreak])
    distinct = valid[~repeat]
    conflict_ids = set(distinct.loc[distinct["id"].duplicated(keep=False), "id"])
    idx = valid.index.to_numpy()
    reason[idx[repeat]] = Reason.DUPLICATE
    reason[idx[valid["id"].isin(conflict_ids).to_numpy()]] = Reason.CONFLICTING_PATIENT_ROWS
    return reason


def _repeats(keys: pd.DataFrame, tiebreak: pd.DataFrame) -> np.ndarray:
    """True for every row that repeats the ``keys`` of an earlier row in ``tiebreak`` order (not row order)."""
    if not len(tiebreak.columns):
        return keys.duplicated(keep="first").to_numpy()
    frame = pd.concat([keys.reset_index(drop=True), tiebreak.reset_index(drop=True).add_prefix("~")], axis=1)
    order = np.lexsort([frame[c].to_numpy() for c in reversed(frame.columns)]) if len(frame) else np.zeros(0, int)
    repeat = np.zeros(len(frame), dtype=bool)
    repeat[order] = frame.iloc[order][list(keys.columns)].duplicated(keep="first").to_numpy()
    return repeat


def event_reasons(events: pd.DataFrame, patients: pd.DataFrame, rejected_ids: np.ndarray) -> np.ndarray:
    """Quarantine reason per canonical event row, given the usable ``patients`` (one row per id)."""
    index = _event_reason_index(events, EventCodes.of(events), patients, rejected_ids)
    return np.asarray([OK, *_EVENT_REASONS], dtype=object)[index]


_READER_REASONS = (
    Reason.MISSING_BIRTH,
    Reason.NO_MATCHING_CONCEPT,
    Reason.UNKNOWN_CONCEPT,
)  # set by readers in the REASON column
_CUT_REASONS = (Reason.AFTER_AS_OF,)  # set by predict in the REASON column; a row's own faults come first
_EVENT_REASONS = (
    *_READER_REASONS,
    Reason.MISSING_PATIENT_ID,
    Reason.PATIENT_REJECTED,
    Reason.UNKNOWN_PATIENT,
    Reason.UNPARSEABLE_DATE,
    Reason.EMPTY_CODE,
    Reason.BEFORE_BIRTH,
    Reason.AFTER_DEATH,
    *_CUT_REASONS,
    Reason.DUPLICATE,
)


def _event_reason_index(
    events: pd.DataFrame, codes: EventCodes, patients: pd.DataFrame, rejected_ids: np.ndarray
) -> np.ndarray:
    """Per event row, 0 when usable, else 1 + the position of its reason in ``_EVENT_REASONS`` (int8)."""
    ids = codes.patient_uniques
    where = pd.Index(patients[S.PATIENT_ID].to_numpy(dtype=object)).get_indexer(ids)[codes.patient]
    known = where >= 0
    nat = np.datetime64("NaT", "D")
    birth = np.append(_day(patients[S.BIRTH_DATE].to_numpy("datetime64[us]")), nat)  # [-1]: unknown patient
    death = np.append(_day(patients[S.DEATH_DATE].to_numpy("datetime64[us]")), nat)
    time = events[S.TIME].to_numpy(dtype="datetime64[us]")
    day = _day(time)
    given = events[S.REASON].to_numpy(dtype=object) if S.REASON in events.columns else None  # optional
    index = _first_failed(
        [
            *(np.zeros(len(events), bool) if given is None else given == r for r in _READER_REASONS),
            (ids == "")[codes.patient],
            ~known & (pd.Index(np.asarray(rejected_ids, dtype=object)).get_indexer(ids) >= 0)[codes.patient],
            ~known,
            np.isnat(time),
            (codes.code_uniques == "")[codes.code],
            day < birth[where],
            day > death[where],  # comparisons with NaT are False
            *(np.zeros(len(events), bool) if given is None else given == r for r in _CUT_REASONS),
        ],
        len(events),
    )
    usable = np.flatnonzero(index == 0)
    keys = [
        codes.patient[usable],
        time[usable].view(np.int64),
        codes.code[usable],
        codes.system[usable],
        codes.visit[usable],
    ]
    repeat = _repeated_keys(keys, events, usable)
    index[usable[repeat]] = _EVENT_REASONS.index(Reason.DUPLICATE) + 1
    return index


def _repeated_keys(keys: list[np.ndarray], events: pd.DataFrame, rows: np.ndarray) -> np.ndarray:
    """True for ``rows`` whose integer ``keys`` repeat those of a row that comes first in tie-break order
    (raw time text, source table, source row).

    ``keys`` are aligned with ``rows``, which index the rows of ``events``.
    """
    repeat = np.zeros(len(rows), dtype=bool)
    if not len(rows):
        return repeat
    multi, group = repeated(pack_keys(keys)[0])  # rows in a group of two or more: few
    if len(multi):
        tiebreak = events.iloc[rows[multi]][[S.TIME_RAW, S.SOURCE_TABLE, S.SOURCE_ROW]]
        repeat[multi] = _repeats(pd.DataFrame({"g": group}), tiebreak)
    return repeat


def clean(patients: pd.DataFrame, events: pd.DataFrame) -> Cleaned:
    """Apply the patient checks, then the event checks; return usable rows and the quarantine."""
    p_reason = patient_reasons(patients)
    usable_patients = patients[p_reason == OK]
    rejected = np.setdiff1d(
        patients.loc[p_reason != OK, S.PATIENT_ID].to_numpy(dtype=object).astype(str),
        usable_patients[S.PATIENT_ID].to_numpy(dtype=object).astype(str),
    )
    codes = EventCodes.of(events)
    e_index = _event_reason_index(events, codes, usable_patients, rejected)
    usable = e_index == 0
    bad = np.flatnonzero(~usable)
    e_reason = np.full(len(events), OK, dtype=object)
    e_reason[bad] = np.asarray([OK, *_EVENT_REASONS], dtype=object)[e_index[bad]]
    quarantine = pd.concat(
        [
            quarantine_rows(patients, p_reason, S.BIRTH_RAW, ""),
            quarantine_rows(events, e_reason, S.TIME_RAW, S.CODE),
        ],
        ignore_index=True,
    )
    kept = [c for c in (S.PATIENT_ID, S.BIRTH_DATE, S.DEATH_DATE, S.SEX, S.SOURCE_TABLE) if c in patients.columns]
    return Cleaned(
        patients=usable_patients[kept].reset_index(drop=True),
        events=events[usable].reset_index(drop=True) if len(bad) else events.reset_index(drop=True),
        quarantine=quarantine,
        codes=codes.take(usable) if len(bad) else codes,
    )


def quarantine_rows(frame: pd.DataFrame, reason: np.ndarray, time_col: str, code_col: str) -> pd.DataFrame:
    """The rejected rows of ``frame`` in the quarantine layout (raw values as text); the code is the one
    read (``CODE_RAW``) where the reader kept it apart from ``code_col``."""
    bad = np.flatnonzero(reason != OK)
    sub = frame.iloc[bad]
    n = len(bad)
    if code_col and CODE_RAW in frame.columns:
        code_col = CODE_RAW
    return pd.DataFrame(
        {
            S.SOURCE_TABLE: sub[S.SOURCE_TABLE].to_numpy(dtype=object),
            S.SOURCE_ROW: sub[S.SOURCE_ROW].to_numpy(dtype=np.int64),
            S.PATIENT_ID: sub[S.PATIENT_ID].to_numpy(dtype=object),
            S.TIME: sub[time_col].astype(str).to_numpy(dtype=object),
            S.CODE: sub[code_col].to_numpy(dtype=object) if code_col else np.full(n, "", dtype=object),
            S.REASON: np.asarray(reason, dtype=object)[bad],
        }
    )


def _day(times: np.ndarray) -> np.ndarray:
    """Calendar day of each timestamp (NaT stays NaT; comparisons with NaT are False)."""
    return np.asarray(times, dtype="datetime64[us]").astype("datetime64[D]")
