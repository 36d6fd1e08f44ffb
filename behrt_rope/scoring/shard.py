"""One patient shard of a ``predict`` run, read to predictions: the unit of work of every engine.

:func:`prepare_shard` reads one hash shard of an input planned once (:class:`~behrt_rope.etl.readers.
ShardSource`) with the model's own ETL settings and vocabulary; :func:`predictions_table` lays the
probabilities out as the predictions (long layout). The local engine calls them shard after shard in one
process, the Ray engine in a pool of actors; both produce the same rows.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa

from behrt_rope import schema as S
from behrt_rope.data.sequences import Sequences, from_table
from behrt_rope.etl.codes import factorize_text
from behrt_rope.etl.io import TABLE_SUFFIXES
from behrt_rope.etl.readers import ShardSource
from behrt_rope.etl.runner import process_shard
from behrt_rope.etl.tokenize import to_token_table
from behrt_rope.scoring.code_match import Matcher, Remedy, respell

CSV_BYTES_PER_ROW = 32  # a synthetic visits-format event row is about 35 bytes; gzip about 4x smaller


@dataclass
class Prepared:
    """Token streams of one shard's scorable patients and an account of everything else."""

    seqs: Sequences
    unscored: pd.DataFrame  # PATIENT_ID, REASON
    unknown_codes: Counter[str]  # after match_codes
    code_events: int  # code tokens of the scored histories, known or not
    matched_codes: Counter[str]  # code tokens match_codes respelled onto the vocabulary, by input token
    quarantine: pd.DataFrame
    patient_id_type: str
    rows: dict[str, Counter[str]]  # per input file: rows, used, quarantined, duplicates_dropped, filtered
    truncation: Counter[str]  # patients_truncated, events_dropped: what the model's max_seq_len cut off


def estimate_rows(input_dir: Path) -> int:
    """Input rows over every table file under ``input_dir``: exact for Parquet (footer), estimated from the
    size for CSV (``CSV_BYTES_PER_ROW``, gzip counted 4x)."""
    import pyarrow.parquet as pq

    rows = 0
    for path in input_dir.rglob("*"):
        if not (path.is_file() and path.name.endswith(TABLE_SUFFIXES)):
            continue
        if path.name.endswith(".parquet"):
            rows += pq.ParquetFile(path).metadata.num_rows
        else:
            scale = 4 if path.name.endswith(".gz") else 1
            rows += scale * path.stat().st_size // CSV_BYTES_PER_ROW
    return rows


def n_shards(input_dir: Path, shards: int, shard_rows: int) -> int:
    """``shards`` when set, else enough shards that each holds about ``shard_rows`` input rows."""
    if shards > 0:
        return shards
    return max(1, -(-estimate_rows(input_dir) // shard_rows))


def prepare_shard(
    src: ShardSource,
    vocab: pd.DataFrame,
    shard: int,
    shards: int,
    match_codes: tuple[Remedy, ...] = (),
    as_of: str = "",
    keep_future_records: bool = False,
) -> Prepared:
    """Read, clean and tokenise patient shard ``shard`` of ``shards`` with the model's settings and vocabulary.

    ``vocab``: ``token_id``, ``token``. Codes outside it are respelled onto it by the ``match_codes``
    remedies (:mod:`~behrt_rope.scoring.code_match`) where they can be, else become [UNK] and are counted
    in ``unknown_codes``. Events dated after the ISO day ``as_of`` (when given) are quarantined with reason
    ``event_after_as_of``, so each history ends at it (with ``keep_future_records``, not those of a patient
    with no event on or before it: :func:`set_aside_after`).
    """
    etl = src.etl
    raw = src.read(shard, shards)
    if as_of:
        raw.events = set_aside_after(raw.events, as_of, keep_future_records)
    result = process_shard(raw, etl)
    structured = result.structured
    code_events = len(structured.codes)
    matched: Counter[str] = Counter()
    if match_codes:
        structured.codes, matched = _respelled(structured.codes, Matcher(vocab["token"], match_codes))
    tokens = structured.codes["token"]
    table = to_token_table(structured, vocab, np.full(len(structured.patients), "", dtype=object))
    return Prepared(
        seqs=from_table(table),
        unscored=_unscored(raw.patients, raw.events, structured.patients, result.quarantine),
        unknown_codes=unknown_codes(tokens, vocab["token"]),
        code_events=code_events,
        matched_codes=matched,
        quarantine=result.quarantine,
        patient_id_type=raw.patient_id_type,
        rows=result.counts,
        truncation=Counter(
            patients_truncated=structured.truncated_patients, events_dropped=structured.truncated_events
        ),
    )


def set_aside_after(events: pd.DataFrame, as_of: str, keep_future_records: bool = False) -> pd.DataFrame:
    """Canonical ``events`` with those dated after the calendar day ``as_of`` given reason AFTER_AS_OF where
    the reader gave none (the cleaning then quarantines them unless a fault of their own comes first).

    ``keep_future_records``: a patient none of whose events is dated on or before ``as_of`` keeps them all (a
    record date-shifted into the future, as MIMIC's are, rather than a wrong date in a record of the past).

    >>> days = ["2024-06-30T23", "2099-01-01", None, "2150-01-01"]
    >>> e = pd.DataFrame({S.PATIENT_ID: ["a", "a", "a", "b"], S.TIME: pd.to_datetime(days, format="ISO8601")})
    >>> set_aside_after(e, "2024-06-30")[S.REASON].tolist()
    ['', 'event_after_as_of', '', 'event_after_as_of']
    >>> set_aside_after(e, "2024-06-30", keep_future_records=True)[S.REASON].tolist()
    ['', 'event_after_as_of', '', '']
    """
    day = events[S.TIME].to_numpy(dtype="datetime64[us]").astype("datetime64[D]")
    late = day > np.datetime64(as_of, "D")  # NaT compares False
    if keep_future_records and late.any():
        patient, ids = factorize_text(events[S.PATIENT_ID], sort=False)
        has_past = np.zeros(len(ids), dtype=bool)
        has_past[patient[~late & ~np.isnat(day)]] = True
        late &= has_past[patient]
    if not late.any():
        return events
    given = events[S.REASON].to_numpy(dtype=object) if S.REASON in events.columns else np.full(len(events), "", object)
    return events.assign(**{S.REASON: np.where(late & (given == ""), S.Reason.AFTER_AS_OF, given).astype(object)})


def _respelled(codes: pd.DataFrame, matcher: Matcher) -> tuple[pd.DataFrame, Counter[str]]:
    """A shard's code rows (``visit``, ``token``) respelled by ``matcher``, a token that a visit then holds
    twice kept once (as the ETL merges a code recorded twice in a visit); and the respelled tokens' counts."""
    tokens, matched = respell(codes["token"].array, matcher)
    if not matched:
        return codes, matched
    codes = codes.assign(token=tokens).drop_duplicates(["visit", "token"], ignore_index=True)
    return codes, matched


def unknown_codes(tokens: pd.Series, known: pd.Series) -> Counter[str]:
    """Occurrences of each token of ``tokens`` (one per code event) that is not in ``known``, keyed in order
    of first occurrence, as ``Counter(tokens[~isin])`` would (``most_common`` breaks ties by that order).

    A categorical ``tokens`` (what :func:`~behrt_rope.etl.tokenize.structure` makes) is checked per
    category and counted on its integer codes, without a Python string per event.

    >>> unknown_codes(pd.Series(pd.Categorical(["Z1", "I10", "A0", "Z1"])), pd.Series(["I10"]))
    Counter({'Z1': 2, 'A0': 1})
    """
    if not isinstance(tokens.dtype, pd.CategoricalDtype) or (tokens.array.codes < 0).any():
        values = tokens.to_numpy(dtype=object)
        return Counter(values[~np.isin(values, known.to_numpy(dtype=object))].tolist())
    categories = np.asarray(tokens.cat.categories, dtype=object)
    unknown = ~np.isin(categories, known.to_numpy(dtype=object))  # per category: few
    codes = tokens.array.codes
    found = codes[unknown[codes]]
    counts = np.bincount(found, minlength=len(categories))
    return Counter({categories[c]: int(counts[c]) for c in pd.unique(found)})


def _distinct(ids: pd.Series) -> np.ndarray:
    """The distinct values of a column as an object array (in no particular order)."""
    return np.asarray(ids.unique(), dtype=object)


def _unscored(
    patients: pd.DataFrame, events: pd.DataFrame, scored: pd.DataFrame, quarantine: pd.DataFrame
) -> pd.DataFrame:
    """Every patient id seen in the input but not scored, with the reason.

    The ids are made distinct per table first (a hash over the Arrow-backed column), so only distinct ids,
    not every event row, become Python strings.
    """
    seen = np.concatenate([_distinct(patients[S.PATIENT_ID]), _distinct(events[S.PATIENT_ID])])
    missing = np.setdiff1d(np.asarray(seen[seen != ""], dtype=str), scored[S.PATIENT_ID].to_numpy(str))
    frame = pd.DataFrame({S.PATIENT_ID: missing.astype(object)})
    frame[S.REASON] = _joined_reasons(quarantine[quarantine[S.PATIENT_ID].isin(missing)], missing)
    return frame


def _joined_reasons(quarantine: pd.DataFrame, ids: np.ndarray) -> np.ndarray:
    """Per id of the sorted, distinct ``ids`` (N,), its distinct quarantine reasons, sorted and joined by ',';
    ``no_events`` for an id without a quarantined row. Every quarantine row's id is one of ``ids``.

    A reason set is joined once however many patients share it (a few sets, many patients).

    >>> q = pd.DataFrame({S.PATIENT_ID: ["b", "a", "b", "b"], S.REASON: ["y", "x", "x", "y"]})
    >>> _joined_reasons(q, np.array(["a", "b", "c"])).tolist()
    ['x', 'x,y', 'no_events']
    """
    out = np.full(len(ids), "no_events", dtype=object)
    if not len(quarantine):
        return out
    reason, names = factorize_text(quarantine[S.REASON])  # names sorted: codes follow text order
    has = np.zeros((len(ids), len(names)), dtype=bool)  # (N, distinct reasons)
    has[np.searchsorted(ids, quarantine[S.PATIENT_ID].to_numpy(str)), reason] = True
    rows = np.flatnonzero(has.any(axis=1))
    sets, which = np.unique(has[rows], axis=0, return_inverse=True)
    out[rows] = np.asarray([",".join(names[row]) for row in sets], dtype=object)[which.reshape(-1)]
    return out


def predictions_schema(patient_id_type: str) -> pa.Schema:
    """The predictions file's schema, the long layout of SPEC (``layout=meds`` is derived from it)."""
    id_type = pa.int64() if patient_id_type == "int64" else pa.string()
    return pa.schema(
        [
            (S.PATIENT_ID, id_type),
            (S.PREDICTION_TIME, pa.timestamp("us")),
            (S.CODE, pa.string()),
            (S.PROBABILITY, pa.float64()),
        ]
    )


def predictions_table(patients: pd.DataFrame, labels: list[str], probs: np.ndarray, patient_id_type: str) -> pa.Table:
    """Predictions of ``patients`` (PATIENT_ID, LAST_EVENT_TIME), ``probs`` ``(N, L)``, in the long layout:
    ``N * L`` rows, patient-major."""
    schema = predictions_schema(patient_id_type)
    ids = patients[S.PATIENT_ID].to_numpy(dtype=object)
    id_array = pa.array(ids.astype(np.int64) if patient_id_type == "int64" else ids.astype(str), schema.field(0).type)
    times = pa.array(patients[S.LAST_EVENT_TIME].to_numpy("datetime64[us]"), pa.timestamp("us"))
    n, n_labels = probs.shape
    repeat = pa.array(np.repeat(np.arange(n), n_labels))
    codes = pa.DictionaryArray.from_arrays(
        np.tile(np.arange(n_labels, dtype=np.int32), n), pa.array(labels, pa.string())
    )
    columns = [
        id_array.take(repeat),
        times.take(repeat),
        codes.cast(pa.string()),
        pa.array(probs.reshape(-1).astype(np.float64)),
    ]
    return pa.Table.from_arrays(columns, schema=schema)
