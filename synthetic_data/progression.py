"""A third cohort shape: hidden disease stages that show only through what visits record (``process=progression``).

The clinical process (``generator.py``) has hidden onsets but an oracle that knows the hidden state, which no
history shows; the recurrence process (``recurrence.py``) is a logistic function of the recorded history. This
process sits between them and has an oracle that is the best any model of the *record* can do: conditions
move through hidden stages, a visit records codes with stage-dependent chances, and the oracle is the exact
posterior over the stages given the record (a hidden Markov model's forward filter), carried to the next visit.

**Conditions.** The catalogue, drawn afresh from each seed, holds pairs of conditions (a *parent* and a
*child*). Each condition is a continuous-time Markov chain, read on a monthly grid, over four stages: 0 (none),
1 (early), 2 (established) and 3 (resolved, e.g. treated). Per year, 0 -> 1 happens at ``onset x
exp(age_slope x (age - 50) / 20 + sex x female)``, 1 -> 0 (remission) at ``remit``, 1 -> 2 at ``progress``,
2 -> 3 at ``resolve`` and 3 -> 2 (relapse) at ``relapse``; the child's onset is ``exp(coupling)`` times faster
while its parent is established. Every chain starts at birth in stage 0, so a patient's stages at the first
visit follow the chain's law at that age.

**Codes.** Each condition has a *symptom* code (likely in the early stage, less so once established, rare once
resolved) and a *diagnosis* code (rare early, likely while established, now and then once resolved), recorded
at a visit independently with chances that depend on the condition's stage only (a small false-positive chance
in stage 0). *Background* codes are recorded at
about ``noise_codes_per_visit`` per visit whatever the stages. A visit with no code records ``Z00.0``.

**Visits.** The first visit falls uniformly within one mean gap of the window's start; later gaps are Gamma
(shape 1.5) with mean ``365.25 / (visit_rate x patient multiplier x (1 + 0.1 x diagnosis codes on file))``.
The gap depends on the record only, so it tells nothing more about the hidden stages.

**The oracle.** The stages of one pair evolve jointly (16 states); pairs are independent, and so, given the
record, are their posteriors. Per pair, the filter starts from the chain's law at the first visit's age, is
multiplied by each visit's likelihood of the pair's recorded codes and carried month by month between visits.
At a cut it is carried to the next visit's month at ``GAP_NODES`` quantiles of the gap distribution given that
the visit falls inside the window (the cut is chosen among visits followed by another), where each code's
chance is the posterior mean of its stage-dependent chance and ``Z00.0``'s is that of no other code. Exact up
to that quadrature; nothing is simulated.

>>> from synthetic_data.generator import SynthConfig
>>> patients, events = generate_progression(SynthConfig(patients=20, seed=3, process="progression"))
>>> bool(events["code"].str.fullmatch(r"[A-Z][0-9][0-9][.][0-9]").all())
True
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy.linalg import expm

from synthetic_data.generator import (
    DAYS_PER_YEAR,
    GAP_SHAPE,
    SynthConfig,
)
from synthetic_data.visit_rounds import VisitRounds, cut_oracle_table, gamma_gap_nodes

ROUTINE = "Z00.0"
CATALOGUE_SEED_OFFSET = 130_363
MONTH_DAYS = DAYS_PER_YEAR / 12.0
STAGES = 4
"""0: none, 1: early, 2: established, 3: resolved."""
ESTABLISHED = 2
JOINT = STAGES * STAGES
"""Joint stages of a (parent, child) pair: ``3 x parent + child``."""
CODES_PER_PAIR = 4
"""Parent symptom, parent diagnosis, child symptom, child diagnosis."""
PAIR_SHARE = 0.6
"""Share of the catalogue's codes (besides ``Z00.0``) that belong to condition pairs; the rest are background."""
MAX_AGE_YEARS = 130
"""Ages (years) the transition tables cover."""
DIAGNOSIS_VISIT_BOOST = 0.1
GAP_NODES = 64
"""Quantile nodes of the next-gap distribution in the oracle's integral."""


@dataclass(frozen=True)
class ProgressionCatalogue:
    """Codes and the drawn parameters of every condition pair (``P`` pairs, ``B`` background codes)."""

    codes: np.ndarray
    """``(4 P + B + 1,)`` code strings: the pairs' codes (parent symptom, parent diagnosis, child symptom, child
    diagnosis, pair by pair), then the background codes, then ``Z00.0``."""
    transitions: np.ndarray
    """``(P, 2, MAX_AGE_YEARS, 16, 16)`` monthly transition matrices of each pair's joint stage, by sex (0 male,
    1 female) and age in whole years."""
    emission: np.ndarray
    """``(P, 16, 4)`` chance of each of the pair's codes at a visit, by joint stage."""
    background: np.ndarray
    """``(B,)`` chance of each background code at a visit."""

    @property
    def pairs(self) -> int:
        return len(self.emission)

    @property
    def routine(self) -> int:
        return len(self.codes) - 1

    @property
    def diagnosis(self) -> np.ndarray:
        """``(4 P,)`` bool: the pair codes that are diagnoses."""
        return np.tile([False, True, False, True], self.pairs)


def draw_catalogue(cfg: SynthConfig) -> ProgressionCatalogue:
    """The condition pairs and background codes of ``cfg``'s seed (``cfg.codes`` codes in all)."""
    rng = np.random.default_rng(cfg.seed + CATALOGUE_SEED_OFFSET)
    n_pairs = max(1, round(PAIR_SHARE * (cfg.codes - 1) / CODES_PER_PAIR))
    n_background = cfg.codes - 1 - CODES_PER_PAIR * n_pairs  # >= 3 for the smallest catalogue (8 codes)
    letters = np.array(list("ABCDEFGHIJKLMNOPQRSTUVWXY"))
    names = {ROUTINE}
    while len(names) < cfg.codes:
        names.add(f"{rng.choice(letters)}{rng.integers(0, 100):02d}.{rng.integers(0, 10)}")
    codes = np.array([*sorted(names - {ROUTINE}), ROUTINE], dtype=object)
    codes[:-1] = rng.permutation(codes[:-1])

    rates = {  # per condition (2 per pair), per year
        "onset": np.exp(rng.uniform(np.log(0.002), np.log(0.02), (n_pairs, 2))),
        "age_slope": rng.uniform(-0.5, 1.5, (n_pairs, 2)),
        "sex": rng.normal(0.0, 0.4, (n_pairs, 2)),
        "remit": rng.uniform(0.0, 0.5, (n_pairs, 2)),
        "progress": np.exp(rng.uniform(np.log(0.1), np.log(0.8), (n_pairs, 2))),
        "resolve": rng.uniform(0.1, 0.6, (n_pairs, 2)),
        "relapse": rng.uniform(0.0, 0.3, (n_pairs, 2)),
    }
    coupling = rng.uniform(1.0, 2.5, n_pairs)
    false_positive = rng.uniform(0.002, 0.01, (n_pairs, 2))
    early, established = rng.uniform(0.2, 0.5, (n_pairs, 2)), rng.uniform(0.1, 0.3, (n_pairs, 2))
    symptom = np.stack([false_positive, early, established, 2 * false_positive], axis=-1)  # (P, 2 conditions, 4)
    bounds = ((0.02, 0.1), (0.4, 0.8), (0.02, 0.08))  # diagnosis code: early, established, resolved
    early, established, resolved = (rng.uniform(lo, hi, (n_pairs, 2)) for lo, hi in bounds)
    diagnosis = np.stack([false_positive / 3, early, established, resolved], axis=-1)
    parent, child = np.divmod(np.arange(JOINT), STAGES)  # (16,) each condition's stage in each joint stage
    emission = np.stack(
        [symptom[:, 0, parent], diagnosis[:, 0, parent], symptom[:, 1, child], diagnosis[:, 1, child]], axis=-1
    )  # (P, 16, 4)
    shares = rng.dirichlet(np.ones(n_background))
    background = np.clip(shares * cfg.noise_codes_per_visit, 1e-4, 0.5)
    return ProgressionCatalogue(codes, _transition_tables(rates, coupling), emission, background)


def _transition_tables(rates: dict[str, np.ndarray], coupling: np.ndarray) -> np.ndarray:
    """``(P, 2, MAX_AGE_YEARS, 16, 16)`` monthly joint transition matrices (rows: from, columns: to)."""
    n_pairs = len(coupling)
    years = np.arange(MAX_AGE_YEARS) + 0.5  # (A,) mid-year ages
    out = np.empty((n_pairs, 2, MAX_AGE_YEARS, JOINT, JOINT))
    for p in range(n_pairs):
        moves = {name: rates[name][p] for name in ("remit", "progress", "resolve", "relapse")}  # (2,) each
        parent_moves, child_moves = ({name: value[i] for name, value in moves.items()} for i in (0, 1))
        for female in (0, 1):
            for a, age in enumerate(years):
                onset = rates["onset"][p] * np.exp(
                    rates["age_slope"][p] * (age - 50.0) / 20.0 + rates["sex"][p] * female
                )
                parent = _monthly(onset[0], **parent_moves)
                faster = np.exp(coupling[p])  # the child's onset while the parent is established
                child = np.stack(
                    [_monthly(onset[1] * (faster if s == ESTABLISHED else 1.0), **child_moves) for s in range(STAGES)]
                )
                # (s, c) -> (s', c'): the parent moves by its own law, the child by the law of the parent's stage at
                # the start of the month
                out[p, female, a] = np.einsum("ij,ikl->ikjl", parent, child).reshape(JOINT, JOINT)
    return out


def _monthly(onset: float, remit: float, progress: float, resolve: float, relapse: float) -> np.ndarray:
    """``(4, 4)`` one month's transition matrix of a condition with these yearly rates: none -> early (onset),
    early -> none (remit), early -> established (progress), established -> resolved (resolve), resolved ->
    established (relapse)."""
    rates = np.zeros((STAGES, STAGES))
    rates[0, 1], rates[1, 0], rates[1, 2], rates[2, 3], rates[3, 2] = onset, remit, progress, resolve, relapse
    generator = rates - np.diag(rates.sum(axis=1))
    return np.asarray(expm(generator / 12.0))


class ChainLaw:
    """A catalogue's chain law for a population: each pair's joint-stage law from birth, and one month's move
    of any law, by each patient's sex and age."""

    def __init__(self, cat: ProgressionCatalogue, female: np.ndarray, steps: int) -> None:
        """``female``: ``(n,)`` bool; ``steps``: the months from birth the law table covers."""
        self.cat, self.sex = cat, female.astype(int)
        self.table = np.zeros((cat.pairs, 2, steps, JOINT))  # (P, 2, steps, 16) by sex and months since birth
        self.table[:, :, 0, 0] = 1.0
        for k in range(1, steps):
            years = _table_year(np.array(k - 1))
            self.table[:, :, k] = np.einsum("psi,psij->psj", self.table[:, :, k - 1], cat.transitions[:, :, years])

    def prior(self, idx: np.ndarray, step: np.ndarray) -> np.ndarray:
        """``(len(idx), P, 16)`` the law of each pair's joint stage ``step`` months after birth in stage 0."""
        return np.asarray(self.table[:, self.sex[idx], step].transpose(1, 0, 2))

    def carry(self, law: np.ndarray, idx: np.ndarray, step: np.ndarray) -> np.ndarray:
        """``(len(idx), P, 16)`` the laws ``law`` of patients ``idx`` at chain ``step``, one month on."""
        years, sex = _table_year(step), self.sex[idx]
        out = np.empty_like(law)
        for p in range(self.cat.pairs):
            out[:, p] = np.einsum("ni,nij->nj", law[:, p], self.cat.transitions[p, sex, years])
        return out


class ProgressionSimulation(VisitRounds):
    """Every patient's hidden stages (simulated month by month over the window) and recorded visits."""

    def __init__(
        self,
        cfg: SynthConfig,
        rng: np.random.Generator,
        cat: ProgressionCatalogue,
        track_posterior: bool = False,
        believed: ProgressionCatalogue | None = None,
    ) -> None:
        """``track_posterior``: also keep each patient's stage posterior given the record (the oracle's
        :meth:`next_visit_probabilities`); it costs more than the simulation itself. ``believed``: the catalogue
        that posterior assumes (default ``cat``, the truth; a fitted one gives what a learner told the structure
        would predict). The records do not depend on it."""
        self.cat, self.codes = cat, cat.codes
        self.start_cohort(cfg, rng)
        self.months = int((self.end - self.start) // MONTH_DAYS) + 1
        self.age_month0 = np.floor((self.start - self.birth) / MONTH_DAYS).astype(np.int64)  # chain steps at month 0
        self.chain = ChainLaw(cat, self.female, self.law_steps)
        self.stages = self._simulate_stages()  # (n, P, months) joint stage of each pair
        self.diagnosed = np.zeros((cfg.patients, cat.pairs * CODES_PER_PAIR), dtype=bool)
        self.belief = StageFilter(self, believed) if track_posterior else None

    @property
    def law_steps(self) -> int:
        """Months from birth up to the oldest patient's age at the window's end."""
        return int(self.age_month0.max(initial=0)) + self.months + 1

    def transition_rows(self, p: int, idx: np.ndarray, step: np.ndarray, stage: np.ndarray) -> np.ndarray:
        """``(len(idx), 16)`` pair ``p``'s transition rows from joint ``stage`` for patients ``idx`` at chain
        ``step`` (months since birth)."""
        return np.asarray(self.cat.transitions[p, self.female[idx].astype(int), _table_year(step), stage])

    def _simulate_stages(self) -> np.ndarray:
        """``(n, P, months)`` joint stages: drawn from the chain's law at the window's start, then month by month."""
        n, rng = self.cfg.patients, self.rng
        everyone = np.arange(n)
        stages = np.empty((n, self.cat.pairs, self.months), dtype=np.int8)
        stages[:, :, 0] = _draw(rng, self.chain.prior(everyone, self.age_month0))
        for m in range(1, self.months):
            for p in range(self.cat.pairs):
                rows = self.transition_rows(p, everyone, self.age_month0 + m - 1, stages[:, p, m - 1])
                stages[:, p, m] = _draw(rng, rows)
        return stages

    def month(self, day: np.ndarray) -> np.ndarray:
        """Window month of each day (0-based)."""
        return np.clip(((day - self.start) // MONTH_DAYS).astype(np.int64), 0, self.months - 1)

    def probabilities(self, idx: np.ndarray, day: np.ndarray) -> np.ndarray:
        """``(patients, codes)`` chance of each code at a visit on ``day`` given the true stages there."""
        cat = self.cat
        joint = self.stages[idx, :, self.month(day)]  # (m, P)
        pair_codes = cat.emission[np.arange(cat.pairs), joint].reshape(idx.size, CODES_PER_PAIR * cat.pairs)  # (m, 4 P)
        p = np.zeros((idx.size, len(cat.codes)))
        p[:, : pair_codes.shape[1]] = pair_codes
        p[:, pair_codes.shape[1] : -1] = cat.background
        return p

    def mean_gap(self, idx: np.ndarray) -> np.ndarray:
        """(patients,) mean gap in days after the current record."""
        on_file = self.diagnosed[idx].sum(axis=1)
        return np.asarray(DAYS_PER_YEAR / (self.rate[idx] * (1.0 + DIAGNOSIS_VISIT_BOOST * on_file)))

    def next_gap(self, idx: np.ndarray, first: bool) -> np.ndarray:
        mean = self.mean_gap(idx)
        if first:
            return np.floor(self.rng.random(idx.size) * mean).astype(np.int64)
        return np.maximum(1, np.rint(self.rng.gamma(GAP_SHAPE, mean / GAP_SHAPE))).astype(np.int64)

    def next_day_nodes(self, idx: np.ndarray, nodes: int = GAP_NODES) -> tuple[np.ndarray, np.ndarray]:
        """``(days, weights)``, each ``(patients, nodes)``: the next visit's day at mid-quantiles of the gap
        distribution given that it falls on or before the window's end (equal weights)."""
        mean = self.mean_gap(idx)
        limit = (self.end - self.t_prev[idx]).astype(np.float64) + 0.5  # rint(gap) <= end - t_prev
        gaps, _ = gamma_gap_nodes(mean, limit, nodes)
        days = self.t_prev[idx, None] + np.maximum(1, np.rint(gaps)).astype(np.int64)
        return days, np.full(days.shape, 1.0 / nodes)

    def visit(self, idx: np.ndarray, day: np.ndarray, visit: int) -> np.ndarray:
        """Record each patient's codes of this visit; returns ``(patients, codes)`` hits."""
        hits = self.rng.random((idx.size, len(self.cat.codes))) < self.probabilities(idx, day)
        hits[:, self.cat.routine] = ~hits[:, : self.cat.routine].any(axis=1)
        self.log.add_matrix(idx, visit, day, hits, np.arange(len(self.cat.codes)))
        self.diagnosed[idx] |= hits[:, : self.diagnosed.shape[1]] & self.cat.diagnosis
        self.visits[idx] += 1
        self.t_prev[idx] = day
        if self.belief is not None:
            self.belief.observe(idx, day, hits, visit)
        return hits

    def next_visit_probabilities(self, idx: np.ndarray) -> np.ndarray:
        """``(len(idx), codes)`` chance of each code at the next visit given the record so far (needs
        ``track_posterior``): :meth:`StageFilter.next_visit_probabilities`."""
        if self.belief is None:
            raise ValueError("next_visit_probabilities needs a simulation made with track_posterior=True")
        return self.belief.next_visit_probabilities(idx)


class StageFilter:
    """The posterior of every pair's joint stage given each patient's record so far (a forward filter), under
    the catalogue ``believed`` (default: the simulation's own)."""

    def __init__(self, sim: ProgressionSimulation, believed: ProgressionCatalogue | None = None) -> None:
        self.sim = sim
        self.cat = sim.cat if believed is None else believed
        self.chain = sim.chain if believed is None else ChainLaw(believed, sim.female, sim.law_steps)
        self.law = np.zeros((sim.cfg.patients, sim.cat.pairs, JOINT))  # after the last visit, at its month
        self.step = np.zeros(sim.cfg.patients, dtype=np.int64)  # chain step (months from birth) of that law
        self.log_likelihood = np.zeros(sim.cfg.patients)
        """``(n,)`` each patient's log-likelihood of the pair codes recorded so far, under ``believed``."""

    def observe(self, idx: np.ndarray, day: np.ndarray, hits: np.ndarray, visit: int) -> None:
        """Take in a round of visits (number ``visit``) on ``day`` that recorded ``hits`` ``(len(idx), codes)``."""
        sim = self.sim
        to_step = sim.age_month0[idx] + sim.month(day)
        if visit == 0:
            law = self.chain.prior(idx, to_step)
        else:
            law, step = self.law[idx], self.step[idx].copy()
            while (moving := step < to_step).any():
                law[moving] = self.chain.carry(law[moving], idx[moving], step[moving])
                step[moving] += 1
        pair_hits = hits[:, : sim.cat.pairs * CODES_PER_PAIR].reshape(idx.size, sim.cat.pairs, 1, CODES_PER_PAIR)
        chance = self.cat.emission[None]  # (1, P, 16, 4)
        law = law * np.where(pair_hits, chance, 1.0 - chance).prod(axis=-1)  # (m, P, 16) times the likelihood
        evidence = law.sum(axis=-1, keepdims=True)  # (m, P, 1) each pair's codes' chance given the record before
        self.log_likelihood[idx] += np.log(evidence).sum(axis=(1, 2))
        self.law[idx] = law / evidence
        self.step[idx] = to_step

    def next_visit_probabilities(self, idx: np.ndarray, nodes: int = GAP_NODES) -> np.ndarray:
        """``(len(idx), codes)`` chance of each code at the next visit, over the day of that visit: the law
        carried month by month, each month's code chances weighted by the gap nodes that fall in it."""
        sim, cat = self.sim, self.cat
        days, weights = sim.next_day_nodes(idx, nodes)
        ahead = sim.age_month0[idx, None] + sim.month(days) - self.step[idx, None]  # (m, nodes) months on
        law, step = self.law[idx].copy(), self.step[idx].copy()
        out = np.zeros((idx.size, len(cat.codes)))
        for k in range(int(ahead.max(initial=0)) + 1):
            weight = np.where(ahead == k, weights, 0.0).sum(axis=1)  # (m,) mass of the visit in month k
            rows = np.flatnonzero(weight > 0)
            out[rows] += weight[rows, None] * self._code_chances(law[rows])
            rows = np.flatnonzero(ahead.max(axis=1) > k)
            law[rows] = self.chain.carry(law[rows], idx[rows], step[rows])
            step[rows] += 1
        return out

    def _code_chances(self, law: np.ndarray) -> np.ndarray:
        """``(m, codes)`` chance of each code at a visit, given ``(m, P, 16)`` laws of the joint stages there."""
        cat = self.cat
        pair_codes = np.einsum("mpj,pjc->mpc", law, cat.emission).reshape(len(law), CODES_PER_PAIR * cat.pairs)
        nothing = np.einsum("mpj,pj->mp", law, (1.0 - cat.emission).prod(axis=-1)).prod(axis=1)  # (m,)
        nothing = nothing * np.prod(1.0 - cat.background)  # the visit records no code: Z00.0
        background = np.broadcast_to(cat.background, (len(law), len(cat.background)))
        return np.concatenate([pair_codes, background, nothing[:, None]], axis=1)


def _table_year(step: np.ndarray) -> np.ndarray:
    """The transition tables' age row (whole years, capped at the last) of chain steps (months since birth)."""
    return np.minimum(step // 12, MAX_AGE_YEARS - 1)


def _draw(rng: np.random.Generator, law: np.ndarray) -> np.ndarray:
    """One draw per row of ``law`` ``(..., 16)`` (rows sum to 1)."""
    cumulative = np.cumsum(law, axis=-1)
    u = rng.random(law.shape[:-1])[..., None] * cumulative[..., -1:]
    return (u > cumulative).sum(axis=-1).astype(np.int8)


def generate_progression(cfg: SynthConfig) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The ``(patients, events)`` tables of a progression cohort (see the module docstring)."""
    sim = ProgressionSimulation(cfg, np.random.default_rng(cfg.seed), draw_catalogue(cfg))
    sim.run_visits()
    return sim.tables()


def progression_oracle(cfg: SynthConfig, believed: ProgressionCatalogue | None = None) -> pd.DataFrame:
    """Next-visit probabilities at one random cut visit per patient with at least two visits, from the stage
    posterior given the record up to the cut (:meth:`StageFilter.next_visit_probabilities`); the columns of
    :func:`synthetic_data.oracle.oracle_table`. With ``believed`` the posterior assumes that catalogue instead
    of the true one (same records, same cuts)."""
    cat = draw_catalogue(cfg)

    def simulation() -> ProgressionSimulation:
        return ProgressionSimulation(cfg, np.random.default_rng(cfg.seed), cat, track_posterior=True, believed=believed)

    return cut_oracle_table(cfg, simulation, cat.codes)
