"""Visits and token streams, vectorised: no Python loop over patients.

``structure`` groups usable events into visits, merges repeated codes inside a visit and drops whole oldest
visits to fit ``max_seq_len``. ``to_token_table`` lays each patient out as
``[CLS] visit-1 codes [SEP] visit-2 codes [SEP] ...`` with per-token age, segment, visit index and date.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa

from behrt_rope import schema as S
from behrt_rope.etl.codes import lookup

DAYS_PER_YEAR = 365.25


@dataclass
class Structured:
    """One shard's patients as visits, after merging and truncation.

    ``patients``: PATIENT_ID, BIRTH_DATE, DEATH_DATE, LAST_EVENT_TIME, one row per patient with tokens,
    sorted by id. ``visits``: 'patient' (row in ``patients``), VISIT_INDEX (0-based after truncation),
    TIME (earliest event of the visit). ``codes``: 'visit' (row in ``visits``), 'token' (string).
    """

    patients: pd.DataFrame
    visits: pd.DataFrame
    codes: pd.DataFrame
    merged_in_visit: int  # usable events folded into an identical token of the same visit
    truncated_events: int  # usable events in visits dropped by the length limit
    truncated_visits: int
    truncated_patients: int
    too_long: np.ndarray  # bool per usable event: its patient's latest visit alone exceeds max_seq_len


def visit_keys(patient: np.ndarray, visit_id: np.ndarray, time: np.ndarray) -> np.ndarray:
    """A visit number per event: events sharing a visit_id, else a calendar day, form one visit.

    >>> t = np.array(["2020-01-01T08", "2020-01-01T17", "2020-01-02", "2020-01-02"], dtype="datetime64[us]")
    >>> visit_keys(np.array([0, 0, 0, 0]), np.array(["", "", "v1", "v1"], dtype=object), t).tolist()
    [0, 0, 1, 1]
    """
    vid, _ = pd.factorize(visit_id, sort=True)
    has_id = visit_id != ""
    day = np.asarray(time, dtype="datetime64[D]").astype(np.int64)
    frame = pd.DataFrame({"p": patient, "v": np.where(has_id, vid, -1), "d": np.where(has_id, 0, day)})
    return frame.groupby(["p", "v", "d"], sort=True).ngroup().to_numpy()


def structure(
    events: pd.DataFrame, tokens: np.ndarray, patients: pd.DataFrame, max_seq_len: int
) -> Structured:
    """Group usable events (with their token strings) into ordered, merged, length-limited visits."""
    ids = events[S.PATIENT_ID].to_numpy(dtype=object)
    pid, pid_uniques = pd.factorize(ids, sort=True)
    time = events[S.TIME].to_numpy(dtype="datetime64[us]")
    visit = visit_keys(pid, events[S.VISIT_ID].to_numpy(dtype=object), time)

    # Visit order: by time, ties broken by the visit key (itself sorted on id/day), never by row order.
    per_visit = pd.DataFrame({"p": pid, "visit": visit, "t": time}).groupby("visit", sort=True).agg(
        p=("p", "first"), t=("t", "min")
    )
    tok_code, tok_uniques = pd.factorize(tokens, sort=True)
    pairs = pd.DataFrame({"visit": visit, "tok": tok_code})
    first = ~pairs.duplicated(keep="first").to_numpy()
    n_codes = np.bincount(visit[first], minlength=len(per_visit))

    order = np.lexsort((per_visit.index.to_numpy(), per_visit["t"].to_numpy(), per_visit["p"].to_numpy()))
    v = per_visit.iloc[order].assign(n=n_codes[order], key=per_visit.index.to_numpy()[order])
    cost = v["n"].to_numpy() + 1  # the codes and the [SEP] closing the visit
    suffix = _suffix_sums(v["p"].to_numpy(), cost)
    keep_visit = suffix + 1 <= max_seq_len  # + [CLS]
    kept_any = pd.Series(keep_visit).groupby(v["p"].to_numpy()).transform("any").to_numpy()

    visit_kept = np.zeros(len(per_visit), dtype=bool)
    visit_kept[v["key"].to_numpy()[keep_visit]] = True
    too_long_patient = np.zeros(len(pid_uniques), dtype=bool)
    too_long_patient[v["p"].to_numpy()[~kept_any]] = True

    kept = v[keep_visit]
    visit_index = kept.groupby("p", sort=False).cumcount().to_numpy()
    new_row = np.full(len(per_visit), -1)
    new_row[kept["key"].to_numpy()] = np.arange(len(kept))

    code_rows = first & visit_kept[visit]
    last_time = pd.Series(time).groupby(pid).max().to_numpy()
    patient_rows = np.unique(kept["p"].to_numpy())
    p_index = pd.Index(patients[S.PATIENT_ID]).get_indexer(pid_uniques[patient_rows])
    out_patients = pd.DataFrame(
        {
            S.PATIENT_ID: pid_uniques[patient_rows],
            S.BIRTH_DATE: patients[S.BIRTH_DATE].to_numpy("datetime64[us]")[p_index],
            S.DEATH_DATE: patients[S.DEATH_DATE].to_numpy("datetime64[us]")[p_index],
            S.LAST_EVENT_TIME: last_time[patient_rows],
        }
    )
    remap = np.full(len(pid_uniques), -1)
    remap[patient_rows] = np.arange(len(patient_rows))
    dropped = ~keep_visit & kept_any
    return Structured(
        patients=out_patients,
        visits=pd.DataFrame(
            {"patient": remap[kept["p"].to_numpy()], S.VISIT_INDEX: visit_index, S.TIME: kept["t"].to_numpy()}
        ),
        codes=pd.DataFrame(
            {"visit": new_row[visit[code_rows]], "token": np.asarray(tok_uniques, dtype=object)[tok_code[code_rows]]}
        ),
        merged_in_visit=int((~first & visit_kept[visit]).sum()),
        truncated_events=int((~visit_kept[visit] & ~too_long_patient[pid]).sum()),
        truncated_visits=int(dropped.sum()),
        truncated_patients=len(np.unique(v["p"].to_numpy()[dropped])),
        too_long=too_long_patient[pid],
    )


def _suffix_sums(group: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Sum of ``values`` from each row to the end of its (contiguous) group.

    >>> _suffix_sums(np.array([0, 0, 0, 1, 1]), np.array([1, 2, 3, 4, 5])).tolist()
    [6, 5, 3, 9, 5]
    """
    prefix = pd.Series(values).groupby(group, sort=False).cumsum().to_numpy()
    total = pd.Series(values).groupby(group, sort=False).transform("sum").to_numpy()
    return total - prefix + values


def to_token_table(structured: Structured, vocabulary: pd.DataFrame, splits: np.ndarray) -> pa.Table:
    """Token streams (schema ``S.TOKENS``), one row per patient of ``structured``; ``splits`` per patient."""
    visits, codes, patients = structured.visits, structured.codes, structured.patients
    n_patients, n_visits = len(patients), len(visits)
    visit_patient = visits["patient"].to_numpy()
    first_visit = np.full(n_patients, 0)
    first_visit[visit_patient[::-1]] = np.arange(n_visits)[::-1]  # lowest visit row per patient

    # rows: [CLS] per patient (kind 0), codes (kind 1), [SEP] per visit (kind 2)
    code_visit = codes["visit"].to_numpy()
    row_visit = np.concatenate([first_visit, code_visit, np.arange(n_visits)])
    row_kind = np.concatenate([np.zeros(n_patients), np.ones(len(codes)), np.full(n_visits, 2)]).astype(np.int8)
    row_token = np.concatenate(
        [
            np.full(n_patients, S.CLS_ID, np.int32),
            lookup(codes["token"].to_numpy(dtype=object), vocabulary),
            np.full(n_visits, S.SEP_ID, np.int32),
        ]
    )
    row_patient = visit_patient[row_visit]
    row_vindex = visits[S.VISIT_INDEX].to_numpy()[row_visit]
    sort_visit = np.where(row_kind == 0, -1, row_vindex)
    order = np.lexsort((row_token, row_kind, sort_visit, row_patient))
    row_visit, row_token, row_vindex = row_visit[order], row_token[order], row_vindex[order]

    birth_day = patients[S.BIRTH_DATE].to_numpy("datetime64[us]").astype("datetime64[D]")
    visit_time = visits[S.TIME].to_numpy("datetime64[us]")
    visit_age = (visit_time.astype("datetime64[D]") - birth_day[visit_patient]).astype(np.int64) / DAYS_PER_YEAR
    lengths = np.bincount(row_patient, minlength=n_patients)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)

    def lists(values: np.ndarray, typ: pa.DataType) -> pa.ListArray:
        return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values, typ))

    columns = {
        S.PATIENT_ID: pa.array(patients[S.PATIENT_ID].to_numpy(dtype=object), pa.string()),
        S.SPLIT: pa.array(np.asarray(splits, dtype=object), pa.string()),
        S.BIRTH_DATE: pa.array(patients[S.BIRTH_DATE].to_numpy("datetime64[us]"), pa.timestamp("us")),
        S.DEATH_DATE: pa.array(patients[S.DEATH_DATE].to_numpy("datetime64[us]"), pa.timestamp("us")),
        S.N_VISITS: pa.array(np.bincount(visit_patient, minlength=n_patients).astype(np.int32)),
        S.N_TOKENS: pa.array(lengths.astype(np.int32)),
        S.LAST_EVENT_TIME: pa.array(patients[S.LAST_EVENT_TIME].to_numpy("datetime64[us]"), pa.timestamp("us")),
        S.TOKEN_IDS: lists(row_token, pa.int32()),
        S.AGES: lists(visit_age[row_visit].astype(np.float32), pa.float32()),
        S.SEGMENTS: lists((row_vindex % 2).astype(np.int8), pa.int8()),
        S.VISIT_INDEX: lists(row_vindex.astype(np.int16), pa.int16()),
        S.VISIT_DATES: lists(visit_time[row_visit], pa.timestamp("us")),
    }
    return pa.table(columns, schema=S.TOKENS)
