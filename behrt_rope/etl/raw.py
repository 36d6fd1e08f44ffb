"""The canonical tables every reader hands to the shared cleaning step, and the helpers to build them."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from behrt_rope import schema as S
from behrt_rope.etl.sex import normalise_sex


@dataclass
class RawTables:
    """One patient shard of raw input in canonical form (nothing rejected yet).

    ``patients``: PATIENT_ID (str), BIRTH_DATE / DEATH_DATE (datetime64[us], NaT when missing or
    unparseable), BIRTH_RAW / DEATH_RAW (the text as read), SEX (female/male/other/unknown, see ``sex.py``),
    SEX_RAW (the text as read), SOURCE_TABLE, SOURCE_ROW.
    ``events``: PATIENT_ID (str, '' when missing), TIME (datetime64[us], NaT when unparseable), TIME_RAW,
    CODE (str, '' when empty), CODE_SYSTEM (str, '' for none), VISIT_ID (str, '' for none), SOURCE_TABLE,
    SOURCE_ROW; optionally REASON (str, '' for none): a quarantine reason the reader itself found
    (``Reason.MISSING_BIRTH``, ``Reason.NO_MATCHING_CONCEPT``), applied by the cleaning step before its own checks,
    and CODE_RAW (str): the code as read, for the quarantine, where CODE was extracted from it (MEDS).
    Every input row of the shard is either one canonical row or counted in ``filtered`` (rows a format
    reads on purpose but does not use, such as non-diagnosis MEDS events), so that, per source table,
    ``rows_read = canonical rows + filtered``.
    """

    patients: pd.DataFrame
    events: pd.DataFrame
    rows_read: dict[str, int]
    filtered: dict[str, int] = field(default_factory=dict)
    source_splits: pd.DataFrame | None = None  # PATIENT_ID, SPLIT: splits given by the source (MEDS)
    notes: dict[str, Any] = field(default_factory=dict)  # reader findings, copied into the manifest
    patient_id_type: str = "string"  # 'int64' when the source ids are integers (predictions keep the type)
    filtered_prefixes: Counter[str] = field(default_factory=Counter)  # code prefix -> filtered rows (MEDS)
    descriptions: pd.DataFrame | None = None  # CODE, CODE_SYSTEM, DESCRIPTION: names the input gives codes


PATIENT_COLUMNS = (
    S.PATIENT_ID,
    S.BIRTH_DATE,
    S.DEATH_DATE,
    S.BIRTH_RAW,
    S.DEATH_RAW,
    S.SEX,
    S.SEX_RAW,
    S.SOURCE_TABLE,
    S.SOURCE_ROW,
)
CODE_RAW = "code_raw"  # optional events column: the code as read, when CODE is only a part of it (MEDS)
EVENT_COLUMNS = (
    S.PATIENT_ID,
    S.TIME,
    S.TIME_RAW,
    S.CODE,
    S.CODE_SYSTEM,
    S.VISIT_ID,
    S.SOURCE_TABLE,
    S.SOURCE_ROW,
)


Text = np.ndarray | pd.api.extensions.ExtensionArray  # a text column: object array or Arrow-backed strings


def patients_frame(
    patient_id: Text,
    birth: np.ndarray,
    birth_raw: Text,
    death: np.ndarray | None,
    death_raw: Text | None,
    source_table: str,
    source_row: np.ndarray,
    sex_raw: Text | None = None,
) -> pd.DataFrame:
    """A canonical patients frame; absent death columns become NaT / '', an absent sex ``unknown``."""
    n = len(patient_id)
    sex_text = np.full(n, "", dtype=object) if sex_raw is None else _text(sex_raw)
    return pd.DataFrame(
        {
            S.PATIENT_ID: _text(patient_id),
            S.BIRTH_DATE: np.asarray(birth, dtype="datetime64[us]"),
            S.DEATH_DATE: np.full(n, np.datetime64("NaT", "us"))
            if death is None
            else np.asarray(death, dtype="datetime64[us]"),
            S.BIRTH_RAW: _text(birth_raw),
            S.DEATH_RAW: np.full(n, "", dtype=object) if death_raw is None else _text(death_raw),
            S.SEX: normalise_sex(sex_text),
            S.SEX_RAW: sex_text,
            S.SOURCE_TABLE: _constant(source_table, n),
            S.SOURCE_ROW: np.asarray(source_row, dtype=np.int64),
        }
    )


def events_frame(
    patient_id: Text,
    time: np.ndarray,
    time_raw: Text,
    code: Text,
    code_system: Text | None,
    visit_id: Text | None,
    source_table: str,
    source_row: np.ndarray,
) -> pd.DataFrame:
    """A canonical events frame; absent code systems and visit ids become ''."""
    n = len(patient_id)
    blank = np.full(n, "", dtype=object)
    return pd.DataFrame(
        {
            S.PATIENT_ID: _text(patient_id),
            S.TIME: np.asarray(time, dtype="datetime64[us]"),
            S.TIME_RAW: _text(time_raw),
            S.CODE: _text(code),
            S.CODE_SYSTEM: blank if code_system is None else _text(code_system),
            S.VISIT_ID: blank.copy() if visit_id is None else _text(visit_id),
            S.SOURCE_TABLE: _constant(source_table, n),
            S.SOURCE_ROW: np.asarray(source_row, dtype=np.int64),
        }
    )


def _text(values: object) -> object:
    """Text columns pass through as they are when already an Arrow-backed pandas array (no per-value
    conversion); anything else becomes an object array."""
    if isinstance(values, pd.api.extensions.ExtensionArray):
        return values
    return np.asarray(values, dtype=object)


def _constant(value: str, n: int) -> pd.Categorical[str]:
    """``n`` copies of one string, stored once."""
    return pd.Categorical.from_codes(np.zeros(n, dtype=np.int8), categories=pd.Index([value]))


def concat(frames: list[pd.DataFrame], columns: tuple[str, ...]) -> pd.DataFrame:
    """Concatenate canonical frames, or an empty one with the right columns."""
    frames = [f for f in frames if len(f)]
    if not frames:
        return pd.DataFrame({c: pd.Series(dtype=_empty_dtype(c)) for c in columns})
    return pd.concat(frames, ignore_index=True)


def _empty_dtype(column: str) -> str:
    if column in (S.TIME, S.BIRTH_DATE, S.DEATH_DATE):
        return "datetime64[us]"
    if column == S.SOURCE_ROW:
        return "int64"
    return "object"
