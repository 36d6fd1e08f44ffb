"""Visits round by round, and the exact next-visit oracle of a process whose state the simulation can read.

The recurrence and progression processes simulate every patient's visits one round at a time (round ``k`` is
every still-observed patient's ``k``-th visit) and can say, from the state after a visit, the chance of each
code at the next one. :class:`VisitRounds` is that loop; :func:`cut_oracle_table` draws one cut per patient
and asks the simulation for those chances at it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np
import pandas as pd
from scipy import stats

from behrt_rope.schema import CODE, PATIENT_ID, PREDICTION_TIME, PROBABILITY
from synthetic_data.generator import (
    DAYS_PER_YEAR,
    GAP_SHAPE,
    RATE_SHAPE,
    SynthConfig,
    _EventLog,
    _parse_day,
    history_tables,
    patient_ids,
)
from synthetic_data.oracle import ORACLE_SEED_OFFSET

BeforeVisit = Callable[[np.ndarray, np.ndarray], None]
"""``(idx, day)``: the patients of a round and the days of their visits, before the visits are recorded."""
AfterVisit = Callable[[np.ndarray, np.ndarray, np.ndarray, int], None]
"""``(idx, day, hits, visit)``: the same, the ``(patients, codes)`` codes recorded and the round's number."""


class VisitRounds:
    """A cohort visited round by round: :meth:`start_cohort` draws the patients and sets the round state; a
    subclass provides ``next_gap(idx, first)``, ``visit(idx, day, visit) -> hits`` (which logs the codes in
    ``log`` and moves ``visits`` and ``t_prev`` on) and ``codes``, the names of its code indices."""

    codes: np.ndarray

    def start_cohort(self, cfg: SynthConfig, rng: np.random.Generator) -> None:
        """Draw each patient's birth day (aged 0 to ``cfg.max_age`` at the window's start), sex and visit-rate
        multiplier (Gamma, mean 1), in that order from ``rng``; no visits yet."""
        n = cfg.patients
        self.cfg, self.rng = cfg, rng
        self.start, self.end = _parse_day(cfg.start, "start"), _parse_day(cfg.end, "end")
        self.birth = self.start - np.ceil(rng.uniform(0.0, cfg.max_age, n) * DAYS_PER_YEAR).astype(np.int64)
        self.female = rng.random(n) < 0.51
        self.rate = cfg.visit_rate * rng.gamma(RATE_SHAPE, 1.0 / RATE_SHAPE, n)
        self.visits = np.zeros(n, dtype=np.int64)  # visits so far
        self.t_prev = np.full(n, self.start, dtype=np.int64)  # day of the last visit (the window's start before any)
        self.active = np.ones(n, dtype=bool)  # still visiting
        self.log = _EventLog()

    def next_gap(self, idx: np.ndarray, first: bool) -> np.ndarray:
        raise NotImplementedError

    def visit(self, idx: np.ndarray, day: np.ndarray, visit: int) -> np.ndarray:
        raise NotImplementedError

    def run_visits(self, before_visit: BeforeVisit | None = None, after_visit: AfterVisit | None = None) -> None:
        """Visit every patient until the window ends or ``cfg.max_visits``; ``before_visit`` sees each round
        just before its visits are recorded (an oracle reads the state there), ``after_visit`` what they
        recorded."""
        for visit in range(self.cfg.max_visits):
            idx = np.flatnonzero(self.active)
            if idx.size == 0:
                break
            day = self.t_prev[idx] + self.next_gap(idx, first=visit == 0)
            inside = day <= self.end
            self.active[idx[~inside]] = False
            idx, day = idx[inside], day[inside]
            if before_visit is not None:
                before_visit(idx, day)
            hits = self.visit(idx, day, visit)
            if after_visit is not None:
                after_visit(idx, day, hits, visit)

    def tables(self) -> tuple[pd.DataFrame, pd.DataFrame]:
        """The visits-format tables of the cohort (no deaths in these processes)."""
        alive = np.full(self.cfg.patients, -1, dtype=np.int64)
        return history_tables(self.cfg, self.birth, self.female, alive, self.log, self.codes)


def gamma_gap_nodes(mean: np.ndarray, limit: np.ndarray, nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """Gaps at the ``nodes`` mid-quantiles of a Gamma (shape ``GAP_SHAPE``) gap of mean ``mean`` ``(m,)`` days
    truncated to at most ``limit`` ``(m,)`` days, ``(m, nodes)``; and ``(m,)`` the Gamma's mass below ``limit``.

    >>> gaps, mass = gamma_gap_nodes(np.array([365.0]), np.array([1e9]), 4)
    >>> bool(np.all(np.diff(gaps[0]) > 0)), round(float(mass[0]), 3)
    (True, 1.0)
    """
    mass = stats.gamma.cdf(limit, GAP_SHAPE, scale=mean / GAP_SHAPE)
    share = (np.arange(nodes) + 0.5) / nodes
    return stats.gamma.ppf(share * mass[:, None], GAP_SHAPE, scale=mean[:, None] / GAP_SHAPE), mass


class ExactProcess(Protocol):
    """A simulation that can give each code's chance at the next visit from the state after the last one."""

    visits: np.ndarray
    t_prev: np.ndarray

    def run_visits(self, before_visit: BeforeVisit | None = None, after_visit: AfterVisit | None = None) -> None: ...

    def next_visit_probabilities(self, idx: np.ndarray) -> np.ndarray: ...


def cut_oracle_table(cfg: SynthConfig, simulation: Callable[[], ExactProcess], codes: np.ndarray) -> pd.DataFrame:
    """Next-visit probabilities at one random cut visit per patient with at least two visits, from the state
    right after the cut; the columns of :func:`synthetic_data.oracle.oracle_table`. ``simulation()`` makes the
    cohort's simulation afresh (same seed, same draws), ``codes`` names its code indices.

    The cohort is run once to count each patient's visits, the cuts are drawn from a stream of their own, and
    the cohort is run again, reading the state just before each cut's next visit is recorded."""
    first = simulation()
    first.run_visits()
    rng = np.random.default_rng(cfg.seed + ORACLE_SEED_OFFSET)
    n_visits = first.visits
    cut = np.where(n_visits >= 2, np.floor(rng.random(cfg.patients) * np.maximum(n_visits - 1, 1)), -1)

    sim = simulation()
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def capture(idx: np.ndarray, day: np.ndarray) -> None:
        now = (cut[idx] >= 0) & (sim.visits[idx] == cut[idx] + 1)  # the visit right after the cut
        if now.any():
            parts.append((idx[now], sim.t_prev[idx[now]], sim.next_visit_probabilities(idx[now])))

    sim.run_visits(before_visit=capture)
    patient = np.concatenate([p for p, _, _ in parts])
    cut_day = np.concatenate([d for _, d, _ in parts])
    probs = np.concatenate([q for _, _, q in parts])
    order = np.argsort(patient, kind="stable")
    patient, cut_day, probs = patient[order], cut_day[order], probs[order]
    rows, cols = np.nonzero(probs > 0)
    return pd.DataFrame(
        {
            PATIENT_ID: patient_ids(cfg.patients)[patient[rows]],
            PREDICTION_TIME: pd.to_datetime(cut_day[rows].astype("datetime64[D]")),
            CODE: codes[cols].astype(object),
            PROBABILITY: probs[rows, cols],
        }
    )
