"""The generator's own answer: the true probability of every code at a patient's next visit.

A model's quality means little without a ceiling. For each patient with at least two visits, one visit ``k``
is drawn at random among those followed by another visit (the *cut*), and the simulated state after visit
``k`` (conditions begun and when, last acute episodes, pregnancy, visit rate, age, sex) is copied
``replicas`` times. Each copy then lives through the time to its next visit again, with fresh random draws:
the gap, deaths (with or without a terminal visit), new onsets, pregnancy, recorded codes and noise, exactly
as :class:`synthetic_data.generator._Simulation` does. Copies that die without a visit or reach the end of
the window have no next visit and are dropped, because a real history without a next visit gives no
``next_visit`` sample either. The oracle probability of code ``c`` is the share of the remaining copies
whose next visit records ``c``: the best any predictor can do from the true state (Monte Carlo; its standard
error is at most ``0.5 / sqrt(replicas)``, far less for rare codes).

The true state holds more than the recorded history (onsets not yet recorded, sex, the patient's visit rate),
so the oracle is a ceiling no model of the history can reach exactly; "% of the gap closed" measures how far
from the logistic regression towards it a model gets.

The cut is drawn from a separate random stream, and the state is captured by re-running the simulation with
the cohort's own seed, so asking for the oracle does not change the cohort.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd

from behrt_rope.schema import CODE, PATIENT_ID, PREDICTION_TIME, PROBABILITY
from synthetic_data.generator import SynthConfig, _Catalogue, _Simulation, patient_ids

ORACLE_SEED_OFFSET = 7_919
"""Added to the cohort seed for the cut choice and the Monte Carlo draws (a stream of their own)."""
STATE = ("onset", "last_acute", "t_prev", "had_acute", "due", "last_delivery")
"""Per-patient arrays of ``_Simulation`` that change during the window (the rest is fixed at birth)."""
FIXED = ("birth", "female", "rate")
CHUNK_COPIES = 200_000
"""Copies simulated at once, to bound memory (a copy holds about 60 floats)."""


def oracle_table(cfg: SynthConfig, replicas: int = 500) -> pd.DataFrame:
    """``patient_id``, ``prediction_time`` (the cut visit's date), ``code``, ``probability`` (of the code at
    the next visit), for every patient with a cut and every catalogue code with a non-zero probability.

    Deterministic for ``cfg`` (seed included) and ``replicas``.
    """
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    clean = replace(cfg, corrupt_fraction=0.0)
    if clean.process == "recurrence":  # its state is the recorded history: exact up to a quadrature
        from synthetic_data.recurrence import recurrence_oracle

        return recurrence_oracle(clean)
    if clean.process == "progression":  # the exact posterior of the hidden stages given the record
        from synthetic_data.progression import progression_oracle

        return progression_oracle(clean)
    rng = np.random.default_rng(clean.seed + ORACLE_SEED_OFFSET)
    cuts = _choose_cuts(clean, rng)
    states = _capture_states(clean, cuts)
    counts, totals = _simulate_next_visits(clean, states, replicas, rng)
    return _as_table(clean, states, counts, totals)


def simulate_cohort(cfg: SynthConfig) -> _Simulation:
    """The cohort's simulation run to the end with its own seed (the same draws as ``generate``)."""
    sim = _Simulation(cfg, np.random.default_rng(cfg.seed), _Catalogue())
    sim.burn_in()
    sim.run_visits()
    return sim


def _choose_cuts(cfg: SynthConfig, rng: np.random.Generator, sim: _Simulation | None = None) -> np.ndarray:
    """(patients,) visit number of each patient's cut, uniform over visits with a later visit; -1: none.
    ``sim``: the finished :func:`simulate_cohort`, when the caller has it already."""
    sim = sim if sim is not None else simulate_cohort(cfg)
    patient, visit, _, _ = sim.log.columns()
    n_visits = np.zeros(cfg.patients, dtype=np.int64)
    np.maximum.at(n_visits, patient, visit + 1)
    draw = np.floor(rng.random(cfg.patients) * np.maximum(n_visits - 1, 1)).astype(np.int64)
    return np.where(n_visits >= 2, draw, -1)


def _capture_states(cfg: SynthConfig, cuts: np.ndarray) -> dict[str, np.ndarray]:
    """The state of each patient with a cut, right after the cut visit (patients in id order)."""
    sim = _Simulation(cfg, np.random.default_rng(cfg.seed), _Catalogue())
    sim.burn_in()
    who = np.flatnonzero(cuts >= 0)
    states: dict[str, np.ndarray] = {"patient": who}
    for name in STATE + FIXED:
        value = getattr(sim, name)
        states[name] = np.empty((len(who), *value.shape[1:]), dtype=value.dtype)
    position = np.full(cfg.patients, -1, dtype=np.int64)
    position[who] = np.arange(len(who))

    def snapshot(visit: int, visited: np.ndarray) -> None:
        now = visited[cuts[visited] == visit]
        for name in STATE + FIXED:
            states[name][position[now]] = getattr(sim, name)[now]

    sim.run_visits(after_visit=snapshot)
    return states


def _simulate_next_visits(
    cfg: SynthConfig, states: dict[str, np.ndarray], replicas: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """(cut patients, codes) number of copies recording each code at the next visit, and (cut patients,)
    number of copies that have a next visit."""
    cat = _Catalogue()
    n = len(states["patient"])
    counts = np.zeros((n, len(cat.codes)), dtype=np.int64)
    totals = np.zeros(n, dtype=np.int64)
    per_chunk = max(1, CHUNK_COPIES // replicas)
    for start in range(0, n, per_chunk):
        rows = np.arange(start, min(n, start + per_chunk))
        source = np.repeat(rows, replicas)  # copy -> cut patient
        sim = _Simulation(replace(cfg, patients=len(source)), rng, cat)
        for name in STATE + FIXED:
            setattr(sim, name, states[name][source].copy())
        copy, code = _one_more_visit(sim)
        visited = np.unique(copy)
        np.add.at(totals, source[visited], 1)
        pairs = np.unique(copy * len(cat.codes) + code)  # a code logged twice in one visit counts once
        np.add.at(counts, (source[pairs // len(cat.codes)], pairs % len(cat.codes)), 1)
    return counts, totals


def _one_more_visit(sim: _Simulation) -> tuple[np.ndarray, np.ndarray]:
    """Advance every copy to its next visit (or death, or the end of the window), as one step of
    ``_Simulation.run_visits``; returns (copy, code index) of every code logged."""
    idx = np.arange(sim.active.size)
    gap = sim.next_gap(idx, first=False)
    idx, gap = sim.deaths(idx, gap, visit=1)
    day = sim.t_prev[idx] + gap
    inside = day <= sim.end
    sim.visit(idx[inside], gap[inside], day[inside], visit=1)
    copy, _, _, code = sim.log.columns()
    return copy, code


def _as_table(cfg: SynthConfig, states: dict[str, np.ndarray], counts: np.ndarray, totals: np.ndarray) -> pd.DataFrame:
    cat = _Catalogue()
    ok = totals > 0  # a cut with no surviving copy (death almost certain) has no defined probability
    rows, cols = np.nonzero(counts[ok])
    patient = states["patient"][ok][rows]
    day = states["t_prev"][ok][rows]
    return pd.DataFrame(
        {
            PATIENT_ID: patient_ids(cfg.patients)[patient],
            PREDICTION_TIME: pd.to_datetime(day.astype("datetime64[D]")),
            CODE: cat.codes[cols].astype(object),
            PROBABILITY: counts[ok][rows, cols] / totals[ok][rows],
        }
    )


def cut_times(oracle: pd.DataFrame) -> pd.DataFrame:
    """The distinct (patient_id, prediction_time) cuts of an oracle table."""
    return oracle[[PATIENT_ID, PREDICTION_TIME]].drop_duplicates().reset_index(drop=True)
