"""Predictions in the MEDS layout: one binary-task file per label code, readable by MEDS tools.

The MEDS label schema (package ``meds``) and the prediction schema of ``meds-evaluation`` are binary per task
and allow no extra columns, so a multi-label model writes one file per label code. Each file holds
``subject_id`` (int64), ``prediction_time`` (timestamp[us]), ``boolean_value`` (bool, only when the outcome
is known, as in ``evaluate``), ``predicted_boolean_value`` (bool, all null: no threshold is chosen) and
``predicted_boolean_probability`` (float32). ``index.json`` maps each code to its file.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from behrt_rope import schema as S
from behrt_rope.errors import UserError

INDEX_FILE = S.MEDS_PREDICTIONS_INDEX
BOOLEAN_VALUE = S.MEDS_BOOLEAN_VALUE
PREDICTED_VALUE = S.MEDS_PREDICTED_VALUE
PREDICTED_PROBABILITY = S.MEDS_PREDICTED_PROBABILITY


def safe_file_names(codes: list[str]) -> dict[str, str]:
    """A distinct, portable Parquet file name per code: ``/`` and other characters become ``_``; a short
    hash of the code is added where two codes would share a name.

    >>> safe_file_names(["ICD10CM/E11", "SNOMED/44054006"])
    {'ICD10CM/E11': 'ICD10CM_E11.parquet', 'SNOMED/44054006': 'SNOMED_44054006.parquet'}
    >>> sorted(safe_file_names(["A/B", "A_B"]).values())
    ['A_B-239c020a.parquet', 'A_B-c0cd2118.parquet']
    """
    base = {code: re.sub(r"[^A-Za-z0-9._-]+", "_", code).strip("._") or "code" for code in codes}
    counts = pd.Series(list(base.values())).str.lower().value_counts()
    names = {}
    for code, stem in base.items():
        clash = counts[stem.lower()] > 1 or stem.lower() == Path(INDEX_FILE).stem
        suffix = "-" + hashlib.sha1(code.encode()).hexdigest()[:8] if clash else ""
        names[code] = f"{stem}{suffix}.parquet"
    return names


def subject_ids(patient_ids: pa.Array | pa.ChunkedArray) -> pa.Array:
    """Patient ids as MEDS ``subject_id`` (int64); text ids must be integers written as text.

    >>> subject_ids(pa.array(["7", "12"])).to_pylist()
    [7, 12]
    """
    if pa.types.is_integer(patient_ids.type):
        return pa.array(np.asarray(patient_ids.to_numpy(zero_copy_only=False), dtype=np.int64))
    text = pd.Series(patient_ids.to_pylist(), dtype=object).astype(str)
    bad = ~text.str.fullmatch(r"[+-]?\d{1,18}")
    if bad.any():
        raise UserError(
            f"layout=meds needs integer patient ids (MEDS subject_id is int64); {int(bad.sum()):,} ids are not "
            f"(e.g. {text[bad].iloc[0]!r}); use layout=long"
        )
    return pa.array(text.astype(np.int64).to_numpy(), pa.int64())


def write(predictions: pa.Table, out_dir: Path) -> dict[str, str]:
    """Write one MEDS prediction file per code of a long table and ``index.json``; return code -> file.

    ``predictions`` columns: PATIENT_ID, PREDICTION_TIME, CODE, PROBABILITY and, optionally,
    ``boolean_value`` (the observed outcome). Rows keep their order within each code.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    codes = predictions[S.CODE].to_numpy(zero_copy_only=False)
    names = safe_file_names(list(pd.unique(codes)))
    subject = subject_ids(predictions[S.PATIENT_ID])
    time = predictions[S.PREDICTION_TIME].cast(pa.timestamp("us"))
    probability = predictions[S.PROBABILITY].cast(pa.float32())
    known = BOOLEAN_VALUE in predictions.column_names
    for code, name in names.items():
        rows = pa.array(np.flatnonzero(codes == code))
        columns: dict[str, pa.Array | pa.ChunkedArray] = {
            S.MEDS_SUBJECT_ID: subject.take(rows),
            S.PREDICTION_TIME: time.take(rows),
        }
        if known:
            columns[BOOLEAN_VALUE] = predictions[BOOLEAN_VALUE].cast(pa.bool_()).take(rows)
        columns[PREDICTED_VALUE] = pa.nulls(len(rows), pa.bool_())
        columns[PREDICTED_PROBABILITY] = probability.take(rows)
        pq.write_table(pa.table(columns), out_dir / name)
    (out_dir / INDEX_FILE).write_text(json.dumps(names, indent=2) + "\n")
    return names
