"""Fine-tuning samples and labels on small hand-built histories: windows, follow-up, leakage, splits."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from behrt_rope import schema as S
from behrt_rope.data.labels import TaskConfig, build_samples, fit_label_vocabulary, history, label_index, targets
from behrt_rope.data.sequences import load_tokens, load_vocabulary
from behrt_rope.etl.config import EtlConfig, SplitConfig
from behrt_rope.etl.runner import run_etl
from tests.conftest import write_visits

# One patient, five visits. Days after the first visit: 0, 30, 100, 250, 500.
VISITS = [
    ("2020-01-01", ["A01", "B01"]),
    ("2020-01-31", ["C01"]),
    ("2020-04-10", ["A01", "D01"]),
    ("2020-09-07", ["E01"]),
    ("2021-05-15", ["F01"]),
]


def _etl(tmp_path, visits=VISITS, patients=("p1",), death=None):
    events = [{S.PATIENT_ID: p, S.DATE: d, S.CODE: c} for p in patients for d, codes in visits for c in codes]
    rows = [{S.PATIENT_ID: p, S.BIRTH_DATE: "1980-01-01", S.DEATH_DATE: death or ""} for p in patients]
    raw = write_visits(tmp_path / "raw", rows, events)
    everyone_train = EtlConfig(split=SplitConfig(train=1.0, tuning=0.0, held_out=0.0))
    run_etl(raw, tmp_path / "etl", everyone_train, progress=False)
    seqs, vocab = load_tokens(tmp_path / "etl"), load_vocabulary(tmp_path / "etl")
    return seqs, vocab["token"].tolist()


def _label_codes(seqs, samples, tokens):
    index = label_index(np.arange(S.N_SPECIAL, len(tokens)), len(tokens))
    y = targets(seqs, samples, index)
    return [sorted(tokens[S.N_SPECIAL + j] for j in np.flatnonzero(row)) for row in y]


def _input_codes(seqs, samples, tokens):
    out = []
    for row, cut in zip(samples.rows, samples.cuts):
        ids = seqs.token_ids[seqs.offsets[row] : seqs.offsets[row] + cut]
        out.append(sorted(tokens[i] for i in ids if i >= S.N_SPECIAL))
    return out


def test_next_visit_labels_are_the_following_visit_and_inputs_stop_at_the_prediction_time(tmp_path):
    seqs, tokens = _etl(tmp_path)
    samples = build_samples(seqs, TaskConfig(name="next_visit"))
    assert _label_codes(seqs, samples, tokens) == [["C01"], ["A01", "D01"], ["E01"], ["F01"]]
    assert _input_codes(seqs, samples, tokens) == [
        ["A01", "B01"],
        ["A01", "B01", "C01"],
        ["A01", "A01", "B01", "C01", "D01"],
        ["A01", "A01", "B01", "C01", "D01", "E01"],
    ]
    # every input ends with the [SEP] of the prediction visit: nothing later leaks in
    ends = seqs.token_ids[seqs.offsets[samples.rows] + samples.cuts - 1]
    assert (ends == S.SEP_ID).all()
    assert [str(t) for t in samples.times] == ["2020-01-01", "2020-01-31", "2020-04-10", "2020-09-07"]


def test_six_month_window_and_follow_up_rule(tmp_path):
    seqs, tokens = _etl(tmp_path)
    samples = build_samples(seqs, TaskConfig(name="6m"))
    # last event on day 500: samples need 183 days of follow-up, so visits at day 0, 30, 100, 250 qualify
    # (500 - 250 = 250 >= 183); window (t, t + 183]
    assert [str(t) for t in samples.times] == ["2020-01-01", "2020-01-31", "2020-04-10", "2020-09-07"]
    assert _label_codes(seqs, samples, tokens) == [["A01", "C01", "D01"], ["A01", "D01"], ["E01"], []]


def test_twelve_month_window_drops_samples_without_full_follow_up(tmp_path):
    seqs, tokens = _etl(tmp_path)
    samples = build_samples(seqs, TaskConfig(name="12m"))
    # 500 - 250 = 250 < 365: the day-250 sample has no label and is dropped, not counted as negative
    assert [str(t) for t in samples.times] == ["2020-01-01", "2020-01-31", "2020-04-10"]
    assert _label_codes(seqs, samples, tokens) == [
        ["A01", "C01", "D01", "E01"],
        ["A01", "D01", "E01"],
        ["E01"],
    ]  # F01 is 400 days after day 100: outside


def test_min_history_visits_and_random_visit_sampling(tmp_path):
    seqs, _ = _etl(tmp_path, patients=("p1", "p2", "p3"))
    assert len(build_samples(seqs, TaskConfig(min_history_visits=3))) == 3 * 2
    one = build_samples(seqs, TaskConfig(sampling="random_visit", seed=1))
    assert sorted(one.rows.tolist()) == [0, 1, 2]
    again = build_samples(seqs, TaskConfig(sampling="random_visit", seed=1))
    assert (one.cuts == again.cuts).all()


def test_history_marks_codes_already_in_the_input(tmp_path):
    seqs, tokens = _etl(tmp_path)
    samples = build_samples(seqs, TaskConfig(name="next_visit"))
    index = label_index(np.arange(S.N_SPECIAL, len(tokens)), len(tokens))
    seen = history(seqs, samples, index)
    a01 = tokens.index("A01") - S.N_SPECIAL
    # A01 recurs at visit 3: a repeat, not a new onset, for the sample at visit 2
    assert seen[1, a01] and targets(seqs, samples, index)[1, a01]


def test_label_vocabulary_uses_min_count_over_train_samples(tmp_path):
    seqs, tokens = _etl(tmp_path, patients=("p1", "p2"))
    samples = build_samples(seqs, TaskConfig(name="next_visit"))
    # each label code occurs in one sample per patient: twice in all (a code repeated inside one label set
    # counts once per sample)
    assert len(fit_label_vocabulary(seqs, samples, min_count=3)) == 0
    ids = fit_label_vocabulary(seqs, samples, min_count=2)
    assert sorted(tokens[i] for i in ids) == ["A01", "C01", "D01", "E01", "F01"]


def test_samples_never_mix_splits(tmp_path):
    ids = [f"p{i}" for i in range(60)]
    seqs, _ = _etl(tmp_path, patients=ids)
    frame = pd.DataFrame({"split": ["train"] * 20 + ["tuning"] * 20 + ["held_out"] * 20})
    seqs.patients[S.SPLIT] = frame["split"].to_numpy()
    for name in S.SPLITS:
        part = seqs.split(name)
        samples = build_samples(part, TaskConfig())
        assert set(part.patients[S.SPLIT].iloc[samples.rows]) == {name}


@pytest.mark.parametrize("bad", [{"min_history_visits": 0}, {"min_label_count": 0}])
def test_task_config_validation(bad):
    with pytest.raises(ValueError):
        TaskConfig(**bad)


def test_one_cut_reference_samples_one_visit_per_patient_and_reads_presence_age_visits(tmp_path):
    """The classic logistic-regression reference of ``evaluate``: one seeded random cut per patient whatever
    the task's sampling, and 0/1 code presence (not counts) with age, sex and log(1 + visits so far)."""
    from pipelines.evaluate import _presence, one_cut_samples

    seqs, tokens = _etl(tmp_path, patients=("p1", "p2", "p3"))
    every = build_samples(seqs, TaskConfig())
    one = one_cut_samples(seqs, TaskConfig(), seed=0)
    assert len(every) == 12 and len(one) == 3 and sorted(one.rows.tolist()) == [0, 1, 2]
    assert set(zip(one.rows.tolist(), one.cuts.tolist())) <= set(zip(every.rows.tolist(), every.cuts.tolist()))
    assert np.array_equal(one_cut_samples(seqs, TaskConfig(), seed=0).cuts, one.cuts)  # seeded
    matrix, dense = _presence(seqs, every, len(tokens))
    a01 = tokens.index("A01")
    third = int(np.flatnonzero((every.rows == 0) & (every.cuts == every.cuts[every.rows == 0].max()))[0])
    assert matrix[third, a01] == 1.0  # A01 twice in the history: presence, not a count
    assert dense.shape == (12, 6)
    visits = np.sort(np.unique(np.expm1(dense[:, -1]).round(6)))
    assert visits.tolist() == [1.0, 2.0, 3.0, 4.0]  # cuts after visits 1 to 4 of 5


def test_seeded_subsample_is_sorted_reproducible_and_take_keeps_fields_aligned():
    from behrt_rope.data.labels import Samples, subsample_index

    first, again = subsample_index(1000, 50, seed=7), subsample_index(1000, 50, seed=7)
    assert np.array_equal(first, again) and len(np.unique(first)) == 50 and np.all(np.diff(first) > 0)
    assert not np.array_equal(first, subsample_index(1000, 50, seed=8))
    n = 6
    samples = Samples(np.arange(n), np.arange(n) * 10, np.stack([np.arange(n), np.arange(n) + 1], 1), np.arange(n))
    taken = samples.take(np.array([4, 1]))
    assert taken.rows.tolist() == [4, 1] and taken.cuts.tolist() == [40, 10]
    assert taken.label_spans.tolist() == [[4, 5], [1, 2]] and taken.times.tolist() == [4, 1]
