"""The record oracle: next-visit probabilities given only the recorded history (``synthetic_data/record_oracle.py``)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from behrt_rope.schema import CODE, PATIENT_ID, PREDICTION_TIME, PROBABILITY
from synthetic_data.generator import CONDITIONS, SynthConfig, _Catalogue, catalogue_codes, generate
from synthetic_data.oracle import ORACLE_SEED_OFFSET, _choose_cuts, cut_times, oracle_table, simulate_cohort
from synthetic_data.record_oracle import _Record, _Walk, record_oracle_table

CFG = SynthConfig(patients=500, seed=21)
PARTICLES = 200


@pytest.fixture(scope="module")
def both():
    return record_oracle_table(CFG, particles=PARTICLES, replicas=100), oracle_table(CFG, replicas=100)


def test_same_cuts_as_the_state_oracle_and_valid_probabilities(both):
    record, state = both
    table = record.table
    assert list(table.columns) == [PATIENT_ID, PREDICTION_TIME, CODE, PROBABILITY]
    pd.testing.assert_frame_equal(cut_times(table), cut_times(state))
    assert table[PROBABILITY].between(0.0, 1.0).all() and set(table[CODE]) <= set(catalogue_codes())
    assert len(record.ess) == table[PATIENT_ID].nunique()
    assert ((record.ess >= 1.0 - 1e-9) & (record.ess <= PARTICLES + 1e-9)).all()
    assert np.median(record.ess) > PARTICLES / 10, "the steered proposal keeps most copies useful"


def test_expected_counts_match_the_next_visits(both):
    """The record oracle is the true posterior predictive: summed over cuts, its probability of each group of
    codes is the expected count at the real next visits (within Poisson-binomial noise and Monte Carlo)."""
    record, _ = both
    _, events = generate(CFG)
    events = events.assign(date=pd.to_datetime(events["date"]))
    visits = events[[PATIENT_ID, "date"]].drop_duplicates().sort_values([PATIENT_ID, "date"])
    visits["next"] = visits.groupby(PATIENT_ID)["date"].shift(-1)
    cuts = cut_times(record.table).merge(visits, left_on=[PATIENT_ID, PREDICTION_TIME], right_on=[PATIENT_ID, "date"])
    following = cuts[[PATIENT_ID, "next"]].merge(events, left_on=[PATIENT_ID, "next"], right_on=[PATIENT_ID, "date"])
    observed = following[[PATIENT_ID, CODE]].drop_duplicates().groupby(CODE).size()
    table = record.table
    expected = table.groupby(CODE)[PROBABILITY].sum()
    variance = (table[PROBABILITY] * (1 - table[PROBABILITY])).groupby(table[CODE]).sum()
    chronic = {c.code for c in CONDITIONS} | {c.followup for c in CONDITIONS if c.followup}
    for group in (sorted(chronic & set(expected.index)), sorted(set(expected.index) - chronic)):
        seen, mean = observed.reindex(group, fill_value=0).sum(), expected[group].sum()
        assert abs(seen - mean) < 4 * np.sqrt(variance[group].sum()) + 0.03 * mean, (seen, mean)


def test_copies_that_keep_weight_hold_every_condition_the_record_shows():
    """A recorded diagnosis or repeat code means the condition is present: any copy without it at the cut
    must have zero weight, whatever its proposal gave it."""
    sim = simulate_cohort(CFG)
    cuts = _choose_cuts(CFG, np.random.default_rng(CFG.seed + ORACLE_SEED_OFFSET), sim)
    record = _Record.of(sim, cuts)
    patients = np.flatnonzero(cuts >= 0)[:40]
    walk = _Walk(CFG, record, patients, 100, np.random.default_rng(3))
    walk.run()
    cat = _Catalogue()
    alive = np.isfinite(walk.log_w) & (walk.log_w > walk.log_w.max() - 700)
    shown_any = False
    for row, p in enumerate(patients):
        codes = np.concatenate(record.codes[p])
        shown = np.isin(cat.dx, codes) | np.isin(cat.followup, codes)
        shown_any |= shown.any()
        mine = (walk.owner == row) & alive
        present = ~np.isnan(walk.sim.onset[mine])
        assert present[:, shown].all(), f"patient {p}: a kept copy lacks a recorded condition"
    assert shown_any


def test_only_the_clinical_process_needs_it():
    with pytest.raises(ValueError, match="recurrence oracle already"):
        record_oracle_table(SynthConfig(patients=20, process="recurrence"))
