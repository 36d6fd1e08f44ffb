"""The generator's oracle: true next-visit code probabilities at one cut visit per patient, for every process
(clinical: Monte Carlo over the hidden state; recurrence: exact up to a quadrature over the next visit's day;
progression: the exact posterior of the hidden stages, the same quadrature; more in test_progression.py)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from behrt_rope.schema import CODE, DATE, PATIENT_ID, PREDICTION_TIME, PROBABILITY
from synthetic_data.generator import SynthConfig, catalogue_codes, generate
from synthetic_data.oracle import cut_times, oracle_table
from synthetic_data.progression import draw_catalogue as draw_progression_catalogue
from synthetic_data.recurrence import ROUTINE, RecurrenceSimulation, draw_catalogue


@pytest.fixture(scope="module", params=["clinical", "recurrence", "progression"])
def cohort(request):
    cfg = SynthConfig(patients=1500, seed=11, process=request.param)
    return cfg, oracle_table(cfg, replicas=100), generate(cfg)


def _codes(cfg: SynthConfig) -> set[str]:
    if cfg.process == "progression":
        return set(draw_progression_catalogue(cfg).codes)
    return set(catalogue_codes()) if cfg.process == "clinical" else set(draw_catalogue(cfg).codes)


def _next_visit_codes(oracle: pd.DataFrame, events: pd.DataFrame) -> pd.DataFrame:
    """(patient_id, code) of every code recorded at the visit after each cut."""
    events = events.assign(**{DATE: pd.to_datetime(events[DATE])})
    visits = events[[PATIENT_ID, DATE]].drop_duplicates().sort_values([PATIENT_ID, DATE])
    visits["next"] = visits.groupby(PATIENT_ID)[DATE].shift(-1)
    cuts = cut_times(oracle).merge(visits, left_on=[PATIENT_ID, PREDICTION_TIME], right_on=[PATIENT_ID, DATE])
    assert len(cuts) == len(cut_times(oracle)), "every cut is a real visit of its patient"
    assert cuts["next"].notna().all(), "every cut is followed by another visit"
    following = cuts[[PATIENT_ID, "next"]].merge(events, left_on=[PATIENT_ID, "next"], right_on=[PATIENT_ID, DATE])
    return following[[PATIENT_ID, CODE]].drop_duplicates()


def test_oracle_probabilities_are_valid_and_reproducible(cohort):
    cfg, oracle, _ = cohort
    assert list(oracle.columns) == [PATIENT_ID, PREDICTION_TIME, CODE, PROBABILITY]
    assert oracle[PROBABILITY].between(0.0, 1.0).all() and (oracle[PROBABILITY] > 0).all()
    assert set(oracle[CODE]) <= _codes(cfg)
    assert not oracle.duplicated([PATIENT_ID, PREDICTION_TIME, CODE]).any()
    assert oracle.groupby(PATIENT_ID)[PREDICTION_TIME].nunique().max() == 1, "one cut per patient"
    pd.testing.assert_frame_equal(oracle, oracle_table(cfg, replicas=100))


def test_asking_for_the_oracle_leaves_the_cohort_unchanged(cohort):
    cfg, _, (patients, events) = cohort
    again_patients, again_events = generate(cfg)
    pd.testing.assert_frame_equal(events, again_events)
    pd.testing.assert_frame_equal(patients, again_patients)


def test_oracle_agrees_with_empirical_next_visit_frequencies(cohort):
    """Summed over cuts, the oracle's probability of a code is its expected count at the next visits; the
    observed counts must scatter around it by Poisson-binomial noise, and the oracle must rank far better
    than chance."""
    _, oracle, (_, events) = cohort
    observed = _next_visit_codes(oracle, events).groupby(CODE).size()
    expected = oracle.groupby(CODE)[PROBABILITY].sum()
    table = pd.concat([observed.rename("observed"), expected.rename("expected")], axis=1).fillna(0.0)
    table = table[table["expected"] >= 5]
    assert len(table) >= 20
    z = (table["observed"] - table["expected"]) / np.sqrt(table["expected"])
    assert np.abs(z).mean() < 1.5, table.assign(z=z).sort_values("expected").tail(10)
    assert np.abs(z).max() < 5.0
    assert np.corrcoef(table["observed"], table["expected"])[0, 1] > 0.95

    # per (cut, code): the oracle's probability is higher where the code does come next
    truth = _next_visit_codes(oracle, events).assign(hit=1)
    pairs = oracle.merge(truth, on=[PATIENT_ID, CODE], how="left").fillna({"hit": 0})
    assert pairs.loc[pairs["hit"] == 1, PROBABILITY].mean() > 3 * pairs.loc[pairs["hit"] == 0, PROBABILITY].mean()


def test_recurrence_oracle_is_exact_on_a_large_sample():
    """With the exact oracle, observed next-visit counts per code match the summed probabilities to within
    binomial noise on 20,000 cuts (a Monte Carlo oracle would add its own error)."""
    cfg = SynthConfig(patients=20_000, seed=5, process="recurrence")
    oracle, (_, events) = oracle_table(cfg), generate(cfg)
    observed = _next_visit_codes(oracle, events).groupby(CODE).size()
    table = pd.concat([observed.rename("observed"), oracle.groupby(CODE)[PROBABILITY].sum().rename("expected")], axis=1)
    table = table.fillna(0.0)
    table = table[table["expected"] >= 20]
    z = (table["observed"] - table["expected"]) / np.sqrt(table["expected"])
    assert len(table) >= 40 and np.abs(z).max() < 4.5, table.assign(z=z).sort_values("z")
    assert abs(z.mean()) < 0.5
    routine = oracle[oracle[CODE] == ROUTINE]
    assert len(routine) == oracle[PATIENT_ID].nunique(), "the routine code is possible at every next visit"


def test_recurrence_oracle_integrates_over_the_day_of_the_next_visit():
    """The next visit's day is drawn after the cut, so the oracle averages over it: its quadrature must match a
    Monte Carlo of the simulation's own gap draws (kept when they fall inside the window) from the same state,
    on a sparse cohort where gaps of years move the age and duration terms."""
    cfg = SynthConfig(patients=300, seed=8, process="recurrence", start="2015-01-01", visit_rate=0.35)
    sim = RecurrenceSimulation(cfg, np.random.default_rng(cfg.seed), draw_catalogue(cfg))
    sim.run_visits()
    idx = np.flatnonzero(sim.visits >= 1)[:40]  # the state after each patient's last visit
    sim.end += 3 * 365  # room for a next visit after the last one
    quadrature = sim.next_visit_probabilities(idx)

    sim.rng = np.random.default_rng(99)
    draws = 4000
    many = np.repeat(idx, draws)
    day = sim.t_prev[many] + sim.next_gap(many, first=False)
    inside = day <= sim.end
    p = sim.recorded_probabilities(many, day)
    p = np.where(inside[:, None], p, 0.0).reshape(len(idx), draws, -1)
    monte_carlo = p.sum(axis=1) / inside.reshape(len(idx), draws).sum(axis=1, keepdims=True)

    assert np.abs(quadrature - monte_carlo).max() < 0.02
    assert np.abs(quadrature - monte_carlo).mean() < 0.002
    at_mean_day = sim.probabilities(idx, sim.t_prev[idx] + np.rint(sim.mean_gap(idx)).astype(np.int64))
    other = np.arange(p.shape[-1]) != sim.cat.routine
    gap = np.abs(at_mean_day - monte_carlo)[:, other]
    assert gap.max() > 0.05, "the day matters on this cohort, so one fixed day would fail the comparison"


def test_recurrence_catalogue_is_drawn_per_seed():
    one = draw_catalogue(SynthConfig(seed=1, process="recurrence"))
    two = draw_catalogue(SynthConfig(seed=2, process="recurrence"))
    assert len(set(one.codes) & set(two.codes)) < len(one.codes) / 2
    assert not np.allclose(one.base[: len(two.base)], two.base)


def test_a_larger_recurrence_catalogue_splits_the_same_illness_over_rarer_codes():
    """``codes`` sets the catalogue size; each code gets rarer so that histories keep about the same length
    (without the scaling, 300 codes gave about 12 times as many events per patient)."""
    small = SynthConfig(patients=600, seed=4, process="recurrence")
    large = SynthConfig(patients=600, seed=4, process="recurrence", codes=300)
    assert len(draw_catalogue(large).codes) == 300
    per_patient = [len(generate(cfg)[1]) / cfg.patients for cfg in (small, large)]
    assert 0.5 < per_patient[1] / per_patient[0] < 1.5, per_patient
    assert generate(large)[1][CODE].nunique() > 200
    with pytest.raises(ValueError, match="codes must lie in"):
        SynthConfig(process="recurrence", codes=3)
