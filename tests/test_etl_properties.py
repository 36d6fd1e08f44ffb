"""Invariants of the ETL on random messy cohorts (hypothesis).

Row order never matters; every input row is accounted for; streams are well formed; sharding changes
nothing; splits depend on the id alone; and the token streams match a slow, obvious per-patient reference.
"""

from __future__ import annotations

import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from conftest import EtlOutput, etl, write_visits
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from behrt_rope import schema as S
from behrt_rope.etl.config import SplitConfig
from behrt_rope.etl.split import assign_splits

IDS = ["a", "b", "c", "007", "7"]
BIRTHS = ["1990-01-01", "2000-06-15", "2005-02-28", "2000-06-15T00:00:00", "garbage", "", "2021-02-29"]
DEATHS = ["", "", "", "2012-01-01", "1980-01-01", "never"]
DATES = [
    "1995-05-05",
    "2010-01-01",
    "2010-01-01T08:00:00",
    "2010-01-01T17:30",
    "2010-01-01 08:00:00",
    "2010-01-02",
    "2011-07-01",
    "2011-07-01",
    "2013-03-03",
    "garbage",
    "",
    "2021-02-29",
]
CODES = ["I10", "I10.0", "E11", "E11.9", "0250", "250", " J45 ", "[MASK]", ""]
SETTINGS: dict[str, Any] = {"max_invalid_fraction": 1.0, "code_truncate": 3}

patient_rows = st.lists(
    st.fixed_dictionaries(
        {
            "patient_id": st.sampled_from([*IDS, ""]),
            "birth_date": st.sampled_from(BIRTHS),
            "death_date": st.sampled_from(DEATHS),
        }
    ),
    max_size=8,
)
event_rows = st.lists(
    st.fixed_dictionaries(
        {
            "patient_id": st.sampled_from([*IDS, "ghost", ""]),
            "date": st.sampled_from(DATES),
            "code": st.sampled_from(CODES),
            "visit_id": st.sampled_from(["", "", "", "v1", "v2"]),
            "code_system": st.sampled_from(["", "", "ICD9"]),
        }
    ),
    max_size=40,
)
PROPERTY = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])

P_COLUMNS = ["patient_id", "birth_date", "death_date"]
E_COLUMNS = ["patient_id", "date", "code", "visit_id", "code_system"]


def _frames(patients: list[dict[str, str]], events: list[dict[str, str]]) -> tuple[pd.DataFrame, pd.DataFrame]:
    return pd.DataFrame(patients, columns=P_COLUMNS), pd.DataFrame(events, columns=E_COLUMNS)


def _run(patients: pd.DataFrame, events: pd.DataFrame, fmt: str = "csv", **settings: Any) -> EtlOutput:
    """Run the ETL in a temporary directory and read everything back before it disappears."""
    with tempfile.TemporaryDirectory() as tmp:
        src = write_visits(Path(tmp) / "in", patients, events, fmt)
        out = etl(src, Path(tmp) / "out", **{**SETTINGS, **settings})
        result = _Loaded(out.out, out.manifest)
        result.load()
        return result


class _Loaded(EtlOutput):
    """An ETL output held in memory (its directory is temporary)."""

    def load(self) -> None:
        self.table = pq.read_table(self.out / S.TOKENS_DIR).sort_by(S.PATIENT_ID).combine_chunks()
        self._tokens = self.table.to_pandas()
        self._vocab = pd.read_parquet(self.out / S.VOCAB_FILE)
        self._quarantine = pd.read_parquet(self.out / S.QUARANTINE_FILE)

    @property
    def tokens(self) -> pd.DataFrame:
        return self._tokens

    @property
    def vocab(self) -> pd.DataFrame:
        return self._vocab

    @property
    def quarantine(self) -> pd.DataFrame:
        return self._quarantine


def _quarantine_multiset(q: pd.DataFrame) -> list[tuple[Any, ...]]:
    return sorted(q.drop(columns=[S.SOURCE_ROW]).itertuples(index=False, name=None))


def _counts(manifest: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in manifest.items() if k not in ("seconds", "shards", "settings", "input")}


# ---------------------------------------------------------------------------------------------------------
@PROPERTY
@given(patients=patient_rows, events=event_rows, data=st.data())
def test_output_does_not_depend_on_row_order(patients: list, events: list, data: st.DataObject) -> None:
    p, e = _frames(patients, events)
    a = _run(p, e)
    p_order = data.draw(st.permutations(range(len(p))))
    e_order = data.draw(st.permutations(range(len(e))))
    b = _run(p.iloc[list(p_order)], e.iloc[list(e_order)])
    assert a.table.equals(b.table)
    assert a.vocab.equals(b.vocab)
    assert _quarantine_multiset(a.quarantine) == _quarantine_multiset(b.quarantine)
    assert _counts(a.manifest) == _counts(b.manifest)


@PROPERTY
@given(patients=patient_rows, events=event_rows)
def test_every_input_row_is_accounted_for(patients: list, events: list) -> None:
    p, e = _frames(patients, events)
    out = _run(p, e)
    tables, q = out.manifest["tables"], out.quarantine
    for name, frame in (("patients.csv", p), ("events.csv", e)):
        t = tables[name]
        assert t["rows"] == len(frame)
        assert t["rows"] == t["used"] + t["quarantined"] + t["duplicates_dropped"] + t["filtered"]
        rows = q.loc[q[S.SOURCE_TABLE] == name, S.SOURCE_ROW]
        assert rows.is_unique and rows.between(0, len(frame) - 1).all()
        assert len(rows) == t["quarantined"] + t["duplicates_dropped"]
        dup = (q[S.SOURCE_TABLE] == name) & (q[S.REASON] == S.Reason.DUPLICATE)
        assert int(dup.sum()) == t["duplicates_dropped"]
    assert out.manifest["reconciles"]
    assert dict(Counter(q[S.REASON])) == out.manifest["quarantine_reasons"]
    used = out.manifest["events_used"]
    code_tokens = sum(int((ids >= S.UNK_ID).sum()) for ids in out.tokens[S.TOKEN_IDS])
    assert used["events"] == tables["events.csv"]["used"]
    assert used["code_tokens"] == code_tokens
    assert used["events"] == used["code_tokens"] + used["merged_within_visit"] + used["dropped_by_max_seq_len"]
    assert used["reconciles"]


@PROPERTY
@given(
    patients=patient_rows,
    events=event_rows,
    max_seq_len=st.sampled_from([3, 5, 8, 256]),
    first_records=st.booleans(),
)
def test_streams_are_well_formed(patients: list, events: list, max_seq_len: int, first_records: bool) -> None:
    out = _run(*_frames(patients, events), max_seq_len=max_seq_len, keep_first_records=first_records)
    for row in out.tokens.itertuples(index=False):
        ids, vindex = np.asarray(row.token_ids), np.asarray(row.visit_index)
        dates = np.asarray(row.visit_dates, dtype="datetime64[us]")
        n = len(ids)
        assert n == row.n_tokens <= max_seq_len
        assert len(row.ages) == len(row.segments) == len(vindex) == len(dates) == n
        # [CLS] only first; [SEP] exactly where a visit ends; no [PAD]/[MASK] anywhere
        assert ids[0] == S.CLS_ID and not (ids[1:] == S.CLS_ID).any()
        assert not np.isin(ids, [S.PAD_ID, S.MASK_ID]).any()
        visit_ends = np.r_[vindex[1:] != vindex[:-1], True]
        visit_ends[0] = False
        assert ((ids == S.SEP_ID) == visit_ends).all()
        assert row.n_visits == int((ids == S.SEP_ID).sum()) == vindex[-1] + 1
        # visits numbered 0, 1, ... in date order, each followed by its [SEP]
        assert vindex[0] == 0 and set(np.diff(vindex)) <= {0, 1}
        assert (np.diff(dates.astype(np.int64)) >= 0).all()
        assert (np.asarray(row.segments) == vindex % 2).all()
        first_of_visit = np.r_[True, vindex[1:] != vindex[:-1]]
        for start in np.flatnonzero(first_of_visit)[1:]:  # constant per visit
            end = start + int((vindex == vindex[start]).sum())
            assert (dates[start:end] == dates[start]).all()
            codes = ids[start : end - 1]
            assert len(codes) >= 1 and (np.diff(codes) >= 0).all()
            known = codes[codes != S.UNK_ID]
            assert len(set(known.tolist())) == len(known)  # merged: no repeated code in a visit
        birth_day = np.datetime64(row.birth_date, "D")
        expected_age = (dates.astype("datetime64[D]") - birth_day).astype(np.int64) / 365.25
        np.testing.assert_array_equal(np.asarray(row.ages), expected_age.astype(np.float32))


@PROPERTY
@given(patients=patient_rows, events=event_rows, max_seq_len=st.sampled_from([5, 12, 256]), first_records=st.booleans())
def test_shards_give_the_same_dataset(patients: list, events: list, max_seq_len: int, first_records: bool) -> None:
    p, e = _frames(patients, events)
    one = _run(p, e, max_seq_len=max_seq_len, keep_first_records=first_records)
    three = _run(p, e, max_seq_len=max_seq_len, shards=3, keep_first_records=first_records)
    assert one.table.equals(three.table)
    assert one.vocab.equals(three.vocab)
    assert one.quarantine.equals(three.quarantine)
    assert _counts(one.manifest) == _counts(three.manifest)


@PROPERTY
@given(patients=patient_rows, events=event_rows)
def test_csv_and_parquet_inputs_agree(patients: list, events: list) -> None:
    p, e = _frames(patients, events)
    a, b = _run(p, e), _run(p, e, fmt="parquet")
    assert a.table.equals(b.table)
    assert a.quarantine.assign(source_table="").equals(b.quarantine.assign(source_table=""))


@settings(max_examples=50, deadline=None)
@given(
    ids=st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=50, unique=True),
    others=st.lists(st.text(min_size=1, max_size=8), max_size=20),
    data=st.data(),
)
def test_split_depends_on_the_id_alone(ids: list[str], others: list[str], data: st.DataObject) -> None:
    config = SplitConfig()
    alone = assign_splits(np.array(ids, dtype=object), config)
    mixed = data.draw(st.permutations([*ids, *others]))
    together = dict(zip(mixed, assign_splits(np.array(mixed, dtype=object), config)))
    assert alone.tolist() == [together[i] for i in ids]


# ---------------------------------------------------------------------------------------------------------
# Parity with a slow, obvious reference
# ---------------------------------------------------------------------------------------------------------
def reference_streams(
    patients: pd.DataFrame,
    events: pd.DataFrame,
    out: EtlOutput,
    max_seq_len: int,
    truncate: int,
    first_records: bool = False,
) -> dict[str, tuple[list[int], list[float]]]:
    """Token ids and ages per patient, computed row by row in plain Python from the rows the ETL kept.

    Uses the ETL's own quarantine (what is usable) and vocabulary (which codes are known); everything
    else (visit grouping, ordering, merging, truncation, layout, ages) is recomputed here.
    """
    q = out.quarantine
    rejected = set(q.loc[q[S.SOURCE_TABLE] == "events.csv", S.SOURCE_ROW])
    rejected_patients = set(q.loc[q[S.SOURCE_TABLE] == "patients.csv", S.SOURCE_ROW])
    births = {
        r.patient_id.strip(): pd.Timestamp(r.birth_date.strip()).normalize()
        for i, r in enumerate(patients.itertuples())
        if i not in rejected_patients
    }
    vocab = dict(zip(out.vocab["token"], out.vocab["token_id"]))
    visits: dict[str, dict[tuple[Any, ...], dict[str, Any]]] = {}
    for i, r in enumerate(events.itertuples()):
        if i in rejected:
            continue
        time = pd.Timestamp(r.date.strip())
        vid = r.visit_id.strip()
        key = (0, vid, 0) if vid else (-1, "", time.normalize())  # no id first, then by id
        code = r.code.strip().replace(".", "")[:truncate]
        token = f"{r.code_system.strip()}/{code}" if r.code_system.strip() else code
        v = visits.setdefault(r.patient_id.strip(), {}).setdefault(key, {"time": time, "tokens": set()})
        v["time"] = min(v["time"], time)
        v["tokens"].add(token)
    streams = {}
    for pid, by_key in visits.items():
        ordered = sorted(by_key.items(), key=lambda kv: (kv[1]["time"], kv[0][0], kv[0][1], kv[0][2]))

        def ids_of(tokens: set[str]) -> list[int]:
            return sorted(vocab[t] if t in vocab and vocab[t] >= S.N_SPECIAL else S.UNK_ID for t in tokens)

        ages = [(v["time"].normalize() - births[pid]).days / 365.25 for _, v in ordered]
        laid = [(ids_of(v["tokens"]), age) for (_, v), age in zip(ordered, ages)]
        if first_records and 1 + sum(len(ids) + 1 for ids, _ in laid) > max_seq_len:
            laid = _thinned(laid, [v["tokens"] for _, v in ordered], ages, ids_of, max_seq_len)
        while laid and 1 + sum(len(ids) + 1 for ids, _ in laid) > max_seq_len:
            laid.pop(0)
        if laid:
            tokens = [S.CLS_ID] + [t for ids, _ in laid for t in [*ids, S.SEP_ID]]
            ages = [laid[0][1]] + [a for ids, a in laid for _ in range(len(ids) + 1)]
            streams[pid] = (tokens, ages)
    return streams


def _thinned(
    laid: list[tuple[list[int], float]],
    tokens: list[set[str]],
    ages: list[float],
    ids_of: Callable[[set[str]], list[int]],
    max_seq_len: int,
) -> list[tuple[list[int], float]]:
    """The first cut whose older visits, thinned to their first records, fit beside the newer ones whole
    (taking at most half the stream); unchanged where none does."""
    for cut in range(1, len(laid)):
        seen: set[str] = set()
        thinned = []
        for visit, age in zip(tokens[:cut], ages):
            if visit - seen:
                thinned.append((ids_of(visit - seen), age))
            seen |= visit
        before = sum(len(ids) + 1 for ids, _ in thinned)
        if 1 + before + sum(len(ids) + 1 for ids, _ in laid[cut:]) <= max_seq_len and before <= max_seq_len // 2:
            return thinned + laid[cut:]
    return laid


@PROPERTY
@given(
    patients=patient_rows,
    events=event_rows,
    max_seq_len=st.sampled_from([4, 7, 12, 256]),
    first_records=st.booleans(),
)
def test_token_streams_match_the_reference(patients: list, events: list, max_seq_len: int, first_records: bool) -> None:
    p, e = _frames(patients, events)
    out = _run(p, e, max_seq_len=max_seq_len, keep_first_records=first_records)
    expected = reference_streams(p.fillna(""), e.fillna(""), out, max_seq_len, 3, first_records)
    got = {
        row.patient_id: (np.asarray(row.token_ids).tolist(), np.asarray(row.ages))
        for row in out.tokens.itertuples(index=False)
    }
    assert set(got) == set(expected)
    for pid, (tokens, ages) in expected.items():
        assert got[pid][0] == tokens
        np.testing.assert_array_equal(got[pid][1], np.asarray(ages, dtype=np.float32))


long_histories = st.lists(
    st.fixed_dictionaries(
        {
            "patient_id": st.sampled_from(["a", "b"]),
            "date": st.integers(0, 24).map(lambda m: f"{2000 + m // 12}-{m % 12 + 1:02d}-01"),
            "code": st.sampled_from(["A01", "B01", "C01", "D01", "E01", "F01", "G01"]),
            "visit_id": st.just(""),
            "code_system": st.just(""),
        }
    ),
    min_size=5,
    max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=long_histories, max_seq_len=st.integers(6, 30))
def test_thinned_streams_match_the_reference(events: list, max_seq_len: int) -> None:
    """Clean, long histories over a few codes: thinning is what the reference does, visit by visit."""
    p = pd.DataFrame({"patient_id": ["a", "b"], "birth_date": ["1990-01-01"] * 2, "death_date": [""] * 2})
    e = pd.DataFrame(events, columns=E_COLUMNS)
    out = _run(p, e, max_seq_len=max_seq_len, keep_first_records=True)
    expected = reference_streams(p, e, out, max_seq_len, 3, first_records=True)
    got = {row.patient_id: np.asarray(row.token_ids).tolist() for row in out.tokens.itertuples(index=False)}
    assert got == {pid: tokens for pid, (tokens, _) in expected.items()}
    thinned = {row.patient_id: row.n_thinned_visits for row in out.tokens.itertuples(index=False)}
    assert out.manifest["truncation"]["visits_thinned_to_first_records"] == sum(thinned.values())


def test_reference_helper_sees_a_real_cohort() -> None:
    """The reference is not vacuous: on a plain cohort it produces streams."""
    p = pd.DataFrame({"patient_id": ["a"], "birth_date": ["2000-01-01"], "death_date": [""]})
    e = pd.DataFrame(
        {
            "patient_id": ["a", "a"],
            "date": ["2010-01-01", "2011-01-01"],
            "code": ["I10", "E11"],
            "visit_id": ["", ""],
            "code_system": ["", ""],
        }
    )
    out = _run(p, e, split={"train": 1.0, "tuning": 0.0, "held_out": 0.0})
    assert reference_streams(p, e, out, 256, 3)["a"][0] == [S.CLS_ID, 6, S.SEP_ID, 5, S.SEP_ID]
    assert pa.types.is_list(out.table.schema.field(S.TOKEN_IDS).type)
