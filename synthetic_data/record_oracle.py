"""The best any model of the record can do: next-visit probabilities given only what the history shows.

``oracle.py`` answers from the simulated *state*, which holds things no history shows: conditions begun
before the window and not yet recorded, when they began, the patient's visit rate, the due date of a
pregnancy. No predictor of the record can reach it. This module answers from the *record*: at the same cut
visits, the probability of each code at the next visit averaged over the states the generator could have
been in given everything recorded up to and including the cut (age, sex, every visit's day and codes). That
is the Bayes-optimal history predictor, the ceiling a model can actually aim at.

How (self-normalised sequential importance sampling, per cut patient; ``particles`` copies each):

1. **Proposal.** Each copy gets the patient's birth day and sex, a visit rate drawn near the rate its
   recorded gaps suggest (the conjugate Gamma update of the rate's Gamma prior), and a life before the window
   simulated by the generator's own yearly burn-in, steered so that each condition is held at the window
   start by about the share of copies a rough posterior says (high for one recorded at the first visit, low
   for a common one never recorded in many visits), with onset years keeping the prior's shape. The weight
   starts as the ratio of the prior to this proposal, draw by draw, so steering costs variance, never bias.
2. **Likelihood of the record.** Each copy then walks through the patient's recorded visits up to the cut,
   and its weight is multiplied by the chance, under its state, of what the record shows: the gap to the
   visit (Gamma routine gaps, follow-up and treatment-cycle gaps; gaps during a pregnancy are left out),
   surviving that gap, for every condition not yet present whether its diagnosis code appears (a new onset,
   whose day becomes the visit's), for every present one whether it is recorded again, the treatment code,
   gestational diabetes at prenatal visits, and every acute code. Background codes do not depend on the
   state and are skipped. A recorded code the copy cannot produce sets its weight to zero.
3. **Prediction.** ``replicas`` copies per patient are drawn by weight (systematic resampling), a pregnancy's
   due day is drawn among those the record leaves open, and each copy lives through one more visit exactly
   as in ``oracle.py``. The probability of a code is the share of copies whose next visit records it.

The effective sample size of each patient's weights is returned beside the table; few patients with very
long histories fall low, and their probabilities are then noisier, not biased in any known direction.
Only the clinical process needs this: the recurrence process's state *is* its record, so its oracle is
already the record oracle.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd
from scipy import stats
from tqdm.auto import tqdm

from synthetic_data.generator import (
    CAESAREAN,
    CHRONIC_VISIT_BOOST,
    CONDITIONS,
    DAYS_PER_YEAR,
    FOLLOWUP_MEAN_DAYS,
    FOLLOWUP_MIN_DAYS,
    GAP_SHAPE,
    GDM,
    GDM_OBESE_MULT,
    GDM_PER_VISIT,
    PREGNANCY,
    PREGNANCY_DAYS,
    RATE_SHAPE,
    TREATMENT_MEAN_DAYS,
    TREATMENT_MIN_DAYS,
    TREATMENT_RECORD,
    TREATMENT_YEARS,
    VAGINAL,
    SynthConfig,
    _age_visit_factor,
    _Catalogue,
    _Simulation,
    patient_ids,
)
from synthetic_data.oracle import (
    FIXED,
    ORACLE_SEED_OFFSET,
    STATE,
    _as_table,
    _choose_cuts,
    _simulate_next_visits,
    simulate_cohort,
)

RECORD_SEED_OFFSET = 15_485_863
"""Added to the cohort seed for the particles' draws (a stream apart from the cohort's and the oracle's)."""
MAX_TILT = 500.0
"""Largest hazard multiplier for a complication (a condition with no hazard of its own) the record shows."""
PILOT_COPIES = 64
"""Untilted copies per patient that estimate how likely each condition is at the window start."""
CHUNK_PARTICLES = 100_000
"""Copies walked through their histories at once, to bound memory."""
TINY = 1e-300


@dataclass
class RecordOracle:
    """The record oracle's table (the columns of ``oracle.oracle_table``) and, per cut patient (in id order),
    the effective sample size of its importance weights (1 to ``particles``)."""

    table: pd.DataFrame
    ess: np.ndarray


def record_oracle_table(
    cfg: SynthConfig, particles: int = 1000, replicas: int = 500, patients: Collection[str] | None = None
) -> RecordOracle:
    """Next-visit probabilities at the cuts of :func:`synthetic_data.oracle.oracle_table` (same patients, same
    cut visits), given only the recorded history; ``patients``: only these patient ids (e.g. a held-out
    split; about 0.1 s of one core per patient and 500 particles). Deterministic for all the arguments."""
    if particles < 2 or replicas < 1:
        raise ValueError(f"particles must be >= 2 and replicas >= 1, got {particles} and {replicas}")
    clean = replace(cfg, corrupt_fraction=0.0)
    if clean.process != "clinical":
        raise ValueError("only the clinical process hides state; the recurrence oracle already uses the record")
    sim = simulate_cohort(clean)
    cuts = _choose_cuts(clean, np.random.default_rng(clean.seed + ORACLE_SEED_OFFSET), sim)
    record = _Record.of(sim, cuts)
    rng = np.random.default_rng(clean.seed + RECORD_SEED_OFFSET)
    who = np.flatnonzero(cuts >= 0)
    if patients is not None:
        who = who[np.isin(patient_ids(clean.patients)[who], list(patients))]
    per_chunk = max(1, CHUNK_PARTICLES // particles)
    states: list[dict[str, np.ndarray]] = []
    ess = np.empty(len(who))
    for start in tqdm(range(0, len(who), per_chunk), desc="record oracle", unit="chunk", leave=False):
        chunk = who[start : start + per_chunk]
        walk = _Walk(clean, record, chunk, particles, rng)
        walk.run()
        chunk_states, ess[start : start + len(chunk)] = walk.resample(replicas)
        states.append(chunk_states)
    merged = {name: np.concatenate([s[name] for s in states]) for name in states[0]}
    counts, totals = _simulate_next_visits(clean, merged, 1, rng)
    owner = np.repeat(np.arange(len(who)), replicas)
    per_patient = np.zeros((len(who), counts.shape[1]), dtype=np.int64)
    np.add.at(per_patient, owner, counts)
    per_total = np.bincount(owner, weights=totals, minlength=len(who)).astype(np.int64)
    cut_state = {"patient": who, "t_prev": record.cut_day[who]}
    return RecordOracle(_as_table(clean, cut_state, per_patient, per_total), ess)


@dataclass
class _Record:
    """What the histories show: every patient's visit days and codes up to the cut (the clinical process)."""

    birth: np.ndarray
    female: np.ndarray
    cut: np.ndarray
    """(patients,) visit number of the cut; -1: none."""
    day: np.ndarray
    """(patients, visits) day of each visit up to the cut (0 after it)."""
    codes: list[list[np.ndarray]]
    """Per patient, per visit up to the cut, the catalogue code indices recorded."""

    @property
    def cut_day(self) -> np.ndarray:
        return np.asarray(self.day[np.arange(len(self.cut)), np.maximum(self.cut, 0)])

    def first_shown(self, patient: int, cat: _Catalogue) -> np.ndarray:
        """(conditions,) the first visit up to the cut whose codes show each condition (its diagnosis or
        repeat code); -1: never shown."""
        first = np.full(len(CONDITIONS), -1)
        for visit in range(self.cut[patient], -1, -1):
            codes = self.codes[patient][visit]
            first[np.isin(cat.dx, codes) | np.isin(cat.followup, codes)] = visit
        return first

    @classmethod
    def of(cls, sim: _Simulation, cuts: np.ndarray) -> _Record:
        """The record of a finished simulation up to each patient's cut."""
        patient, visit, day, code = sim.log.columns()
        keep = visit <= cuts[patient]
        patient, visit, day, code = patient[keep], visit[keep], day[keep], code[keep]
        n = len(cuts)
        days = np.zeros((n, max(int(cuts.max()) + 1, 1)), dtype=np.int64)
        days[patient, visit] = day
        order = np.lexsort((code, visit, patient))
        patient, visit, code = patient[order], visit[order], code[order]
        codes: list[list[np.ndarray]] = [[] for _ in range(n)]
        bounds = np.flatnonzero(np.r_[True, (patient[1:] != patient[:-1]) | (visit[1:] != visit[:-1]), True])
        by_visit = {(int(patient[a]), int(visit[a])): code[a:b] for a, b in itertools.pairwise(bounds)}
        for p in np.flatnonzero(cuts >= 0):
            codes[p] = [by_visit.get((int(p), v), np.zeros(0, dtype=np.int64)) for v in range(cuts[p] + 1)]
        return cls(sim.birth, sim.female, cuts, days, codes)


class _Walk:
    """Particles of a few cut patients walked through their recorded visits, with their log weights."""

    def __init__(
        self, cfg: SynthConfig, record: _Record, patients: np.ndarray, particles: int, rng: np.random.Generator
    ) -> None:
        self.cfg, self.record, self.patients, self.n, self.rng = cfg, record, patients, particles, rng
        self.cat = _Catalogue()
        self.owner = np.repeat(np.arange(len(patients)), particles)  # particle -> position in ``patients``
        self.sim = _Simulation(replace(cfg, patients=self.owner.size), rng, self.cat)
        self.sim.birth = record.birth[patients][self.owner]
        self.sim.female = record.female[patients][self.owner]
        self.log_w = np.zeros(self.owner.size)
        self.conceived = np.full(len(patients), np.nan)  # day a pregnancy was detected (nan: not pregnant)
        self.is_condition_code = np.zeros(len(self.cat.codes), dtype=bool)  # written by the condition records
        self.is_condition_code[np.r_[self.cat.dx, self.cat.followup, self.cat.treatment[self.cat.treated]]] = True
        self.gdm = self.cat.cond_idx[GDM]
        self.obese = self.cat.cond_idx["E66.9"]

    # --- the walk ------------------------------------------------------------------------------------------
    def run(self) -> None:
        self._propose_rate()
        self._steered_burn_in()
        cut = self.record.cut[self.patients]
        for visit in range(int(cut.max()) + 1):
            who = np.flatnonzero(cut >= visit)
            observed = self._observed(who, visit)
            idx = np.flatnonzero(np.isin(self.owner, who))
            self._step(idx, observed[np.searchsorted(who, self.owner[idx])], visit)

    def _observed(self, who: np.ndarray, visit: int) -> np.ndarray:
        """(len(who), codes) the codes recorded at ``visit`` by each patient in ``who``."""
        out = np.zeros((len(who), len(self.cat.codes)), dtype=bool)
        for row, p in enumerate(self.patients[who]):
            out[row, self.record.codes[p][visit]] = True
        return out

    def _step(self, idx: np.ndarray, seen: np.ndarray, visit: int) -> None:
        """Weigh every copy in ``idx`` by the chance of its patient's ``visit`` (day and codes ``seen``) and
        move its state past the visit, as ``_Simulation.visit`` would have."""
        sim, cat = self.sim, self.cat
        day = self.record.day[self.patients[self.owner[idx]], visit]
        gap = day - sim.t_prev[idx]
        pregnant = ~np.isnan(self.conceived[self.owner[idx]])
        self.log_w[idx] += self._gap_log_likelihood(idx, gap, visit == 0, pregnant)
        self.log_w[idx] -= sim.death_hazard(idx, sim.t_prev[idx]) * gap / DAYS_PER_YEAR
        self._onsets(idx, gap, day, seen)
        self._pregnancy(idx, day, seen, pregnant)
        self._recorded_conditions(idx, day, seen)
        self._acute(idx, day, seen[:, cat.acute])
        sim.t_prev[idx] = day

    def _onsets(self, idx: np.ndarray, gap: np.ndarray, day: np.ndarray, seen: np.ndarray) -> None:
        """A condition not yet present begins in the gap exactly when its diagnosis code is recorded."""
        sim = self.sim
        age = (day - sim.birth[idx]) / DAYS_PER_YEAR
        p = -np.expm1(-sim.onset_hazard(idx, day, age) * (gap / DAYS_PER_YEAR)[:, None])
        absent = np.isnan(sim.onset[idx])
        absent[:, self.gdm] = False  # begins only at a prenatal visit (``_pregnancy``)
        new = absent & seen[:, self.cat.dx]
        self.log_w[idx] += np.where(absent, np.log(np.where(new, p, 1.0 - p) + TINY), 0.0).sum(axis=1)
        sim.onset[idx] = np.where(new, day[:, None], sim.onset[idx])

    def _pregnancy(self, idx: np.ndarray, day: np.ndarray, seen: np.ndarray, pregnant: np.ndarray) -> None:
        """Deliveries and detections are read off the record; gestational diabetes begins at a prenatal visit
        with a chance that doubles with obesity (a hidden condition, hence the weight)."""
        sim, index = self.sim, self.cat.index
        delivered = pregnant & (seen[:, index[VAGINAL]] | seen[:, index[CAESAREAN]])
        prenatal = pregnant & ~delivered
        obese = sim.onset[idx, self.obese] <= day
        p = GDM_PER_VISIT * np.where(obese, GDM_OBESE_MULT, 1.0)
        can_begin = prenatal & np.isnan(sim.onset[idx, self.gdm])
        begins = can_begin & seen[:, index[GDM]]
        self.log_w[idx] += np.where(can_begin, np.log(np.where(begins, p, 1.0 - p)), 0.0)
        sim.onset[idx[begins], self.gdm] = day[begins]
        sim.last_delivery[idx[delivered]] = day[delivered]
        owner = self.owner[idx]
        self.conceived[owner[delivered]] = np.nan
        detected = ~pregnant & seen[:, index[PREGNANCY]]
        self.conceived[owner[detected]] = day[detected]

    def _recorded_conditions(self, idx: np.ndarray, day: np.ndarray, seen: np.ndarray) -> None:
        """The chance of the record's condition codes (diagnoses, repeat records, treatment) given the state."""
        cat, sim = self.cat, self.sim
        onset = sim.onset[idx]
        years = (day[:, None] - onset) / DAYS_PER_YEAR
        new = onset == day[:, None]
        old = (onset < day[:, None]) & (years < cat.record_years)
        absent = np.ones((idx.size, len(cat.codes)))  # chance that no source records each code
        np.multiply.at(absent.T, cat.dx, np.where(new, 0.0, 1.0).T)
        np.multiply.at(absent.T, cat.followup, np.where(old, 1.0 - cat.record, 1.0).T)
        in_treatment = (cat.treated & (years >= 0) & (years < TREATMENT_YEARS)).sum(axis=1)
        treatment = cat.treatment[cat.treated][0]
        absent[:, treatment] = (1.0 - TREATMENT_RECORD) ** in_treatment
        chance = np.where(seen, 1.0 - absent, absent)[:, self.is_condition_code]
        self.log_w[idx] += np.log(chance + TINY).sum(axis=1)

    def _acute(self, idx: np.ndarray, day: np.ndarray, seen: np.ndarray) -> None:
        """Acute codes: the generator's per-visit chance, which hidden conditions raise or enable."""
        sim = self.sim
        p = sim.acute_chance(idx, day)
        self.log_w[idx] += np.log(np.where(seen, p, 1.0 - p) + TINY).sum(axis=1)
        sim.last_acute[idx] = np.where(seen, day[:, None], sim.last_acute[idx])
        sim.had_acute[idx] = seen.any(axis=1)

    # --- gaps and the visit rate -----------------------------------------------------------------------------
    def _mean_gap(self, idx: np.ndarray, rate: np.ndarray) -> np.ndarray:
        """Mean routine gap in days after each copy's previous visit, for visit rates ``rate``."""
        sim = self.sim
        t = sim.t_prev[idx]
        age = (t - sim.birth[idx]) / DAYS_PER_YEAR
        present = (sim.onset[idx] <= t[:, None]).sum(axis=1)
        return np.asarray(DAYS_PER_YEAR / (rate * _age_visit_factor(age) * (1.0 + CHRONIC_VISIT_BOOST * present)))

    def _gap_log_likelihood(self, idx: np.ndarray, gap: np.ndarray, first: bool, pregnant: np.ndarray) -> np.ndarray:
        """log P(the recorded gap | state), as ``_Simulation.next_gap`` draws it (rounded to whole days)."""
        mean = self._mean_gap(idx, self.sim.rate[idx])
        if first:  # a residual gap: floor(uniform x mean)
            return np.asarray(np.log(np.clip(mean - gap, 0.0, 1.0) / mean + TINY))
        follow = self.sim.had_acute[idx] * self.cfg.followup_probability
        treated = self.sim.in_treatment(idx, self.sim.t_prev[idx])

        def survival(x: np.ndarray) -> np.ndarray:
            routine = stats.gamma.sf(x, GAP_SHAPE, scale=mean / GAP_SHAPE)
            followup = np.exp(-np.maximum(x - FOLLOWUP_MIN_DAYS, 0.0) / FOLLOWUP_MEAN_DAYS)
            cycle = np.exp(-np.maximum(x - TREATMENT_MIN_DAYS, 0.0) / TREATMENT_MEAN_DAYS)
            return np.asarray(((1.0 - follow) * routine + follow * followup) * np.where(treated, cycle, 1.0))

        upper = np.where(gap <= 1, 1.0, survival(gap - 0.5))
        chance = upper - survival(gap + 0.5)
        return np.where(pregnant, 0.0, np.log(np.maximum(chance, 0.0) + TINY))

    def _propose_rate(self) -> None:
        """Visit rates near what the recorded gaps say: the Gamma prior updated as if every gap after a visit
        without an acute or pregnancy code were a routine one at the age's and the recorded conditions' visit
        factor (widened to half the shape), with the prior-to-proposal log ratio."""
        shape0, scale0 = RATE_SHAPE, self.cfg.visit_rate / RATE_SHAPE
        n_gaps, exposure = np.zeros(len(self.patients)), np.zeros(len(self.patients))
        for row, p in enumerate(self.patients):
            n_gaps[row], exposure[row] = self._routine_gaps(p)
        shape = shape0 + GAP_SHAPE * n_gaps
        rate_param = 1.0 / scale0 + exposure
        shape_q = np.maximum(shape0, shape / 2.0)  # wider than the update, same mean
        scale_q = (shape / rate_param) / shape_q
        draw = self.rng.gamma(shape_q[self.owner], scale_q[self.owner])
        self.sim.rate = draw
        self.log_w += stats.gamma.logpdf(draw, shape0, scale=scale0)
        self.log_w -= stats.gamma.logpdf(draw, shape_q[self.owner], scale=scale_q[self.owner])

    def _routine_gaps(self, patient: int) -> tuple[int, float]:
        """Number of the patient's gaps that follow a plain visit, and their sum in units of the Gamma rate
        parameter (gap x visit factor x shape / days per year)."""
        rec, cat = self.record, self.cat
        days = rec.day[patient, : rec.cut[patient] + 1]
        first = rec.first_shown(patient, cat)
        shown = first[first >= 0]
        factor, plain = np.empty(len(days)), np.empty(len(days), dtype=bool)
        for visit, codes in enumerate(rec.codes[patient]):
            age = (days[visit] - rec.birth[patient]) / DAYS_PER_YEAR
            conditions = (shown <= visit).sum()
            factor[visit] = _age_visit_factor(np.asarray(age)) * (1.0 + CHRONIC_VISIT_BOOST * conditions)
            plain[visit] = not np.isin(codes, np.r_[cat.acute, cat.index[PREGNANCY]]).any()
        use = plain[:-1]
        return int(use.sum()), float((np.diff(days) * factor[:-1])[use].sum() * GAP_SHAPE / DAYS_PER_YEAR)

    # --- life before the window ------------------------------------------------------------------------------
    def _steered_burn_in(self) -> None:
        """``_Simulation.burn_in`` with each condition steered towards its rough posterior share of copies
        holding it at the window start (``_presence_targets``), and the weight corrected draw by draw.

        The steered chance of an onset in a year, for a copy without the condition yet, is the prior's
        conditioned on "present at the window start" with probability target, "absent" otherwise (a Doob
        transform of the age-and-sex hazard, so onset years keep the prior's shape); conditions with no hazard
        of their own (complications) get their hazard multiplied instead. A tenth of the prior's own chance is
        mixed in so that every onset the prior allows stays possible."""
        sim, rng = self.sim, self.rng
        target, prior = (x[self.owner] for x in self._presence_targets())
        tilt = np.clip(np.log1p(-target) / np.log1p(-prior), 1.0 / MAX_TILT, MAX_TILT)
        age0 = (sim.start - sim.birth) / DAYS_PER_YEAR
        years = [(np.flatnonzero(age0 > y), y) for y in range(int(np.ceil(age0.max())))]
        steps = [np.minimum(1.0, age0[idx] - y) for idx, y in years]
        own_total = np.zeros_like(sim.onset)
        for (idx, y), step in zip(years, steps, strict=True):
            own_total[idx] += sim.own_onset_hazard(idx, y + step / 2) * step[:, None]
        planned = own_total > 0
        s_end = np.exp(-own_total)
        own_before = np.zeros_like(sim.onset)
        for (idx, y), step in zip(years, steps, strict=True):
            day = sim.birth[idx] + y * DAYS_PER_YEAR
            hazard = sim.onset_hazard(idx, day, y + step / 2) * step[:, None]
            own = sim.own_onset_hazard(idx, y + step / 2) * step[:, None]
            s_now, s_next = np.exp(-own_before[idx]), np.exp(-(own_before[idx] + own))
            own_before[idx] += own
            left = s_now - s_end[idx]  # the prior's chance of an onset between now and the window start
            with np.errstate(divide="ignore", invalid="ignore"):
                hold = target[idx] * left / (1.0 - s_end[idx])
                doob = hold / (hold + 1.0 - target[idx]) * np.where(left > 0, (s_now - s_next) / left, 0.0)
            p = -np.expm1(-hazard)
            steered = np.where(planned[idx], np.nan_to_num(doob), -np.expm1(-hazard * tilt[idx]))
            q = 0.9 * steered + 0.1 * p
            absent = np.isnan(sim.onset[idx])
            new = absent & (rng.random(hazard.shape) < q)
            with np.errstate(divide="ignore", invalid="ignore"):
                ratio = np.where(new, np.log(p) - np.log(q), np.log1p(-p) - np.log1p(-q))
            self.log_w[idx] += np.where(absent & (q > 0), ratio, 0.0).sum(axis=1)
            rows, cols = np.nonzero(new)
            when = np.floor(day[rows] + rng.random(rows.size) * step[rows] * DAYS_PER_YEAR)
            sim.onset[idx[rows], cols] = np.minimum(when, sim.start - 1)

    def _presence_targets(self) -> tuple[np.ndarray, np.ndarray]:
        """(patients, conditions) a rough posterior chance of holding each condition at the window start, and
        the prior chance P that a pilot of untilted copies gives: a condition never recorded in V visits
        weighs P (1 - r)^V against 1 - P (r: its record chance), one first recorded at visit m weighs
        P (1 - r)^m r against the chance (1 - P) that it began in the gap before visit m at the prior's mean
        hazard. Only the proposal uses it; the weights make the answer exact whatever it says."""
        cat, rec = self.cat, self.record
        n = len(self.patients)
        pilot = _Simulation(replace(self.cfg, patients=n * PILOT_COPIES), self.rng, cat)
        pilot.birth = np.repeat(rec.birth[self.patients], PILOT_COPIES)
        pilot.female = np.repeat(rec.female[self.patients], PILOT_COPIES)
        pilot.burn_in()
        had = ~np.isnan(pilot.onset).reshape(n, PILOT_COPIES, -1)
        prior = np.clip(had.mean(axis=1), 0.5 / PILOT_COPIES, 1.0 - 0.5 / PILOT_COPIES)
        start = self.sim.start
        years_lived = np.maximum((start - rec.birth[self.patients]) / DAYS_PER_YEAR, 0.5)[:, None]
        per_day = -np.log1p(-prior) / years_lived / DAYS_PER_YEAR
        burn = np.empty_like(prior)
        for row, p in enumerate(self.patients):
            days = rec.day[p, : rec.cut[p] + 1]
            first = rec.first_shown(p, cat)
            shown = first >= 0
            unrecorded = np.where(shown, first, rec.cut[p] + 1)
            keeps = prior[row] * (1.0 - cat.record) ** unrecorded * np.where(shown, cat.record, 1.0)
            gap = np.diff(np.r_[start, days])[np.maximum(first, 0)]
            begins = (1.0 - prior[row]) * np.where(shown, per_day[row] * np.maximum(gap, 1), 1.0)
            burn[row] = keeps / (keeps + begins)
        return np.clip(burn, 1e-4, 0.99), prior

    # --- the answer ----------------------------------------------------------------------------------------
    def resample(self, replicas: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """``replicas`` states per patient drawn by weight (systematic resampling), in the layout of
        ``oracle._capture_states``, and each patient's effective sample size."""
        w = self.log_w.reshape(len(self.patients), self.n)
        w = np.exp(w - w.max(axis=1, keepdims=True))
        w /= w.sum(axis=1, keepdims=True)
        ess = 1.0 / (w**2).sum(axis=1)
        positions = (self.rng.random((len(self.patients), 1)) + np.arange(replicas)) / replicas
        pick = np.minimum(
            np.array([np.searchsorted(np.cumsum(row), pos) for row, pos in zip(w, positions)]), self.n - 1
        )
        chosen = (pick + np.arange(len(self.patients))[:, None] * self.n).ravel()
        self._draw_due(chosen)
        states = {name: getattr(self.sim, name)[chosen].copy() for name in STATE + FIXED}
        states["patient"] = np.repeat(self.patients, replicas)
        return states, ess

    def _draw_due(self, chosen: np.ndarray) -> None:
        """A pregnancy at the cut ends on a day drawn uniformly among those still open: detection + 180 to
        230 days, after the cut."""
        conceived = self.conceived[self.owner[chosen]]
        pregnant = ~np.isnan(conceived)
        low = np.maximum(conceived + PREGNANCY_DAYS[0], self.sim.t_prev[chosen] + 1)
        high = np.maximum(conceived + PREGNANCY_DAYS[1], low)
        due = np.floor(low + self.rng.random(chosen.size) * (high - low + 1))
        self.sim.due[chosen] = np.where(pregnant, due, np.nan)
