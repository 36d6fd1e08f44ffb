"""The progression process (``synthetic_data/progression.py``): hidden stages, and an oracle that is the exact
posterior of the stages given the record."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import average_precision_score

from behrt_rope.schema import CODE, PATIENT_ID
from synthetic_data.generator import SynthConfig, generate
from synthetic_data.progression import (
    JOINT,
    ROUTINE,
    STAGES,
    ProgressionSimulation,
    StageFilter,
    draw_catalogue,
)


def _run_with_filter(cfg: SynthConfig, at_visit: int):
    """Run ``cfg``'s cohort with the stage filter; just before round ``at_visit``, predict its visits from the
    record (the filter) and from no record (the chain's law at the same age). Returns both and the codes the
    round recorded, each ``(patients, codes)``."""
    sim = ProgressionSimulation(cfg, np.random.default_rng(cfg.seed), draw_catalogue(cfg))
    belief, blind = StageFilter(sim), StageFilter(sim)
    out: dict[str, np.ndarray] = {}

    def before(idx: np.ndarray, day: np.ndarray) -> None:
        if idx.size and (sim.visits[idx] == at_visit).all():  # the round of visit number at_visit
            blind.law[idx], blind.step[idx] = sim.chain.prior(idx, belief.step[idx]), belief.step[idx]
            out["informed"], out["blind"] = belief.next_visit_probabilities(idx), blind.next_visit_probabilities(idx)

    def after(idx: np.ndarray, day: np.ndarray, hits: np.ndarray, visit: int) -> None:
        if visit == at_visit:
            out["hits"] = hits
        belief.observe(idx, day, hits, visit)

    sim.run_visits(before_visit=before, after_visit=after)
    return out["informed"], out["blind"], out["hits"], sim


@pytest.fixture(scope="module")
def fourth_visits():
    return _run_with_filter(SynthConfig(patients=6000, seed=21, process="progression"), at_visit=3)


def test_the_filter_is_calibrated_against_the_visits_that_follow(fourth_visits):
    """Exact probabilities: within each tenth of the predicted chances, the share of codes recorded matches the
    mean chance to within binomial noise (a filter that forgot a month's transition, a likelihood or the age
    would drift away from it in some band)."""
    informed, _, hits, sim = fourth_visits
    p, y = informed.ravel(), hits.ravel()
    assert np.all((p >= 0) & (p <= 1))
    edges = np.quantile(p, np.linspace(0, 1, 11))
    band = np.clip(np.searchsorted(edges, p, side="right") - 1, 0, 9)
    for b in range(10):
        chosen = band == b
        mean, rate, n = p[chosen].mean(), y[chosen].mean(), chosen.sum()
        z = (rate - mean) / np.sqrt(mean * (1 - mean) / n)
        assert abs(z) < 4.5, (b, mean, rate, n)
    routine = sim.cat.routine
    np.testing.assert_allclose(informed.sum(axis=0)[routine], hits.sum(axis=0)[routine], rtol=0.1)


def test_the_record_sharpens_the_prediction(fourth_visits):
    """The posterior given three visits ranks the fourth visit's codes far better than the chain's law at the
    same age, which knows no record."""
    informed, blind, hits, sim = fourth_visits
    pair_codes = [c for c in range(sim.cat.pairs * 4) if hits[:, c].any()]
    ap = [np.mean([average_precision_score(hits[:, c], q[:, c]) for c in pair_codes]) for q in (informed, blind)]
    assert ap[0] > ap[1] + 0.1, ap


def test_the_stages_follow_the_chain_and_emission_rates():
    """The simulated stages are a Markov chain from stage 0 at birth: their share at the window's start matches
    the chain's law at each patient's age, and no condition once established goes back to none or early."""
    cfg = SynthConfig(patients=4000, seed=22, process="progression")
    sim = ProgressionSimulation(cfg, np.random.default_rng(cfg.seed), draw_catalogue(cfg))
    everyone = np.arange(cfg.patients)
    law = sim.chain.prior(everyone, sim.age_month0)  # (n, P, 16)
    observed = np.eye(JOINT)[sim.stages[:, :, 0]]  # (n, P, 16)
    np.testing.assert_allclose(observed.mean(axis=0), law.mean(axis=0), atol=0.02)
    for stage in np.divmod(sim.stages.astype(int), STAGES):  # parent, child
        moves = set(zip(stage[:, :, :-1].ravel().tolist(), stage[:, :, 1:].ravel().tolist()))
        assert not moves & {(2, 0), (2, 1), (3, 0), (3, 1)}, "once established, a condition never goes back"
        assert {(0, 1), (1, 0), (1, 2), (2, 3), (3, 2)} <= moves
    assert (sim.stages[sim.birth > sim.start - 365 * 2, :, 0] == 0).mean() > 0.9  # toddlers start mostly healthy


def test_a_cohort_has_plausible_histories_and_a_catalogue_drawn_per_seed():
    cfg = SynthConfig(patients=800, seed=23, process="progression")
    patients, events = generate(cfg)
    per_visit = events.groupby("visit_id").size()
    assert 1.5 < per_visit.mean() < 6 and 10 < len(events) / len(patients) < 60
    assert events[CODE].isin(draw_catalogue(cfg).codes).all()
    assert (events.loc[events[CODE] == ROUTINE, "visit_id"].map(per_visit) == 1).all(), "Z00.0 only alone"
    other = draw_catalogue(SynthConfig(seed=24, process="progression"))
    assert len(set(other.codes) & set(draw_catalogue(cfg).codes)) < 10
    assert events[PATIENT_ID].nunique() > 0.9 * cfg.patients


@pytest.mark.parametrize("codes", [8, 64, 300])
def test_codes_sets_the_catalogue_size(codes):
    catalogue = draw_catalogue(SynthConfig(seed=1, process="progression", codes=codes))
    assert len(catalogue.codes) == len(set(catalogue.codes)) == codes and catalogue.codes[-1] == ROUTINE
    assert len(catalogue.background) == codes - 1 - 4 * catalogue.pairs >= 3
