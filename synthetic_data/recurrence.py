"""A second, structurally different cohort: codes that recur, persist and trigger each other (``process=recurrence``).

The clinical process (``generator.py``) hides much of its state: onsets happen before they are recorded, so
its oracle knows things no history shows. This process is the opposite shape, and so a different test of a
model: every code's chance at a visit is a logistic function of what the *recorded* history shows (plus a
small hidden frailty), and the catalogue itself, codes and parameters, is drawn afresh from each seed, so
no two seeds share a structure a model could be tuned to.

At a visit of a patient aged ``age`` with history ``H`` (the visits before it), code ``c`` is recorded
independently with probability ``sigmoid(z_c)``, where

    z_c = base_c + age_amp_c * bump((age - age_mid_c) / age_width_c) + female * sex_c + frailty * [c chronic]
          + visit_c * log(1 + visits so far) / 3
          + [c recorded before] * (persist_c + duration_c * min(years since c first recorded, 10) / 10
                                   + count_c * log(1 + visits with c)
                                   + recur_c * exp(-(visits since c last recorded - 1) / decay_c))
          + followup_c * [c in the previous visit] * exp(-days between the previous two visits / 30)
          + sum over triggers p -> c of  weight * ramp(years since p first recorded; delay, width)

(``bump(x) = exp(-x^2) - 0.5``). A visit with no code records the routine code ``Z00.0``. Gaps between
visits are Gamma (shape 1.5) with mean 365.25 / rate, rate = ``visit_rate`` x a patient multiplier
(Gamma, mean 1) x (1 + 0.1 x chronic codes recorded so far); after a visit with a recurrent (acute) code,
with probability ``followup_probability`` the gap is 7 + Exponential(14) days instead. Nobody dies.

Kinds of code, drawn per seed: *chronic* (high persistence once recorded, a duration effect of either sign,
trigger targets), *recurrent* (episodes that come back at the next visits and fade within a few visits),
*background* (about ``noise_codes_per_visit`` per visit in all, weak age effects only).

The oracle is exact up to a quadrature: codes at a visit depend only on the state after the previous visit
and on the visit's day (through the age and the years since each code was first recorded). The day is not
part of that state: it is drawn after the cut, from the gap distribution above, given that the visit falls
inside the window (the cut was chosen among visits followed by another). So the true probability of a code
at the visit after a cut is the mean of ``sigmoid(z)`` (for the routine code, of ``p + (1 - p) x P(no other
code)``) over that distribution, taken at ``GAP_NODES`` quantiles of each of its two parts. Until session 19
the oracle read ``z`` at the day the simulation drew, knowledge of the future no prediction at the cut has;
measured, that edge was small (at most 0.0016 macro AP on the benchmark cohorts; docs/benchmarks.md,
"Eighteenth round").

>>> from synthetic_data.generator import SynthConfig
>>> patients, events = generate_recurrence(SynthConfig(patients=20, seed=3, process="recurrence"))
>>> bool(events["code"].str.fullmatch(r"[A-Z][0-9][0-9][.][0-9]").all())
True
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import stats

from synthetic_data.generator import (
    DAYS_PER_YEAR,
    GAP_SHAPE,
    RECURRENCE_CODES,
    SynthConfig,
    _ramp,
)
from synthetic_data.visit_rounds import VisitRounds, cut_oracle_table, gamma_gap_nodes

KIND_SHARES = {"chronic": 0.4, "recurrent": 0.35, "background": 0.25}
ROUTINE = "Z00.0"
CATALOGUE_SEED_OFFSET = 104_729
FRAILTY_SD = 0.3
CHRONIC_VISIT_BOOST = 0.1
FOLLOWUP_MIN_DAYS, FOLLOWUP_MEAN_DAYS = 7.0, 14.0
GAP_NODES = 64
"""Quantile nodes per part of the next-gap distribution (routine, follow-up) in the oracle's integral."""
ORACLE_CHUNK_NODES = 1_000_000
"""(patient, node) pairs whose probabilities the oracle computes at once, to bound memory."""
MAX_TRIGGERS = 2


@dataclass(frozen=True)
class RecurrenceCatalogue:
    """One seed's codes and their parameters; arrays of shape (codes,) unless named otherwise."""

    codes: np.ndarray
    kind: np.ndarray
    base: np.ndarray
    age_amp: np.ndarray
    age_mid: np.ndarray
    age_width: np.ndarray
    sex: np.ndarray
    visit: np.ndarray
    persist: np.ndarray
    duration: np.ndarray
    count: np.ndarray
    recur: np.ndarray
    decay: np.ndarray
    followup: np.ndarray
    trigger_parent: np.ndarray
    """(links,) code index of each trigger's parent."""
    trigger_child: np.ndarray
    trigger_weight: np.ndarray
    trigger_delay: np.ndarray
    trigger_width: np.ndarray

    @property
    def chronic(self) -> np.ndarray:
        return np.asarray(self.kind == "chronic")

    @property
    def recurrent(self) -> np.ndarray:
        return np.asarray(self.kind == "recurrent")

    @property
    def routine(self) -> int:
        return int(np.flatnonzero(self.codes == ROUTINE)[0])


def draw_catalogue(cfg: SynthConfig) -> RecurrenceCatalogue:
    """The ``cfg.codes`` codes and parameters of ``cfg.seed``'s cohort (sorted; the routine code is one of them).

    >>> cat = draw_catalogue(SynthConfig(seed=1, process="recurrence"))
    >>> len(cat.codes), ROUTINE in cat.codes, sorted(set(cat.kind)) == sorted(KIND_SHARES)
    (64, True, True)
    >>> len(draw_catalogue(SynthConfig(seed=1, process="recurrence", codes=300)).codes)
    300
    """
    rng = np.random.default_rng(cfg.seed + CATALOGUE_SEED_OFFSET)
    names: set[str] = set()
    while len(names) < cfg.codes - 1:
        letter = "ABCDEFGHIJKLMNOPQRSTUVWXY"[rng.integers(25)]
        name = f"{letter}{rng.integers(100):02d}.{rng.integers(10)}"
        if name != ROUTINE:
            names.add(name)
    codes = np.array(sorted([*names, ROUTINE]))
    k = len(codes)
    kind = rng.choice(list(KIND_SHARES), size=k, p=list(KIND_SHARES.values()))
    kind[codes == ROUTINE] = "background"
    chronic, recurrent, background = kind == "chronic", kind == "recurrent", kind == "background"

    base = np.empty(k)
    rarer = RECURRENCE_CODES / k  # a larger catalogue splits about the same amount of illness over more codes
    base[chronic] = _logit(rng.uniform(0.002, 0.012, chronic.sum()) * rarer)
    base[recurrent] = _logit(rng.uniform(0.01, 0.06, recurrent.sum()) * rarer)
    shares = rng.dirichlet(np.ones(background.sum()))  # background codes share noise_codes_per_visit
    base[background] = _logit(np.clip(shares * cfg.noise_codes_per_visit, 1e-4, 0.5))
    weak = np.where(background, 0.3, 1.0)

    parents = np.flatnonzero(chronic)
    links = [
        (int(p), child)
        for child in np.flatnonzero(chronic | recurrent)
        for p in rng.choice(parents, size=rng.integers(0, MAX_TRIGGERS + 1), replace=False)
        if p != child
    ]
    m = len(links)
    return RecurrenceCatalogue(
        codes=codes,
        kind=kind,
        base=base,
        age_amp=weak * rng.uniform(0.0, 2.5, k),
        age_mid=rng.uniform(0.0, 90.0, k),
        age_width=rng.uniform(12.0, 40.0, k),
        sex=weak * rng.normal(0.0, 0.5, k),
        visit=np.where(background, 0.0, rng.uniform(-0.5, 0.5, k)),
        persist=np.select([chronic, recurrent], [rng.uniform(0.5, 3.0, k), rng.uniform(-0.5, 1.0, k)], 0.0),
        duration=np.where(chronic, rng.uniform(-3.0, 3.0, k), 0.0),
        count=np.where(chronic, rng.uniform(0.0, 0.8, k), 0.0),
        recur=np.select([chronic, recurrent], [rng.uniform(0.5, 2.5, k), rng.uniform(2.0, 5.0, k)], 0.0),
        decay=np.where(recurrent, rng.uniform(0.5, 2.5, k), rng.uniform(1.0, 4.0, k)),
        followup=np.where(recurrent, rng.uniform(0.0, 2.0, k), 0.0),
        trigger_parent=np.array([p for p, _ in links], dtype=np.int64),
        trigger_child=np.array([c for _, c in links], dtype=np.int64),
        trigger_weight=rng.uniform(1.0, 3.5, m),
        trigger_delay=rng.uniform(0.0, 5.0, m),
        trigger_width=rng.uniform(0.5, 5.0, m),
    )


class RecurrenceSimulation(VisitRounds):
    """Every patient's recorded history as running per-code state, one visit round at a time."""

    def __init__(self, cfg: SynthConfig, rng: np.random.Generator, cat: RecurrenceCatalogue) -> None:
        n, k = cfg.patients, len(cat.codes)
        self.cat, self.codes = cat, cat.codes
        self.start_cohort(cfg, rng)
        self.frailty = rng.normal(0.0, FRAILTY_SD, n)
        self.count = np.zeros((n, k), dtype=np.int32)  # visits with the code so far
        self.first_day = np.full((n, k), np.nan)
        self.last_visit = np.full((n, k), -1, dtype=np.int64)
        self.last_gap = np.full(n, np.inf)  # days between the previous two visits
        self.had_recurrent = np.zeros(n, dtype=bool)

    def probabilities(self, idx: np.ndarray, day: np.ndarray) -> np.ndarray:
        """(patients, codes) chance of each code at a visit on ``day``, from the state before it."""
        cat = self.cat
        age = (day - self.birth[idx]) / DAYS_PER_YEAR
        z = cat.base + cat.age_amp * (np.exp(-(((age[:, None] - cat.age_mid) / cat.age_width) ** 2)) - 0.5)
        z = z + self.female[idx, None] * cat.sex + self.frailty[idx, None] * cat.chronic
        z = z + cat.visit * np.log1p(self.visits[idx, None]) / 3.0
        seen = self.count[idx] > 0
        years_first = np.nan_to_num((day[:, None] - self.first_day[idx]) / DAYS_PER_YEAR, nan=0.0)
        since = self.visits[idx, None] - self.last_visit[idx]  # 1: recorded at the previous visit
        history = cat.persist + cat.duration * np.minimum(years_first, 10.0) / 10.0
        history = history + cat.count * np.log1p(self.count[idx]) + cat.recur * np.exp(-(since - 1) / cat.decay)
        z = z + seen * history
        z = z + (seen & (since == 1)) * cat.followup * np.exp(-self.last_gap[idx, None] / 30.0)
        ramp = _ramp(years_first[:, cat.trigger_parent], cat.trigger_delay, cat.trigger_width)
        trig = seen[:, cat.trigger_parent] * ramp * cat.trigger_weight
        np.add.at(z.T, cat.trigger_child, trig.T)
        return np.asarray(1.0 / (1.0 + np.exp(-z)))

    def mean_gap(self, idx: np.ndarray) -> np.ndarray:
        """(patients,) mean routine gap in days after the current state."""
        chronic = (self.count[idx][:, self.cat.chronic] > 0).sum(axis=1)
        return np.asarray(DAYS_PER_YEAR / (self.rate[idx] * (1.0 + CHRONIC_VISIT_BOOST * chronic)))

    def next_gap(self, idx: np.ndarray, first: bool) -> np.ndarray:
        rng, m = self.rng, idx.size
        mean = self.mean_gap(idx)
        if first:
            return np.floor(rng.random(m) * mean).astype(np.int64)
        gap = rng.gamma(GAP_SHAPE, mean / GAP_SHAPE)
        followup = self.had_recurrent[idx] & (rng.random(m) < self.cfg.followup_probability)
        gap = np.where(followup, FOLLOWUP_MIN_DAYS + rng.exponential(FOLLOWUP_MEAN_DAYS, m), gap)
        return np.maximum(1, np.rint(gap)).astype(np.int64)

    def recorded_probabilities(self, idx: np.ndarray, day: np.ndarray) -> np.ndarray:
        """(patients, codes) chance that a visit on ``day`` records each code: :meth:`probabilities`, and for the
        routine code ``p + (1 - p) x P(no other code)`` (a visit with no other code records it)."""
        p = self.probabilities(idx, day)
        others_absent = np.prod(1.0 - np.delete(p, self.cat.routine, axis=1), axis=1)
        p[:, self.cat.routine] += (1.0 - p[:, self.cat.routine]) * others_absent
        return p

    def next_day_nodes(self, idx: np.ndarray, nodes: int = GAP_NODES) -> tuple[np.ndarray, np.ndarray]:
        """``(days, weights)``, each ``(patients, 2 nodes)``: days of the next visit at quantile nodes of the
        gap distribution after the current state (routine Gamma, then the follow-up part, whose weight is 0
        unless the last visit had a recurrent code), given that the visit falls on or before the window's
        end; each row of weights sums to 1. Only for patients past their first visit (the first gap follows
        another law)."""
        mean = self.mean_gap(idx)
        limit = (self.end - self.t_prev[idx]).astype(np.float64) + 0.5  # rint(gap) <= end - t_prev
        share = (np.arange(nodes) + 0.5) / nodes  # (nodes,) mid-quantiles
        routine, routine_mass = gamma_gap_nodes(mean, limit, nodes)
        followup_mass = stats.expon.cdf(limit - FOLLOWUP_MIN_DAYS, scale=FOLLOWUP_MEAN_DAYS)
        followup = FOLLOWUP_MIN_DAYS + stats.expon.ppf(share * followup_mass[:, None], scale=FOLLOWUP_MEAN_DAYS)
        p_followup = self.had_recurrent[idx] * self.cfg.followup_probability
        part = np.stack([(1.0 - p_followup) * routine_mass, p_followup * followup_mass], axis=1)  # (patients, 2)
        part = part / part.sum(axis=1, keepdims=True)
        gaps = np.maximum(1, np.rint(np.concatenate([routine, followup], axis=1)))
        weights = np.repeat(part / nodes, nodes, axis=1)
        return self.t_prev[idx, None] + gaps.astype(np.int64), weights

    def next_visit_probabilities(self, idx: np.ndarray, nodes: int = GAP_NODES) -> np.ndarray:
        """(patients, codes) chance of each code at the next visit from the current state, over the day of that
        visit (:meth:`next_day_nodes`)."""
        days, weights = self.next_day_nodes(idx, nodes)
        out = np.empty((idx.size, len(self.cat.codes)))
        step = max(1, ORACLE_CHUNK_NODES // (2 * nodes))
        for lo in range(0, idx.size, step):
            rows = slice(lo, lo + step)
            at = np.repeat(idx[rows], 2 * nodes)
            p = self.recorded_probabilities(at, days[rows].ravel())  # (patients x 2 nodes, codes)
            p = p.reshape(-1, 2 * nodes, p.shape[1])
            out[rows] = np.einsum("pnc,pn->pc", p, weights[rows])
        return out

    def visit(self, idx: np.ndarray, day: np.ndarray, visit: int) -> np.ndarray:
        """Record each patient's codes of this visit and update the state; returns (patients, codes) hits."""
        hits = self.rng.random((idx.size, len(self.cat.codes))) < self.probabilities(idx, day)
        hits[~hits.any(axis=1), self.cat.routine] = True
        self.log.add_matrix(idx, visit, day, hits, np.arange(len(self.cat.codes)))
        self.count[idx] += hits
        self.first_day[idx] = np.where(hits & np.isnan(self.first_day[idx]), day[:, None], self.first_day[idx])
        self.last_visit[idx] = np.where(hits, self.visits[idx, None], self.last_visit[idx])
        self.had_recurrent[idx] = (hits & self.cat.recurrent).any(axis=1)
        self.last_gap[idx] = np.where(self.visits[idx] > 0, day - self.t_prev[idx], np.inf)
        self.visits[idx] += 1
        self.t_prev[idx] = day
        return hits


def generate_recurrence(cfg: SynthConfig) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The ``(patients, events)`` tables of a recurrence cohort (see the module docstring)."""
    sim = RecurrenceSimulation(cfg, np.random.default_rng(cfg.seed), draw_catalogue(cfg))
    sim.run_visits()
    return sim.tables()


def recurrence_oracle(cfg: SynthConfig) -> pd.DataFrame:
    """Next-visit probabilities at one random cut visit per patient with at least two visits, from the state
    right after the cut (:meth:`RecurrenceSimulation.next_visit_probabilities`); the columns of
    :func:`synthetic_data.oracle.oracle_table`."""
    cat = draw_catalogue(cfg)
    return cut_oracle_table(cfg, lambda: RecurrenceSimulation(cfg, np.random.default_rng(cfg.seed), cat), cat.codes)


def _logit(p: np.ndarray) -> np.ndarray:
    return np.asarray(np.log(p) - np.log1p(-p))
