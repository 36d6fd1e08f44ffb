"""Visits and token streams, vectorised: no Python loop over patients.

``structure`` groups usable events into visits, merges repeated codes inside a visit and keeps the newest
visits that fit ``max_seq_len``, dropping the older ones or thinning them to their codes' first records.
``to_token_table`` lays each patient out as
``[CLS] visit-1 codes [SEP] visit-2 codes [SEP] ...`` with per-token age, segment, visit index and date.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa

from behrt_rope import schema as S
from behrt_rope.etl.clean import EventCodes
from behrt_rope.etl.codes import distinct_sorted, factorize_text, group_ids, lookup, ordered_key
from behrt_rope.etl.sex import UNKNOWN

DAYS_PER_YEAR = 365.25


@dataclass
class Structured:
    """One shard's patients as visits, after merging and truncation.

    ``patients``: PATIENT_ID, BIRTH_DATE, DEATH_DATE, LAST_EVENT_TIME, SEX, one row per patient with tokens,
    sorted by id. ``visits``: 'patient' (row in ``patients``), VISIT_INDEX (0-based after truncation),
    TIME (earliest event of the visit), sorted by patient and visit index. ``codes``: 'visit' (row in
    ``visits``), 'token' (a categorical of token strings), one row per distinct token of a visit.
    """

    patients: pd.DataFrame
    visits: pd.DataFrame
    codes: pd.DataFrame
    merged_in_visit: int  # usable events folded into an identical token of the same visit
    truncated_events: int  # usable events in visits dropped by the length limit
    truncated_visits: int
    truncated_patients: int
    too_long: np.ndarray  # bool per usable event: its patient's latest visit alone exceeds max_seq_len
    thinned_visits: int = 0  # older visits kept as their codes' first records only


def visit_keys(patient: np.ndarray, visit_id: np.ndarray, time: np.ndarray) -> np.ndarray:
    """A visit number per event: events sharing a visit_id, else a calendar day, form one visit.

    Visit numbers follow (patient, visit_id, day) order, visits without an id first.

    >>> t = np.array(["2020-01-01T08", "2020-01-01T17", "2020-01-02", "2020-01-02"], dtype="datetime64[us]")
    >>> visit_keys(np.array([0, 0, 0, 0]), np.array(["", "", "v1", "v1"], dtype=object), t).tolist()
    [0, 0, 1, 1]
    """
    vid, uniques = factorize_text(pd.Series(visit_id, dtype=object))
    group, (p, v, d) = _visit_groups(np.asarray(patient, dtype=np.int64), vid, uniques == "", time)
    rank = np.empty(len(p), dtype=np.int64)
    rank[np.lexsort((d, v, p))] = np.arange(len(p))
    return rank[group]


def _visit_groups(
    patient: np.ndarray, visit: np.ndarray, no_visit: np.ndarray, time: np.ndarray
) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Group events into visits: (visit number per event, per visit (patient, visit code or -1, day or 0)).

    ``visit`` codes index ``no_visit``, which is True for the code of the empty visit id. Visit numbers are
    dense but in no particular order.
    """
    n_visit_codes = len(no_visit)
    has_id = ~no_visit[visit] if len(visit) else np.zeros(0, dtype=bool)
    day = np.asarray(time, dtype="datetime64[us]").astype("datetime64[D]").view(np.int64)
    first_day = int(day.min()) if len(day) else 0
    slot = np.where(has_id, visit, n_visit_codes + day - first_day)  # the visit id, else the day
    group = group_ids([patient, slot])
    n_groups = int(group.max()) + 1 if len(group) else 0
    p = np.zeros(n_groups, dtype=np.int64)
    p[group] = patient
    s = np.zeros(n_groups, dtype=np.int64)
    s[group] = slot
    with_id = s < n_visit_codes
    return group, (p, np.where(with_id, s, -1), np.where(with_id, 0, s - n_visit_codes + first_day))


def _visit_order(
    patient: np.ndarray, time: np.ndarray, visit: np.ndarray, day: np.ndarray, visit_uniques: np.ndarray
) -> np.ndarray:
    """Visits sorted by patient, time, then visit id text (visits without an id, ``visit`` -1, first), day.

    ``visit`` codes index ``visit_uniques`` in no particular order, so they are sorted by their text only
    where patient and time tie (rare), not all of them.

    >>> _visit_order(np.array([1, 0, 0, 0]), np.array([5, 7, 7, 3]), np.array([-1, 0, -1, 1]), np.array([9, 0, 8, 0]),
    ...              np.array(["b", "a"], dtype=object)).tolist()
    [3, 2, 1, 0]
    """
    key = ordered_key([patient, time])
    order = np.lexsort((time, patient)) if key is None else np.argsort(key)
    tie = (patient[order][1:] == patient[order][:-1]) & (time[order][1:] == time[order][:-1])
    if not tie.any():
        return order
    in_tie = np.zeros(len(order), dtype=bool)
    in_tie[1:] |= tie
    in_tie[:-1] |= tie
    at = np.flatnonzero(in_tie)
    run = np.cumsum(np.r_[True, ~tie])[at]  # tied visits form contiguous runs of positions
    sub = order[at]
    has_id = visit[sub] >= 0
    text = np.where(has_id, visit_uniques[np.maximum(visit[sub], 0)], "")
    rank = factorize_text(text)[0]
    order[at] = sub[np.lexsort((day[sub], rank, has_id, run))]
    return order


def structure(
    events: pd.DataFrame,
    tokens: np.ndarray | pd.Categorical,
    patients: pd.DataFrame,
    max_seq_len: int,
    *,
    codes: EventCodes | None = None,
    keep_first_records: bool = False,
) -> Structured:
    """Group usable events (with their token strings) into ordered, merged, length-limited visits.

    ``tokens``: one token per event, as strings or as a categorical (:func:`~behrt_rope.etl.codes.token_codes`).
    ``codes``: the events' integer codes when the caller has them already (``Cleaned.codes``).
    ``keep_first_records``: a history too long for ``max_seq_len`` keeps its older visits thinned to the codes
    first recorded there (:func:`_thin_older`) instead of losing them whole.
    """
    codes = codes if codes is not None else EventCodes.of(events)
    tokens = tokens if isinstance(tokens, pd.Categorical) else pd.Categorical(np.asarray(tokens, dtype=object))
    pid, pid_uniques = codes.patient, codes.patient_uniques
    time = events[S.TIME].to_numpy(dtype="datetime64[us]")
    t = time.view(np.int64)
    visit, (vp, vv, vd) = _visit_groups(pid, codes.visit, codes.visit_uniques == "", time)
    n_visits = len(vp)
    vt = np.full(n_visits, np.iinfo(np.int64).max)
    np.minimum.at(vt, visit, t)

    # distinct tokens per visit (repeated codes in a visit merge into one token), sorted by visit and token
    n_tok = max(len(tokens.categories), 1)
    event_pair_key = visit * n_tok + tokens.codes.astype(np.int64)
    pairs = distinct_sorted(np.sort(event_pair_key))
    pair_visit, pair_token = pairs // n_tok, pairs % n_tok

    # Visit order: by time, ties broken by visit id then day (never by row order); then the newest visits
    # that fit in max_seq_len, with the older ones thinned to their codes' first records or dropped.
    order = _visit_order(vp, vt, vv, vd, codes.visit_uniques)
    sp = vp[order]
    starts = np.flatnonzero(np.r_[True, sp[1:] != sp[:-1]]) if n_visits else np.zeros(0, dtype=np.int64)
    ends = np.r_[starts[1:], n_visits][: len(starts)] - 1
    is_start = np.zeros(n_visits, dtype=bool)
    is_start[starts] = True
    g = np.cumsum(is_start) - 1  # patient group of each ordered visit
    whole, thinned, pair_kept = _fit_length(
        pair_visit, pair_token, vp, order, (starts, ends, g), max_seq_len, keep_first_records
    )
    keep = whole | thinned
    n_kept, n_whole = (
        (np.add.reduceat(m.astype(np.int64), starts) if n_visits else np.zeros(0, dtype=np.int64))
        for m in (keep, whole)
    )
    kept_any = n_kept > 0
    too_long_patient = np.zeros(len(pid_uniques), dtype=bool)
    too_long_patient[sp[starts[~kept_any]]] = True

    kept = order[keep]  # visit numbers in output order
    visit_kept = np.zeros(n_visits, dtype=bool)
    visit_kept[kept] = True
    kept_so_far = np.cumsum(keep)
    visit_index = (kept_so_far - 1 - (kept_so_far - keep)[starts][g])[keep]

    patient_codes = sp[starts[kept_any]]  # ascending: the output is sorted by patient id
    remap = np.full(len(pid_uniques), -1)
    remap[patient_codes] = np.arange(len(patient_codes))
    last_time = np.full(len(pid_uniques), np.iinfo(np.int64).min)
    np.maximum.at(last_time, pid, t)
    p_index = pd.Index(patients[S.PATIENT_ID].to_numpy(dtype=object)).get_indexer(pid_uniques[patient_codes])
    out_patients = pd.DataFrame(
        {
            S.PATIENT_ID: pd.Series(pid_uniques[patient_codes], dtype=object),
            S.BIRTH_DATE: patients[S.BIRTH_DATE].to_numpy("datetime64[us]")[p_index],
            S.DEATH_DATE: patients[S.DEATH_DATE].to_numpy("datetime64[us]")[p_index],
            S.LAST_EVENT_TIME: last_time[patient_codes].view("datetime64[us]"),
            S.SEX: _sex_column(patients)[p_index],
            S.N_THINNED_VISITS: np.bincount(g[thinned], minlength=len(starts))[kept_any].astype(np.int32),
        }
    )
    # the kept visits' codes in output order: each visit's run of (sorted) kept pairs, moved as a block
    kept_pairs = None if pair_kept is None else np.flatnonzero(pair_kept)
    n_kept_codes = np.bincount(pair_visit if kept_pairs is None else pair_visit[kept_pairs], minlength=n_visits)
    run_length = n_kept_codes[kept]
    run_start = (np.cumsum(n_kept_codes) - n_kept_codes)[kept]
    n_out = int(run_length.sum())
    take = np.repeat(run_start - (np.cumsum(run_length) - run_length), run_length) + np.arange(n_out)
    take = take if kept_pairs is None else kept_pairs[take]
    if pair_kept is None:
        event_kept = visit_kept[visit]
    else:
        event_pair = np.searchsorted(pairs, event_pair_key)
        event_kept = pair_kept[event_pair] & visit_kept[visit]
    dropped = ~keep & kept_any[g]
    return Structured(
        patients=out_patients,
        visits=pd.DataFrame(
            {
                "patient": remap[vp[kept]],
                S.VISIT_INDEX: visit_index,
                S.TIME: vt[kept].view("datetime64[us]"),
            }
        ),
        codes=pd.DataFrame(
            {
                "visit": np.repeat(np.arange(len(kept)), run_length),
                "token": pd.Categorical.from_codes(pair_token[take], categories=tokens.categories),
            }
        ),
        merged_in_visit=int(event_kept.sum()) - n_out,
        truncated_events=int((~event_kept & ~too_long_patient[pid]).sum()),
        truncated_visits=int(dropped.sum()),
        truncated_patients=int(((n_whole < ends - starts + 1) & kept_any).sum()),  # lost or thinned a visit
        too_long=too_long_patient[pid],
        thinned_visits=int(thinned.sum()),
    )


def _fit_length(
    pair_visit: np.ndarray,
    pair_token: np.ndarray,
    visit_patient: np.ndarray,
    order: np.ndarray,
    groups: tuple[np.ndarray, np.ndarray, np.ndarray],
    max_len: int,
    keep_first_records: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Which visits fit in ``max_len`` tokens: per visit in output ``order`` (patients' visits at ``groups`` =
    (starts, ends, patient group per visit)), kept whole and kept thinned to their first records; and per
    distinct (visit, token) pair, whether it is kept where older visits were thinned (None: none were, so every
    pair of a kept visit is)."""
    starts, ends, g = groups
    n_visits = len(order)
    n_codes = np.bincount(pair_visit, minlength=n_visits)[order]
    whole = _tokens_from(n_codes, ends, g) + 1 <= max_len  # the newest visits that fit
    thinned = np.zeros(n_visits, dtype=bool)
    if not keep_first_records or whole.all():
        return whole, thinned, None
    cut_short = visit_patient[order][starts[~whole[starts]]]
    first = _first_records(pair_visit, pair_token, visit_patient, order, cut_short)
    n_first = np.bincount(pair_visit[first], minlength=n_visits)[order]
    whole, thinned = _thin_older(n_codes, n_first, starts, ends, g, max_len)
    visit_thinned = np.zeros(n_visits, dtype=bool)
    visit_thinned[order[thinned]] = True
    return whole, thinned, ~visit_thinned[pair_visit] | first


def _tokens_from(n_codes: np.ndarray, ends: np.ndarray, g: np.ndarray) -> np.ndarray:
    """Per visit in output order (``n_codes`` codes each, patient group ``g`` whose last visit is ``ends[g]``):
    the tokens of this visit and every later one of its patient, each visit's codes and closing [SEP]."""
    cost = n_codes + 1
    csum = np.cumsum(cost)
    return csum[ends][g] - csum + cost


def _first_records(
    pair_visit: np.ndarray, pair_token: np.ndarray, visit_patient: np.ndarray, order: np.ndarray, patients: np.ndarray
) -> np.ndarray:
    """True for each distinct (visit, token) pair, of the patients in ``patients`` only, that is its token's
    first record in the patient's history (visits in ``order``, the output order)."""
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.arange(len(order))
    candidates = np.flatnonzero(np.isin(visit_patient[pair_visit], patients))
    patient, token = visit_patient[pair_visit[candidates]], pair_token[candidates]
    by_code = np.lexsort((rank[pair_visit[candidates]], token, patient))
    p, t = patient[by_code], token[by_code]
    first = np.zeros(len(pair_visit), dtype=bool)
    first[candidates[by_code]] = np.r_[True, (p[1:] != p[:-1]) | (t[1:] != t[:-1])][: len(by_code)]
    return first


def _thin_older(
    n_codes: np.ndarray, n_first: np.ndarray, starts: np.ndarray, ends: np.ndarray, g: np.ndarray, max_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per visit in output order: (kept whole, kept as its codes' first records only).

    A patient keeps as many of their newest visits whole as fit beside every older visit thinned to the codes
    first recorded there (``n_first`` per visit; an older visit with none is dropped), the thinned part taking
    at most half of ``max_len`` tokens. Where that fits nowhere, the patient keeps only the newest visits that
    fit, as without thinning.
    """
    position = np.arange(len(n_codes))
    after = _tokens_from(n_codes, ends, g)
    thin_cost = n_first + (n_first > 0)
    before = np.cumsum(thin_cost) - thin_cost
    before = before - before[starts][g]  # tokens of the patient's earlier visits, thinned
    fits = (after + before + 1 <= max_len) & (before <= max_len // 2)
    cut = np.minimum.reduceat(np.where(fits, position, len(position)), starts)  # first visit kept whole
    thins = cut <= ends  # patients for whom thinning fits
    whole = np.where(thins[g], position >= cut[g], after + 1 <= max_len)
    return whole, thins[g] & (position < cut[g]) & (n_first > 0)


def to_token_table(structured: Structured, vocabulary: pd.DataFrame, splits: np.ndarray) -> pa.Table:
    """Token streams (schema ``S.TOKENS``), one row per patient of ``structured``; ``splits`` per patient.

    Placement is computed, not sorted: each visit occupies its codes (by token id) and a closing [SEP],
    visits follow one another, and each patient's stream starts with a [CLS].
    """
    visits, codes, patients = structured.visits, structured.codes, structured.patients
    n_patients, n_visits = len(patients), len(visits)
    visit_patient = visits["patient"].to_numpy().astype(np.int64)
    visit_index = visits[S.VISIT_INDEX].to_numpy().astype(np.int64)
    if n_visits and np.any(np.diff(visit_patient * (int(visit_index.max()) + 1) + visit_index) <= 0):
        raise ValueError("structured visits must be sorted by patient and visit index")

    tokens = codes["token"]
    categorical = (
        tokens.array if isinstance(tokens.dtype, pd.CategoricalDtype) else pd.Categorical(tokens.to_numpy(dtype=object))
    )
    ids = lookup(np.asarray(categorical.categories, dtype=object), vocabulary)[categorical.codes]
    code_visit, code_id = _sorted_codes(codes["visit"].to_numpy().astype(np.int64), ids, len(vocabulary))

    n_codes = np.bincount(code_visit, minlength=n_visits)
    visit_len = n_codes + 1
    visit_start = np.cumsum(visit_len) - visit_len + visit_patient + 1  # after the [CLS]s so far
    first_visit = np.searchsorted(visit_patient, np.arange(n_patients))
    cls_pos = visit_start[first_visit] - 1 if n_visits else np.zeros(0, dtype=np.int64)
    code_rank = np.arange(len(code_visit)) - (np.cumsum(n_codes) - n_codes)[code_visit]
    code_pos = visit_start[code_visit] + code_rank
    sep_pos = visit_start + n_codes
    total = n_patients + int(visit_len.sum())
    row_token = np.empty(total, dtype=np.int32)
    row_visit = np.empty(total, dtype=np.int64)
    for pos, token, visit in (
        (cls_pos, S.CLS_ID, first_visit),
        (sep_pos, S.SEP_ID, np.arange(n_visits)),
        (code_pos, code_id, code_visit),
    ):
        row_token[pos] = token
        row_visit[pos] = visit
    row_vindex = visit_index[row_visit]

    birth_day = patients[S.BIRTH_DATE].to_numpy("datetime64[us]").astype("datetime64[D]")
    visit_time = visits[S.TIME].to_numpy("datetime64[us]")
    visit_age = (visit_time.astype("datetime64[D]") - birth_day[visit_patient]).astype(np.int64) / DAYS_PER_YEAR
    lengths = np.bincount(visit_patient, weights=visit_len, minlength=n_patients).astype(np.int64) + 1
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
        S.N_THINNED_VISITS: pa.array(_thinned_column(patients), pa.int32()),
        S.LAST_EVENT_TIME: pa.array(patients[S.LAST_EVENT_TIME].to_numpy("datetime64[us]"), pa.timestamp("us")),
        S.SEX: pa.array(_sex_column(patients), pa.string()),
        S.TOKEN_IDS: lists(row_token, pa.int32()),
        S.AGES: lists(visit_age[row_visit].astype(np.float32), pa.float32()),
        S.SEGMENTS: lists((row_vindex % 2).astype(np.int8), pa.int8()),
        S.VISIT_INDEX: lists(row_vindex.astype(np.int16), pa.int16()),
        S.VISIT_DATES: lists(visit_time[row_visit], pa.timestamp("us")),
    }
    return pa.table(columns, schema=S.TOKENS)


def _thinned_column(patients: pd.DataFrame) -> np.ndarray:
    """The patients' numbers of thinned visits (0 for all when the frame has no such column), int32."""
    if S.N_THINNED_VISITS not in patients.columns:
        return np.zeros(len(patients), dtype=np.int32)
    return patients[S.N_THINNED_VISITS].to_numpy().astype(np.int32)


def _sex_column(patients: pd.DataFrame) -> np.ndarray:
    """The patients' sex categories (``unknown`` for all when the frame has no SEX column), object array."""
    if S.SEX not in patients.columns:
        return np.full(len(patients), UNKNOWN, dtype=object)
    return patients[S.SEX].to_numpy(dtype=object)


def _sorted_codes(visit: np.ndarray, ids: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """(visit, token id) of each code, sorted by visit then id.

    Codes from :func:`structure` come sorted by visit and token text, which is id order except for [UNK]
    (tokens outside the vocabulary): then only each visit's [UNK]s move to its front, without a sort.

    >>> v, i = _sorted_codes(np.array([0, 0, 0, 1, 1]), np.array([5, 4, 7, 4, 4]), 8)
    >>> v.tolist(), i.tolist()
    ([0, 0, 0, 1, 1], [4, 5, 7, 4, 4])
    """
    ids = np.asarray(ids, dtype=np.int64)
    known = ids != S.UNK_ID
    key = visit * width + ids
    if len(visit) and not ((np.diff(visit) >= 0).all() and (np.diff(key[known]) > 0).all()):
        key = np.sort(key)
        return key // width, (key % width).astype(np.int32)
    n_visits = int(visit.max()) + 1 if len(visit) else 0
    first = np.cumsum(np.bincount(visit, minlength=n_visits)) - np.bincount(visit, minlength=n_visits)
    unk = ~known
    n_unk = np.bincount(visit[unk], minlength=n_visits)
    unk_so_far = np.cumsum(unk)
    unk_before = (np.cumsum(n_unk) - n_unk)[visit]  # [UNK]s in earlier visits
    in_visit = np.arange(len(visit)) - first[visit]
    rank = np.where(unk, unk_so_far - 1 - unk_before, n_unk[visit] + in_visit - (unk_so_far - unk_before))
    out = np.empty(len(ids), dtype=np.int32)
    out[first[visit] + rank] = ids
    return visit, out
