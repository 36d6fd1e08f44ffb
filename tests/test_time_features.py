"""Time features of histories and the gradient-boosted reference built on them."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from sklearn.metrics import average_precision_score

from behrt_rope import schema as S
from behrt_rope.data.labels import Samples, TaskConfig, build_samples, label_index, targets
from behrt_rope.data.sequences import load_tokens, load_vocabulary
from behrt_rope.etl.config import EtlConfig, SplitConfig
from behrt_rope.etl.runner import run_etl
from behrt_rope.evaluation.baseline import fit_predict_gbm
from behrt_rope.evaluation.time_features import PER_CODE, PER_SAMPLE, time_features
from tests.conftest import write_visits

# One patient born 1980-01-01. Days after the first visit: 0, 30, 100, 250.
VISITS = [
    ("2020-01-01", ["A01", "B01"]),
    ("2020-01-31", ["C01"]),
    ("2020-04-10", ["A01", "D01"]),
    ("2020-09-07", ["E01"]),
]


def _etl(tmp_path, patients: list[dict], events: list[dict]):
    raw = write_visits(tmp_path / "raw", patients, events)
    everyone_train = EtlConfig(split=SplitConfig(train=1.0, tuning=0.0, held_out=0.0))
    run_etl(raw, tmp_path / "etl", everyone_train, progress=False)
    return load_tokens(tmp_path / "etl"), load_vocabulary(tmp_path / "etl")["token"].tolist()


def test_time_features_of_a_hand_built_history(tmp_path):
    events = [{S.PATIENT_ID: "p1", S.DATE: d, S.CODE: c} for d, codes in VISITS for c in codes]
    seqs, tokens = _etl(tmp_path, [{S.PATIENT_ID: "p1", S.BIRTH_DATE: "1980-01-01", S.SEX: "F"}], events)
    samples = build_samples(seqs, TaskConfig(name="next_visit"))
    label_of_token = label_index(np.arange(S.N_SPECIAL, len(tokens)), len(tokens))
    features = time_features(seqs, samples, label_of_token)
    assert features.per_code.shape == (3, len(tokens) - S.N_SPECIAL, len(PER_CODE))

    def code(name: str, sample: int) -> dict[str, float]:
        return dict(zip(PER_CODE, features.per_code[sample, tokens.index(name) - S.N_SPECIAL].tolist()))

    # after the third visit (day 100): A01 at visits 0 and 2, C01 at visit 1, E01 not yet
    a = code("A01", 2)
    assert a["ever"] == 1 and a["n_visits"] == 2 and a["visits_since"] == 0 and a["days_since"] == 0
    assert a["years_since_first"] == pytest.approx(100 / 365.25) and a["in_last"] == 1
    c = code("C01", 2)
    assert (c["ever"], c["n_visits"], c["visits_since"], c["days_since"], c["in_last"]) == (1, 1, 1, 70, 0)
    e = code("E01", 2)
    assert e["ever"] == 0 and e["n_visits"] == 0 and e["in_last"] == 0
    assert np.isnan([e["visits_since"], e["days_since"], e["years_since_first"]]).all()
    # nothing from the future: at the first sample (day 0) C01 is unknown
    assert code("C01", 0)["ever"] == 0
    per_sample = dict(zip(PER_SAMPLE, features.per_sample[2].tolist()))
    assert per_sample["n_visits_total"] == 3 and per_sample["days_since_previous_visit"] == 70
    assert per_sample["sex"] == S.SEX_VALUES.index("female")
    assert per_sample["age"] == pytest.approx((pd.Timestamp("2020-04-10") - pd.Timestamp("1980-01-01")).days / 365.25)
    assert np.isnan(features.per_sample[0, 2])  # no previous visit
    # the model matrix of one label: its own six features, every label's "ever", the per-sample four
    j = tokens.index("C01") - S.N_SPECIAL
    matrix = features.for_label(j)
    assert matrix.shape == (3, 6 + features.per_code.shape[1] + len(PER_SAMPLE))
    assert features.names_for_label(j, tokens[S.N_SPECIAL :])[:2] == ["C01:ever", "C01:n_visits"]


def _recency_cohort(n_patients: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Code X is recorded at the next visit with probability 0.7 if, at the current visit, it was last
    recorded at most 90 days ago, else 0.03; how often X was recorded before does not matter. Gaps between
    visits: 5 to 300 days."""
    rng = np.random.default_rng(seed)
    patients, events = [], []
    for p in range(n_patients):
        pid = f"p{p:04d}"
        patients.append({S.PATIENT_ID: pid, S.BIRTH_DATE: "1960-01-01"})
        day, last_x, x = 0, -(10**6), rng.random() < 0.2
        for _ in range(12):
            last_x = day if x else last_x
            codes = ["X"] * x + [f"N{rng.integers(5)}"]
            date = (pd.Timestamp("2015-01-01") + pd.Timedelta(days=int(day))).date().isoformat()
            events += [{S.PATIENT_ID: pid, S.DATE: date, S.CODE: c} for c in codes]
            x = rng.random() < (0.7 if day - last_x <= 90 else 0.03)  # decided now, recorded at the next visit
            day += int(rng.integers(5, 300))
    return patients, events


def test_gradient_boosting_finds_recency_that_counts_miss(tmp_path):
    seqs, tokens = _etl(tmp_path, *_recency_cohort(400, seed=3))
    samples = build_samples(seqs, TaskConfig(name="next_visit"))
    label_of_token = label_index(np.array([tokens.index("X")]), len(tokens))
    y = targets(seqs, samples, label_of_token)
    train = samples.rows < 300  # patients 0-299 train, the rest evaluate

    def pick(mask: np.ndarray) -> Samples:
        return Samples(samples.rows[mask], samples.cuts[mask], samples.label_spans[mask], samples.times[mask])

    features_train = time_features(seqs, pick(train), label_of_token)
    features_eval = time_features(seqs, pick(~train), label_of_token)
    probs = fit_predict_gbm(features_train, y[train], features_eval, seed=0)
    assert probs.shape == (int((~train).sum()), 1) and ((probs >= 0) & (probs <= 1)).all()
    ap = average_precision_score(y[~train, 0], probs[:, 0])
    chance = y[~train, 0].mean()
    assert ap > chance + 0.3, (ap, chance)
    # the number of earlier X visits alone (what a bag of codes sees) ranks far worse
    counts = features_eval.per_code[:, 0, PER_CODE.index("n_visits")]
    assert ap > average_precision_score(y[~train, 0], counts) + 0.1
