"""The learner told the progression process's structure (``benchmarks/progression_reach.py``): its filter is the
oracle's, its transitions the generator's, and its fit finds parameters the records like at least as well as the
true ones."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from behrt_rope import schema as S
from benchmarks.progression_reach import (
    TorchChain,
    collect_records,
    fit,
    fitted_catalogue,
    log_likelihood,
    make_batches,
    prior_table,
)
from benchmarks.quality import _structure_reach_table, fitted_structure_reach
from synthetic_data.generator import SynthConfig
from synthetic_data.progression import (
    ProgressionSimulation,
    _transition_tables,
    draw_catalogue,
    progression_oracle,
)
from tests.fixtures_quality import ceiling_metrics, cohort_with_oracle

SMALL = SynthConfig(patients=400, seed=11, process="progression", codes=16)  # 2 pairs, 7 background codes


def test_the_torch_filter_gives_the_oracle_filter_s_log_likelihood():
    """Month by month in groups of one sex and age, with several batches, the torch filter sums to the same
    log-likelihood as the oracle's filter visit by visit (true parameters)."""
    rec = collect_records(SMALL)
    cat = draw_catalogue(SMALL)
    sim = ProgressionSimulation(SMALL, np.random.default_rng(SMALL.seed), cat, track_posterior=True)
    sim.run_visits()
    assert sim.belief is not None
    transitions = torch.as_tensor(cat.transitions)
    prior = prior_table(transitions, int(rec.age_month0.max()) + rec.months + 1)
    batches = make_batches(rec, np.arange(SMALL.patients), slots_per_batch=60)
    assert len(batches) > 3
    total = sum(float(log_likelihood(transitions, prior, torch.as_tensor(cat.emission), b)) for b in batches)
    assert total == pytest.approx(sim.belief.log_likelihood.sum(), rel=1e-10)
    some = np.arange(0, SMALL.patients, 3)
    part = sum(
        float(log_likelihood(transitions, prior, torch.as_tensor(cat.emission), b)) for b in make_batches(rec, some)
    )
    assert part == pytest.approx(sim.belief.log_likelihood[some].sum(), rel=1e-10)


def test_the_torch_transitions_are_the_generator_s():
    chain = TorchChain(3)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        for p, (mean, sd) in zip(chain.parameters(), ((-1.5, 0.6), (0.5, 0.4), (0.0, 0.3), (1.5, 0.4), (-2.0, 1.0))):
            p.copy_(mean + sd * torch.randn(p.shape, generator=generator, dtype=p.dtype))
    rates, coupling = chain.rates()
    np.testing.assert_allclose(chain.transitions().detach().numpy(), _transition_tables(rates, coupling), atol=1e-12)


def test_a_believed_catalogue_changes_the_predictions_and_nothing_else():
    """The oracle table under a catalogue of its own: the truth gives the oracle exactly; another catalogue gives
    other chances at the same cuts of the same records."""
    truth = progression_oracle(SMALL)
    pd.testing.assert_frame_equal(progression_oracle(SMALL, believed=draw_catalogue(SMALL)), truth)
    other = progression_oracle(SMALL, believed=draw_catalogue(SynthConfig(seed=12, process="progression", codes=16)))
    key = [S.PATIENT_ID, S.PREDICTION_TIME]
    pd.testing.assert_frame_equal(
        other[key].drop_duplicates(ignore_index=True), truth[key].drop_duplicates(ignore_index=True)
    )
    assert not np.allclose(other[S.PROBABILITY].to_numpy(), truth[S.PROBABILITY].to_numpy())


def test_the_fit_likes_the_records_at_least_as_well_as_the_truth():
    """Maximum likelihood on 1,500 patients (a short window, ages up to 40: a quick fit) from the middle of the
    generator's ranges: the records' likelihood rises to at least the true parameters' (in sample), and the
    catalogue it gives holds chances."""
    cfg = SynthConfig(patients=1500, seed=13, process="progression", codes=16, start="2015-01-01", max_age=40)
    rec = collect_records(cfg)
    everyone = np.arange(cfg.patients)
    chain, figures = fit(rec, everyone, max_iter=40, log=False)
    sim = ProgressionSimulation(cfg, np.random.default_rng(cfg.seed), draw_catalogue(cfg), track_posterior=True)
    sim.run_visits()
    assert sim.belief is not None
    true_nll = -sim.belief.log_likelihood.sum() / len(rec.patient)
    assert figures["end_nll_per_visit"] < figures["start_nll_per_visit"] - 0.01
    assert figures["end_nll_per_visit"] <= true_nll + 1e-3, (figures, true_nll)
    cat = fitted_catalogue(chain, rec, everyone, draw_catalogue(cfg).codes)
    assert cat.transitions.shape == draw_catalogue(cfg).transitions.shape
    np.testing.assert_allclose(cat.transitions.sum(axis=-1), 1.0, atol=1e-9)
    assert ((cat.emission > 0) & (cat.emission < 1)).all() and ((cat.background > 0) & (cat.background < 1)).all()


def test_quality_reach_scores_the_fitted_structure_over_the_model_s_labels(tmp_path):
    cohort, etl = cohort_with_oracle(tmp_path, 400, 11, "synth.process=progression", "synth.codes=16")
    codes = sorted(pd.read_parquet(cohort / S.ORACLE_FILE)[S.CODE].unique())
    labels = [c.replace(".", "") for c in codes[:8]]
    low, high = 0.1, 0.5
    metrics = ceiling_metrics(low, high)
    reach = fitted_structure_reach(cohort, etl, metrics, labels, max_iter=5)
    assert set(reach) == {"fitted_structure", "oracle_as_scored_here", "fit", "cpu_s"}
    for entry in (reach["fitted_structure"], reach["oracle_as_scored_here"]):
        assert 1 <= entry["codes"] <= 8
        assert entry["gap_closed"] == pytest.approx((entry["macro_ap"] - low) / (high - low), abs=1e-3)
    assert reach["fit"]["end_nll_per_visit"] < reach["fit"]["start_nll_per_visit"]


def test_the_structure_reach_table_reads_the_model_s_share_of_the_fit_s_gap():
    cohort = {
        "at_oracle_cuts": {"model": {"gap_closed": {"point": 0.6}}},
        "reach": {"fitted_structure": {"gap_closed": 0.75}},
    }
    assert "| progression | 60% | 75% | 80% |" in _structure_reach_table({"progression": cohort}).splitlines()
