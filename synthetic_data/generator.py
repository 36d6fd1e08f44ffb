"""Seeded synthetic EHR cohort in the visits format, with planted structure that rewards sequence models.

The story (told in full, with every parameter, in ``synthetic_data/README.md``): each patient is born
0-90 years before the observation start and carries, from a yearly burn-in over their life so far, the
chronic conditions they already have. During the observation window they visit at a patient-specific rate
(more often when very young, old, chronically ill, acutely ill, pregnant or in cancer treatment). Between
two visits new chronic conditions start with hazards that rise with age and, for complications, with the
*time since the parent condition began*; acute problems recur at the following visits with a probability
that fades with the time since the last episode; chronic conditions are recorded at some later visits,
not all. Death ends the history; nothing is recorded after it.

All times are integer days since 1970-01-01 inside the simulation; rates are per year unless named
``..._days``; ages are in years of 365.25 days.

>>> patients, events = generate(SynthConfig(patients=30, seed=1))
>>> list(patients.columns) == [PATIENT_ID, BIRTH_DATE, SEX, DEATH_DATE]
True
>>> list(events.columns) == [PATIENT_ID, DATE, CODE, VISIT_ID]
True
>>> patients[PATIENT_ID].iloc[0]
'P000001'
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from behrt_rope.schema import BIRTH_DATE, CODE, DATE, DEATH_DATE, PATIENT_ID, SEX, VISIT_ID

DAYS_PER_YEAR = 365.25
FEMALE, MALE = "F", "M"
RECURRENCE_CODES = 64
"""The recurrence process's default catalogue size, which its per-code base rates are set for."""


@dataclass
class SynthConfig:
    """How many patients, over which calendar, in which file format, with how much deliberate damage."""

    patients: int = 5000
    """Number of patients (rows of the patients table)."""
    seed: int = 0
    """Random seed; the same seed and settings give identical tables."""
    file_format: Literal["csv", "parquet"] = "csv"
    """File format of the written tables."""
    start: str = "2010-01-01"
    """First day of the observation window (ISO date); patients are aged 0 to max_age on this day."""
    end: str = "2020-12-31"
    """Last day of the observation window (ISO date); nothing is recorded after it."""
    max_age: float = 90.0
    """Oldest age at the observation start, years; ages are uniform between 0 and this."""
    visit_rate: float = 0.55
    """Mean routine visit rate of a healthy adult, visits per year (patients vary around it)."""
    followup_probability: float = 0.45
    """Chance that a visit with an acute problem is followed by a short-gap follow-up visit."""
    noise_codes_per_visit: float = 0.7
    """Mean number of background (uninformative) codes per visit, Poisson."""
    max_visits: int = 250
    """Most visits simulated per patient; a history reaching it simply stops there."""
    corrupt_fraction: float = 0.0
    """Extra deliberately bad event rows, as a share of the clean events, to exercise the ETL quarantine."""
    process: Literal["clinical", "recurrence", "progression"] = "clinical"
    """clinical: the disease story of README.md (hidden onsets, progression chains, pregnancy, death);
    recurrence: codes that recur, persist and trigger each other as a logistic function of the recorded
    history, with a catalogue drawn afresh from each seed (``synthetic_data/recurrence.py``); progression:
    pairs of conditions move through hidden stages that visits record with stage-dependent chances, a
    catalogue drawn afresh from each seed and an oracle that is the exact posterior given the record
    (``synthetic_data/progression.py``)."""
    codes: int = RECURRENCE_CODES
    """Distinct codes in the recurrence or progression process's drawn catalogue, the routine code included
    (the clinical process has its own fixed catalogue and ignores this)."""

    def __post_init__(self) -> None:
        if self.patients < 1:
            raise ValueError(f"patients must be >= 1, got {self.patients}")
        start, end = _parse_day(self.start, "start"), _parse_day(self.end, "end")
        if end <= start:
            raise ValueError(f"end ({self.end}) must come after start ({self.start})")
        if self.file_format not in ("csv", "parquet"):
            raise ValueError(f"file_format must be csv or parquet, got {self.file_format!r}")
        if not 0.0 <= self.corrupt_fraction <= 1.0:
            raise ValueError(f"corrupt_fraction must lie in [0, 1], got {self.corrupt_fraction}")
        if self.visit_rate <= 0 or self.max_age <= 0 or self.max_visits < 1:
            raise ValueError("visit_rate and max_age must be > 0 and max_visits >= 1")
        if self.process not in ("clinical", "recurrence", "progression"):
            raise ValueError(f"process must be clinical, recurrence or progression, got {self.process!r}")
        if not 8 <= self.codes <= 2000:
            raise ValueError(f"codes must lie in [8, 2000], got {self.codes}")
        if not 0.0 <= self.followup_probability <= 1.0 or self.noise_codes_per_visit < 0:
            raise ValueError("followup_probability must lie in [0, 1] and noise_codes_per_visit be >= 0")


# -------------------------------------------------------------------------------------------------------------
# The catalogue: every code and its mechanism
# -------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Link:
    """A parent condition raising a child's onset hazard as a function of time since the parent began.

    Extra hazard = ``rate`` per year x ramp, where ramp rises linearly from 0 at ``delay`` years after the
    parent's onset to 1 at ``delay + ramp`` years (``ramp=0``: a step at ``delay``).
    """

    parent: str
    rate: float
    delay: float = 0.0
    ramp: float = 0.0


@dataclass(frozen=True)
class Condition:
    """A chronic condition (or a one-off event with lasting consequences) and how it is recorded.

    Own onset hazard per year = ``rate50 * exp(age_slope * (age - 50))`` from ``min_age`` on, times the
    sex multiplier, plus the :class:`Link` terms. Onset is diagnosed (``code`` recorded) at the first visit
    after it; later visits record ``followup`` (default ``code``) with probability ``record`` while fewer
    than ``record_years`` have passed.
    """

    code: str
    name: str
    rate50: float = 0.0
    age_slope: float = 0.0
    min_age: float = 0.0
    female: float = 1.0
    male: float = 1.0
    links: tuple[Link, ...] = ()
    record: float = 0.5
    followup: str = ""
    record_years: float = math.inf
    treatment: str = ""
    """Code recorded (probability 0.7) at visits in the first ``TREATMENT_YEARS`` after onset."""
    death_mult: float = 1.0
    death_early: float = 0.0
    death_tau: float = 1.0
    """Mortality multiplier while present: ``death_mult + death_early * exp(-years_since_onset / tau)``."""


@dataclass(frozen=True)
class Acute:
    """An acute problem: per-visit probability, boosted right after a previous episode.

    P(code at a visit) = b + (1 - b) * ``amp`` * exp(-days_since_last_episode / ``tau_days``), where
    b = ``base`` x age profile x sex multiplier x boosts of present conditions (capped at 0.9), and zero
    unless the patient has ``requires`` (when set).
    """

    code: str
    name: str
    base: float
    profile: str
    amp: float
    tau_days: float
    female: float = 1.0
    requires: str = ""
    boosts: tuple[tuple[str, float], ...] = field(default=())


# fmt: off
# The catalogue tables read best one entry per line, so the formatter leaves them alone.
CONDITIONS: tuple[Condition, ...] = (  # parents before children
    Condition("E66.9", "obesity", 0.005, 0.0, 5, record=0.3),
    Condition("I10", "essential hypertension", 0.012, 0.045, 18, record=0.6, links=(Link("E66.9", 0.01),)),
    Condition("E78.5", "hyperlipidaemia", 0.009, 0.03, 20, record=0.45),
    Condition("O24.4", "gestational diabetes (onset set by pregnancy)", record=0.8, record_years=0.6),
    Condition("E11.9", "type 2 diabetes", 0.0035, 0.035, 20, record=0.7,
              links=(Link("E66.9", 0.004), Link("O24.4", 0.05, delay=1, ramp=5))),
    Condition("E11.3", "diabetic retinopathy", record=0.5, links=(Link("E11.9", 0.07, delay=2, ramp=6),)),
    Condition("E11.4", "diabetic neuropathy", record=0.5, links=(Link("E11.9", 0.05, delay=3, ramp=6),)),
    Condition("E11.2", "diabetic nephropathy", record=0.6, links=(Link("E11.9", 0.06, delay=3, ramp=6),)),
    Condition("N18.3", "chronic kidney disease stage 3", 0.001, 0.07, 30, record=0.6,
              links=(Link("E11.2", 0.10, delay=0.5, ramp=3), Link("I10", 0.008, delay=5, ramp=10))),
    Condition("N18.4", "CKD stage 4", record=0.7, links=(Link("N18.3", 0.06, 2, 4),), death_mult=1.5),
    Condition("N18.5", "CKD stage 5", record=0.8, links=(Link("N18.4", 0.12, 1, 3),), death_mult=2.0),
    Condition("Z99.2", "dependence on dialysis", record=0.9, links=(Link("N18.5", 0.4, 0, 1),),
              death_mult=1.5),
    Condition("I25.1", "atherosclerotic heart disease", 0.0015, 0.06, 30, male=1.8, record=0.55,
              links=(Link("I10", 0.012, 3, 8), Link("E78.5", 0.008, 3, 10), Link("E11.9", 0.008, 3, 8))),
    Condition("I21.9", "acute myocardial infarction", 0.0004, 0.07, 30, male=1.8, record=0.5,
              followup="I25.2", links=(Link("I25.1", 0.02),), death_mult=1.3, death_early=8.0, death_tau=0.1),
    Condition("I50.9", "heart failure", 0.0005, 0.08, 40, record=0.65,
              links=(Link("I10", 0.015, 6, 8), Link("I21.9", 0.05)), death_mult=2.0),
    Condition("I48", "atrial fibrillation", 0.001, 0.08, 40, record=0.55,
              links=(Link("I10", 0.004), Link("I50.9", 0.04))),
    Condition("I63.9", "cerebral infarction", 0.0006, 0.08, 40, record=0.3, followup="I69.3",
              links=(Link("I48", 0.025), Link("I10", 0.006, 5, 10)),
              death_mult=1.5, death_early=4.0, death_tau=0.2),
    Condition("J45.9", "asthma", 0.0006, -0.05, record=0.45),
    Condition("J44.9", "chronic obstructive pulmonary disease", 0.0015, 0.06, 40, record=0.6, death_mult=1.3),
    Condition("J96.1", "chronic respiratory failure", record=0.7, links=(Link("J44.9", 0.06, 4, 6),),
              death_mult=2.0),
    Condition("F32.9", "depressive episode", 0.0025, -0.005, 12, female=1.8, record=0.45),
    Condition("F41.1", "generalised anxiety disorder", 0.002, -0.01, 10, female=1.5, record=0.4),
    Condition("G43.9", "migraine", 0.0012, -0.03, 10, female=2.5, record=0.3),
    Condition("K21.9", "gastro-oesophageal reflux disease", 0.004, 0.01, 15, record=0.35),
    Condition("E03.9", "hypothyroidism", 0.0008, 0.02, 15, female=4.0, record=0.45),
    Condition("M17.9", "knee osteoarthritis", 0.004, 0.05, 35, record=0.35, links=(Link("E66.9", 0.006),)),
    Condition("M81.0", "postmenopausal osteoporosis", 0.0006, 0.08, 45, female=4.0, record=0.35),
    Condition("S72.0", "fracture of neck of femur", 0.0002, 0.10, 50, record=0.3, followup="Z96.6",
              links=(Link("M81.0", 0.025, 0, 6),), death_early=3.0, death_tau=0.5),
    Condition("F03", "dementia", 0.0002, 0.13, 55, record=0.65, death_mult=2.0),
    Condition("C34.9", "lung cancer", 0.0003, 0.08, 35, record=0.6, links=(Link("J44.9", 0.004),),
              treatment="Z51.1", death_mult=2.0, death_early=8.0, death_tau=1.5),
    Condition("C50.9", "breast cancer", 0.0015, 0.03, 25, male=0.0, record=0.5,
              treatment="Z51.1", death_mult=1.2, death_early=1.0, death_tau=2.0),
    Condition("C61", "prostate cancer", 0.0006, 0.09, 40, female=0.0, record=0.5,
              treatment="Z51.1", death_mult=1.2, death_early=0.5, death_tau=2.0),
    Condition("C18.9", "colon cancer", 0.0004, 0.07, 30, record=0.5,
              treatment="Z51.1", death_mult=1.5, death_early=3.0, death_tau=1.5),
)

ACUTE: tuple[Acute, ...] = (
    Acute("J06.9", "upper respiratory infection", 0.10, "child", 0.45, 30),
    Acute("J02.9", "pharyngitis", 0.04, "young", 0.35, 30),
    Acute("J01.9", "sinusitis", 0.025, "adult", 0.40, 60),
    Acute("J20.9", "acute bronchitis", 0.035, "flat", 0.40, 45, boosts=(("J44.9", 2.5), ("J45.9", 2.0))),
    Acute("J18.9", "pneumonia", 0.012, "elderly", 0.35, 60, boosts=(("J44.9", 3.0), ("F03", 2.0))),
    Acute("J44.1", "COPD exacerbation", 0.15, "flat", 0.50, 60, requires="J44.9"),
    Acute("J46", "acute severe asthma", 0.06, "flat", 0.45, 45, requires="J45.9"),
    Acute("H66.9", "otitis media", 0.07, "child", 0.50, 40),
    Acute("H10.9", "conjunctivitis", 0.015, "child", 0.30, 20),
    Acute("A09", "gastroenteritis", 0.03, "flat", 0.30, 20),
    Acute("B34.9", "viral infection", 0.035, "child", 0.30, 20),
    Acute("N39.0", "urinary tract infection", 0.02, "flat", 0.45, 60, female=3.0,
          boosts=(("E11.9", 1.8), ("F03", 2.0))),
    Acute("L03.1", "cellulitis of limb", 0.01, "elderly", 0.40, 60, boosts=(("E11.9", 2.0), ("E66.9", 1.5))),
    Acute("L30.9", "dermatitis", 0.025, "flat", 0.40, 90),
    Acute("M54.5", "low back pain", 0.05, "adult", 0.50, 90, boosts=(("E66.9", 1.5),)),
    Acute("R51", "headache", 0.025, "adult", 0.30, 60, boosts=(("G43.9", 3.0),)),
    Acute("K29.7", "gastritis", 0.015, "adult", 0.30, 60),
    Acute("R10.4", "abdominal pain", 0.025, "flat", 0.30, 30),
    Acute("S93.4", "ankle sprain", 0.012, "young", 0.25, 30),
    Acute("S52.5", "fracture of lower end of radius", 0.005, "flat", 0.35, 42, boosts=(("M81.0", 3.0),)),
    Acute("K59.0", "constipation", 0.015, "elderly", 0.40, 60),
    Acute("E16.2", "hypoglycaemia", 0.04, "flat", 0.35, 45, requires="E11.9"),
    Acute("I20.9", "angina pectoris", 0.08, "flat", 0.45, 60, requires="I25.1"),
)

NOISE: tuple[tuple[str, float], ...] = (  # (code, relative weight): drawn regardless of history
    ("Z00.0", 8), ("Z23", 6), ("Z76.0", 6), ("R05", 5), ("R53", 4), ("M25.5", 4), ("R42", 3),
    ("R07.4", 3), ("R11", 3), ("R50.9", 3), ("M79.6", 3), ("G47.0", 3), ("R19.7", 2), ("R21", 2),
    ("R06.0", 2), ("K30", 2), ("H61.2", 2), ("D64.9", 2), ("E55.9", 2), ("Z71.3", 2), ("Z02.7", 2),
    ("H52.1", 2), ("R52", 2), ("Z01.0", 2), ("L60.0", 1),
)
# fmt: on

AGE_PROFILES: dict[str, Callable[[np.ndarray], np.ndarray]] = {  # multipliers of an acute base rate
    "flat": lambda age: np.ones_like(age),
    "child": lambda age: 0.3 + 2.7 * np.exp(-age / 7.0),
    "young": lambda age: 0.4 + 1.6 * np.exp(-(((age - 20.0) / 12.0) ** 2)),
    "adult": lambda age: 0.3 + 0.9 * np.exp(-(((age - 45.0) / 20.0) ** 2)),
    "elderly": lambda age: np.minimum(4.0, 0.25 + 0.75 * np.exp((age - 60.0) / 20.0)),
}
AGE_PROFILE_FORMULAS = {
    "flat": "1",
    "child": "0.3 + 2.7 exp(-age/7)",
    "young": "0.4 + 1.6 exp(-((age-20)/12)^2)",
    "adult": "0.3 + 0.9 exp(-((age-45)/20)^2)",
    "elderly": "min(4, 0.25 + 0.75 exp((age-60)/20))",
}

# Visits.
GAP_SHAPE = 1.5  # gamma shape of routine gaps: more regular than exponential, still right-skewed
RATE_SHAPE = 2.0  # gamma shape of the patient-specific rate multiplier (mean 1)
CHRONIC_VISIT_BOOST = 0.15  # each present condition adds this share to the routine visit rate
FOLLOWUP_MIN_DAYS, FOLLOWUP_MEAN_DAYS = 3.0, 11.0  # follow-up gap: minimum + exponential
TREATMENT_YEARS, TREATMENT_RECORD = 0.5, 0.7  # cancer treatment window and per-visit record probability
TREATMENT_MIN_DAYS, TREATMENT_MEAN_DAYS = 14.0, 7.0  # treatment-cycle gap: minimum + exponential
# Death (Gompertz) and the visit on the day of death.
DEATH_A, DEATH_B = 2e-5, 0.09  # hazard per year = A * exp(B * age) x condition multipliers
DEATH_MULT_CAP = 6.0  # the multipliers compound; a cap keeps multimorbid patients from dying at once
TERMINAL_VISIT_PROBABILITY = 0.4
TERMINAL: tuple[tuple[str, float], ...] = (("I46.9", 3), ("R57.9", 2), ("J96.0", 2))
# Pregnancy.
PREGNANCY_PEAK_RATE, PREGNANCY_PEAK_AGE, PREGNANCY_WIDTH = 0.15, 29.0, 6.0  # per year, Gaussian in age
PREGNANCY_MIN_AGE, PREGNANCY_MAX_AGE, PREGNANCY_SPACING_DAYS = 16.0, 45.0, 365.0
PREGNANCY_DAYS = (180, 230)  # detection to delivery, uniform
PRENATAL_GAP_DAYS = (28, 42)  # at most this long between prenatal visits, uniform
PRENATAL_RECORD, GDM_PER_VISIT, GDM_OBESE_MULT = 0.85, 0.04, 2.0
PREGNANCY, VAGINAL, CAESAREAN, LIVE_BIRTH = "Z34.9", "O80", "O82", "Z37.0"
CAESAREAN_SHARE, LIVE_BIRTH_RECORD = 0.25, 0.7
GDM = "O24.4"


class _Catalogue:
    """The catalogue as index arrays: codes sorted, so sorting by code index sorts codes alphabetically."""

    def __init__(self) -> None:
        conds, acute = CONDITIONS, ACUTE
        every = {c.code for c in conds} | {c.followup for c in conds} | {c.treatment for c in conds}
        every |= {a.code for a in acute} | {c for c, _ in NOISE} | {c for c, _ in TERMINAL}
        every |= {PREGNANCY, VAGINAL, CAESAREAN, LIVE_BIRTH}
        self.codes = np.array(sorted(every - {""}))
        self.index = {code: i for i, code in enumerate(self.codes)}
        cidx = {c.code: i for i, c in enumerate(conds)}
        self.cond_idx = cidx
        self.dx = self._ids(c.code for c in conds)
        self.followup = self._ids(c.followup or c.code for c in conds)
        self.treatment = np.array([self.index.get(c.treatment, -1) for c in conds])
        self.rate50 = np.array([c.rate50 for c in conds])
        self.slope = np.array([c.age_slope for c in conds])
        self.min_age = np.array([c.min_age for c in conds])
        self.sex_mult = np.array([[c.male for c in conds], [c.female for c in conds]])  # [is_female, C]
        self.record = np.array([c.record for c in conds])
        self.record_years = np.array([c.record_years for c in conds])
        self.death = np.array([[c.death_mult, c.death_early, c.death_tau] for c in conds]).T
        links = [(cidx[link.parent], child, link) for child, c in enumerate(conds) for link in c.links]
        self.link_parent = np.array([p for p, _, _ in links], dtype=np.int64)
        self.link_rate = np.array([lk.rate for _, _, lk in links])
        self.link_delay = np.array([lk.delay for _, _, lk in links])
        self.link_ramp = np.array([lk.ramp for _, _, lk in links])
        # Links are grouped by child, so per-child sums are one reduceat (small matmuls are slow in BLAS).
        link_child = np.array([c for _, c, _ in links], dtype=np.int64)
        self.linked_child, self.link_start = np.unique(link_child, return_index=True)
        self.acute = self._ids(a.code for a in acute)
        self.acute_base = np.array([a.base for a in acute])
        self.acute_amp = np.array([a.amp for a in acute])
        self.acute_tau = np.array([a.tau_days for a in acute])
        self.acute_female = np.array([a.female for a in acute])
        self.acute_profile = [a.profile for a in acute]
        self.acute_requires = np.array([cidx[a.requires] if a.requires else -1 for a in acute])
        self.boosts = [(cidx[parent], j, mult) for j, a in enumerate(acute) for parent, mult in a.boosts]
        self.noise = self._ids(c for c, _ in NOISE)
        self.noise_p = _normalised([w for _, w in NOISE])
        self.terminal = self._ids(c for c, _ in TERMINAL)
        self.terminal_p = _normalised([w for _, w in TERMINAL])
        self.treated = self.treatment >= 0

    def _ids(self, codes: Iterable[str]) -> np.ndarray:
        return np.array([self.index[c] for c in codes], dtype=np.int64)


def _normalised(weights: list[float]) -> np.ndarray:
    w = np.asarray(weights, dtype=float)
    return np.asarray(w / w.sum())


def catalogue_codes() -> list[str]:
    """Every code the generator can write, sorted.

    >>> codes = catalogue_codes()
    >>> 60 <= len(codes) <= 120, "E11.9" in codes, "N18.3" in codes
    (True, True, True)
    """
    return [str(c) for c in _Catalogue().codes]


def catalogue_markdown() -> str:
    """The catalogue as Markdown tables; ``README.md`` embeds exactly this text (a test checks it)."""
    lines = [
        "| code | condition | rate50 /yr | age slope /yr | min age | F x | M x | parents: rate /yr (ramp in y)"
        " | record | other codes | death x |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in CONDITIONS:
        links = "; ".join(f"`{lk.parent}`: {lk.rate:g} ({_ramp_text(lk)})" for lk in c.links)
        death = f"{c.death_mult:g}" + (f" + {c.death_early:g} exp(-t/{c.death_tau:g})" if c.death_early else "")
        record = f"{c.record:g}" + (f" (< {c.record_years:g} y)" if math.isfinite(c.record_years) else "")
        follow = [f"`{c.followup}`"] * bool(c.followup)
        follow += [f"treatment `{c.treatment}` (< {TREATMENT_YEARS:g} y)"] * bool(c.treatment)
        lines.append(
            f"| `{c.code}` | {c.name} | {c.rate50:g} | {c.age_slope:g} | {c.min_age:g} | {c.female:g}"
            f" | {c.male:g} | {links} | {record} | {', '.join(follow)} | {death} |"
        )
    lines += [
        "",
        "| code | acute problem | base | age profile | F x | amp | tau (days) | needs / boosts |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for a in ACUTE:
        boosts = ", ".join([f"needs `{a.requires}`"] * bool(a.requires) + [f"`{p}` x{m:g}" for p, m in a.boosts])
        lines.append(
            f"| `{a.code}` | {a.name} | {a.base:g} | {a.profile} | {a.female:g} | {a.amp:g} | {a.tau_days:g}"
            f" | {boosts} |"
        )
    total = sum(w for _, w in NOISE)
    lines += ["", "| noise code | share |", "|---|---|"]
    lines += [f"| `{code}` | {w / total:.3f} |" for code, w in NOISE]
    lines += ["", "| age profile | multiplier (age in years) |", "|---|---|"]
    lines += [f"| {name} | {formula} |" for name, formula in AGE_PROFILE_FORMULAS.items()]
    lines += ["", "| constant | value |", "|---|---|"]
    lines += [f"| `{name}` | {value} |" for name, value in _constants().items()]
    return "\n".join(lines) + "\n"


def _ramp_text(link: Link) -> str:
    if link.delay == 0 and link.ramp == 0:
        return "constant"
    if link.ramp == 0:
        return f"step at {link.delay:g}"
    return f"0 until {link.delay:g}, full at {link.delay + link.ramp:g}"


def _constants() -> dict[str, object]:
    names = (
        "GAP_SHAPE RATE_SHAPE CHRONIC_VISIT_BOOST FOLLOWUP_MIN_DAYS FOLLOWUP_MEAN_DAYS TREATMENT_YEARS"
        " TREATMENT_RECORD TREATMENT_MIN_DAYS TREATMENT_MEAN_DAYS DEATH_A DEATH_B DEATH_MULT_CAP"
        " TERMINAL_VISIT_PROBABILITY TERMINAL PREGNANCY_PEAK_RATE PREGNANCY_PEAK_AGE PREGNANCY_WIDTH"
        " PREGNANCY_MIN_AGE PREGNANCY_MAX_AGE PREGNANCY_SPACING_DAYS PREGNANCY_DAYS PRENATAL_GAP_DAYS"
        " PRENATAL_RECORD GDM_PER_VISIT GDM_OBESE_MULT CAESAREAN_SHARE LIVE_BIRTH_RECORD"
    )
    return {name: globals()[name] for name in names.split()}


# -------------------------------------------------------------------------------------------------------------
# Generation
# -------------------------------------------------------------------------------------------------------------
def generate(cfg: SynthConfig) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Simulate ``cfg.patients`` histories; return the ``(patients, events)`` tables of the visits format.

    patients: ``patient_id``, ``birth_date`` (ISO), ``sex`` (F/M), ``death_date`` (ISO, missing if alive at
    the end of the window). events: ``patient_id``, ``date`` (ISO), ``code``, ``visit_id``, sorted by
    patient, date and code, except ``cfg.corrupt_fraction`` extra bad rows scattered among them.
    """
    rng = np.random.default_rng(cfg.seed)
    if cfg.process == "recurrence":
        from synthetic_data.recurrence import generate_recurrence

        patients, events = generate_recurrence(cfg)
    elif cfg.process == "progression":
        from synthetic_data.progression import generate_progression

        patients, events = generate_progression(cfg)
    else:
        sim = _Simulation(cfg, rng, _Catalogue())
        sim.burn_in()
        sim.run_visits()
        patients, events = sim.tables()
    if cfg.corrupt_fraction > 0:
        patients, events = corrupt(rng, patients, events, cfg.corrupt_fraction)
    return patients, events


class _EventLog:
    """Growing columns (patient index, visit number, day, code index) of the emitted events."""

    def __init__(self) -> None:
        self.parts: list[tuple[np.ndarray, ...]] = []

    def add(self, patient: np.ndarray, visit: int, day: np.ndarray, code: np.ndarray) -> None:
        if patient.size:
            self.parts.append((patient, np.full(patient.size, visit), day, code))

    def add_matrix(self, idx: np.ndarray, visit: int, day: np.ndarray, hits: np.ndarray, codes: np.ndarray):
        """Add ``codes[j]`` for patient ``idx[i]`` wherever ``hits[i, j]``."""
        rows, cols = np.nonzero(hits)
        self.add(idx[rows], visit, day[rows], codes[cols])

    def columns(self) -> tuple[np.ndarray, ...]:
        if not self.parts:
            return tuple(np.zeros(0, dtype=np.int64) for _ in range(4))
        return tuple(np.concatenate([p[k] for p in self.parts]) for k in range(4))


class _Simulation:
    """State of every patient, advanced one visit at a time for all still-observed patients at once."""

    def __init__(self, cfg: SynthConfig, rng: np.random.Generator, cat: _Catalogue) -> None:
        n = cfg.patients
        self.cfg, self.rng, self.cat = cfg, rng, cat
        self.start, self.end = _parse_day(cfg.start, "start"), _parse_day(cfg.end, "end")
        age0 = rng.uniform(0.0, cfg.max_age, n)
        self.birth = self.start - np.ceil(age0 * DAYS_PER_YEAR).astype(np.int64)
        self.female = rng.random(n) < 0.51
        self.rate = cfg.visit_rate * rng.gamma(RATE_SHAPE, 1.0 / RATE_SHAPE, n)
        self.onset = np.full((n, len(CONDITIONS)), np.nan)  # day of onset
        self.last_acute = np.full((n, len(ACUTE)), np.nan)  # day of the last recorded episode
        self.t_prev = np.full(n, self.start, dtype=np.int64)
        self.active = np.ones(n, dtype=bool)
        self.death = np.full(n, -1, dtype=np.int64)
        self.had_acute = np.zeros(n, dtype=bool)
        self.due = np.full(n, np.nan)  # delivery day of an ongoing pregnancy
        self.last_delivery = np.full(n, -np.inf)
        self.log = _EventLog()

    # --- hazards ------------------------------------------------------------------------------------------
    def onset_hazard(self, idx: np.ndarray, day: np.ndarray, age: np.ndarray) -> np.ndarray:
        """Onset hazard per year of every condition, [patients, conditions], given the state before ``day``."""
        cat = self.cat
        own = self.own_onset_hazard(idx, age)
        years = (day[:, None] - self.onset[idx][:, cat.link_parent]) / DAYS_PER_YEAR
        ramp = np.nan_to_num(_ramp(years, cat.link_delay, cat.link_ramp), nan=0.0)
        own[:, cat.linked_child] += np.add.reduceat(ramp * cat.link_rate, cat.link_start, axis=1)
        return np.asarray(own)

    def own_onset_hazard(self, idx: np.ndarray, age: np.ndarray) -> np.ndarray:
        """Onset hazard per year of every condition from age and sex alone (no parent conditions), [patients,
        conditions]."""
        cat = self.cat
        own = cat.rate50 * np.exp(cat.slope * (age[:, None] - 50.0)) * (age[:, None] >= cat.min_age)
        return np.asarray(own * cat.sex_mult[self.female[idx].astype(np.int64)])

    def death_hazard(self, idx: np.ndarray, day: np.ndarray) -> np.ndarray:
        """Death hazard per year: Gompertz in age times the multipliers of present conditions."""
        age = (day - self.birth[idx]) / DAYS_PER_YEAR
        years = (day[:, None] - self.onset[idx]) / DAYS_PER_YEAR
        mult_const, mult_early, tau = self.cat.death
        mult = mult_const + mult_early * np.exp(-np.maximum(years, 0.0) / tau)
        mult = np.where(np.isnan(years), 1.0, mult)
        return np.asarray(DEATH_A * np.exp(DEATH_B * age) * np.minimum(mult.prod(axis=1), DEATH_MULT_CAP))

    # --- burn-in: life before the window ------------------------------------------------------------------
    def burn_in(self) -> None:
        """Give each patient the conditions begun before the window, one year of age per step."""
        age0 = (self.start - self.birth) / DAYS_PER_YEAR
        for year in range(math.ceil(age0.max())):
            idx = np.flatnonzero(age0 > year)
            step = np.minimum(1.0, age0[idx] - year)
            day = self.birth[idx] + year * DAYS_PER_YEAR
            hazard = self.onset_hazard(idx, day, year + step / 2)
            new = np.isnan(self.onset[idx]) & (self.rng.random(hazard.shape) < -np.expm1(-hazard * step[:, None]))
            rows, cols = np.nonzero(new)
            when = np.floor(day[rows] + self.rng.random(rows.size) * step[rows] * DAYS_PER_YEAR)
            self.onset[idx[rows], cols] = np.minimum(when, self.start - 1)

    # --- the observation window ---------------------------------------------------------------------------
    def run_visits(self, after_visit: Callable[[int, np.ndarray], None] | None = None) -> None:
        """Advance every observed patient to their next visit until all have died, left the window or hit
        ``max_visits``. ``after_visit(visit, patients)``, when given, sees the state right after each round
        of regular visits (used by ``synthetic_data.oracle`` to capture states)."""
        for visit in range(self.cfg.max_visits):
            idx = np.flatnonzero(self.active)
            if idx.size == 0:
                break
            gap = self.next_gap(idx, first=visit == 0)
            idx, gap = self.deaths(idx, gap, visit)
            day = self.t_prev[idx] + gap
            inside = day <= self.end
            self.active[idx[~inside]] = False
            idx, gap, day = idx[inside], gap[inside], day[inside]
            self.visit(idx, gap, day, visit)
            self.t_prev[idx] = day
            if after_visit is not None:
                after_visit(visit, idx)

    def next_gap(self, idx: np.ndarray, first: bool) -> np.ndarray:
        """Days from the previous visit (or the window start) to the next one."""
        rng, m = self.rng, idx.size
        t = self.t_prev[idx]
        age = (t - self.birth[idx]) / DAYS_PER_YEAR
        present = self.onset[idx] <= t[:, None]
        rate = self.rate[idx] * _age_visit_factor(age) * (1.0 + CHRONIC_VISIT_BOOST * present.sum(axis=1))
        mean = DAYS_PER_YEAR / rate
        if first:  # a residual gap: the window opens at a random point of each patient's visit cycle
            return np.floor(rng.random(m) * mean).astype(np.int64)
        gap = rng.gamma(GAP_SHAPE, mean / GAP_SHAPE)
        followup = self.had_acute[idx] & (rng.random(m) < self.cfg.followup_probability)
        gap = np.where(followup, FOLLOWUP_MIN_DAYS + rng.exponential(FOLLOWUP_MEAN_DAYS, m), gap)
        treated = self.in_treatment(idx, t)
        gap = np.where(treated, np.minimum(gap, TREATMENT_MIN_DAYS + rng.exponential(TREATMENT_MEAN_DAYS, m)), gap)
        pregnant = ~np.isnan(self.due[idx])
        prenatal = rng.uniform(*PRENATAL_GAP_DAYS, m)
        gap = np.where(pregnant, np.minimum(np.minimum(gap, prenatal), self.due[idx] - t), gap)
        return np.maximum(1, np.rint(gap)).astype(np.int64)

    def in_treatment(self, idx: np.ndarray, day: np.ndarray) -> np.ndarray:
        """Whether each patient is inside a cancer's treatment window on ``day``."""
        years = (day[:, None] - self.onset[idx][:, self.cat.treated]) / DAYS_PER_YEAR
        return np.asarray(((years >= 0) & (years < TREATMENT_YEARS)).any(axis=1))

    def deaths(self, idx: np.ndarray, gap: np.ndarray, visit: int) -> tuple[np.ndarray, np.ndarray]:
        """Draw deaths before the next visit; record them and return the survivors."""
        t = self.t_prev[idx]
        p = -np.expm1(-self.death_hazard(idx, t) * gap / DAYS_PER_YEAR)
        dies = self.rng.random(idx.size) < p
        day = t + 1 + np.floor(self.rng.random(idx.size) * gap).astype(np.int64)
        day = np.minimum(day, t + gap)
        dead = dies & (day <= self.end)  # a death after the window is censored, like any later event
        self.death[idx[dead]] = day[dead]
        self.active[idx[dies]] = False
        self.terminal_visit(idx[dead], day[dead], visit)
        return idx[~dies], gap[~dies]

    def terminal_visit(self, idx: np.ndarray, day: np.ndarray, visit: int) -> None:
        """Some deaths happen in care: a last visit on the day of death, with a cause code and the problem list."""
        keep = self.rng.random(idx.size) < TERMINAL_VISIT_PROBABILITY
        idx, day = idx[keep], day[keep]
        cause = self.rng.choice(self.cat.terminal, size=idx.size, p=self.cat.terminal_p)
        self.log.add(idx, visit, day, cause)
        present = self.onset[idx] <= day[:, None]
        hits = present & (self.rng.random(present.shape) < self.cat.record)
        self.log.add_matrix(idx, visit, day, hits, self.cat.followup)

    def visit(self, idx: np.ndarray, gap: np.ndarray, day: np.ndarray, visit: int) -> None:
        """One visit for each patient in ``idx``: new diagnoses, pregnancy, recorded problems, noise."""
        before = len(self.log.parts)
        self.new_onsets(idx, gap, day)
        self.pregnancy(idx, gap, day, visit)
        self.record_conditions(idx, day, visit)
        self.acute(idx, day, visit)
        coded = np.zeros(self.active.size, dtype=bool)
        for part in self.log.parts[before:]:
            coded[part[0]] = True
        self.noise(idx, day, visit, ~coded[idx])

    def new_onsets(self, idx: np.ndarray, gap: np.ndarray, day: np.ndarray) -> None:
        """Conditions that began since the last visit; all hazards use the state before this visit."""
        age = (day - self.birth[idx]) / DAYS_PER_YEAR
        hazard = self.onset_hazard(idx, day, age)
        p = -np.expm1(-hazard * (gap / DAYS_PER_YEAR)[:, None])
        onset = self.onset[idx]
        new = np.isnan(onset) & (self.rng.random(p.shape) < p)
        self.onset[idx] = np.where(new, day[:, None], onset)

    def record_conditions(self, idx: np.ndarray, day: np.ndarray, visit: int) -> None:
        """Diagnosis code at the first visit after onset; later, the follow-up code at some visits."""
        cat, rng = self.cat, self.rng
        onset = self.onset[idx]
        years = (day[:, None] - onset) / DAYS_PER_YEAR
        new = onset == day[:, None]
        old = (onset < day[:, None]) & (years < cat.record_years)
        self.log.add_matrix(idx, visit, day, new, cat.dx)
        self.log.add_matrix(idx, visit, day, old & (rng.random(old.shape) < cat.record), cat.followup)
        treated = cat.treated & (years >= 0) & (years < TREATMENT_YEARS)
        hits = treated & (rng.random(treated.shape) < TREATMENT_RECORD)
        rows = np.flatnonzero(hits.any(axis=1))  # one treatment code per visit, whatever the cancer
        self.log.add(idx[rows], visit, day[rows], cat.treatment[hits[rows].argmax(axis=1)])

    def acute_chance(self, idx: np.ndarray, day: np.ndarray) -> np.ndarray:
        """(patients, acute codes) chance of each acute problem at a visit on ``day``: a base chance by age,
        sex and present conditions, plus a recurrence bump that fades with the time since the last episode."""
        cat = self.cat
        age = (day - self.birth[idx]) / DAYS_PER_YEAR
        profile = np.stack([AGE_PROFILES[name](age) for name in cat.acute_profile], axis=1)
        present = self.onset[idx] <= day[:, None]
        required = np.where(cat.acute_requires >= 0, present[:, np.maximum(cat.acute_requires, 0)], True)
        sex = np.where(self.female[idx, None], cat.acute_female, 1.0)
        base = cat.acute_base * profile * sex * required
        for cond, j, mult in cat.boosts:
            base[:, j] *= np.where(present[:, cond], mult, 1.0)
        base = np.minimum(0.9, base)
        since = day[:, None] - self.last_acute[idx]
        bump = np.nan_to_num(cat.acute_amp * np.exp(-since / cat.acute_tau), nan=0.0)
        return np.asarray(base + (1.0 - base) * bump)

    def acute(self, idx: np.ndarray, day: np.ndarray, visit: int) -> None:
        """Acute problems, drawn with :meth:`acute_chance`."""
        cat = self.cat
        hits = self.rng.random((idx.size, len(cat.acute))) < self.acute_chance(idx, day)
        self.last_acute[idx] = np.where(hits, day[:, None], self.last_acute[idx])
        self.had_acute[idx] = hits.any(axis=1)
        self.log.add_matrix(idx, visit, day, hits, cat.acute)

    def noise(self, idx: np.ndarray, day: np.ndarray, visit: int, empty: np.ndarray) -> None:
        """Background codes, Poisson per visit, at least one on a visit that has no other code."""
        count = self.rng.poisson(self.cfg.noise_codes_per_visit, idx.size)
        count = np.where(empty, np.maximum(count, 1), count)
        rows = np.repeat(np.arange(idx.size), count)
        codes = self.rng.choice(self.cat.noise, size=rows.size, p=self.cat.noise_p)
        self.log.add(idx[rows], visit, day[rows], codes)

    def pregnancy(self, idx: np.ndarray, gap: np.ndarray, day: np.ndarray, visit: int) -> None:
        """Deliveries due today, prenatal visits (with a chance of gestational diabetes), new pregnancies."""
        rng, index = self.rng, self.cat.index
        due = self.due[idx]
        delivered = due == day
        mode = np.where(rng.random(idx.size) < CAESAREAN_SHARE, index[CAESAREAN], index[VAGINAL])
        self.log.add(idx[delivered], visit, day[delivered], mode[delivered])
        born = delivered & (rng.random(idx.size) < LIVE_BIRTH_RECORD)
        self.log.add(idx[born], visit, day[born], np.full(born.sum(), index[LIVE_BIRTH]))
        self.due[idx[delivered]] = np.nan
        self.last_delivery[idx[delivered]] = day[delivered]
        self.prenatal(idx[due > day], day[due > day], visit)
        self.conceive(idx, gap, day, visit)

    def prenatal(self, idx: np.ndarray, day: np.ndarray, visit: int) -> None:
        rng, cat = self.rng, self.cat
        seen = rng.random(idx.size) < PRENATAL_RECORD
        self.log.add(idx[seen], visit, day[seen], np.full(seen.sum(), cat.index[PREGNANCY]))
        gdm, obese = cat.cond_idx[GDM], cat.cond_idx["E66.9"]
        p = GDM_PER_VISIT * np.where(self.onset[idx, obese] <= day, GDM_OBESE_MULT, 1.0)
        new = np.isnan(self.onset[idx, gdm]) & (rng.random(idx.size) < p)
        self.onset[idx[new], gdm] = day[new]

    def conceive(self, idx: np.ndarray, gap: np.ndarray, day: np.ndarray, visit: int) -> None:
        age = (day - self.birth[idx]) / DAYS_PER_YEAR
        able = self.female[idx] & (age >= PREGNANCY_MIN_AGE) & (age < PREGNANCY_MAX_AGE)
        able &= np.isnan(self.due[idx]) & (day - self.last_delivery[idx] >= PREGNANCY_SPACING_DAYS)
        rate = PREGNANCY_PEAK_RATE * np.exp(-(((age - PREGNANCY_PEAK_AGE) / PREGNANCY_WIDTH) ** 2))
        new = able & (self.rng.random(idx.size) < -np.expm1(-rate * gap / DAYS_PER_YEAR))
        length = self.rng.integers(PREGNANCY_DAYS[0], PREGNANCY_DAYS[1] + 1, idx.size)
        self.due[idx[new]] = day[new] + length[new]
        self.log.add(idx[new], visit, day[new], np.full(new.sum(), self.cat.index[PREGNANCY]))

    # --- output -------------------------------------------------------------------------------------------
    def tables(self) -> tuple[pd.DataFrame, pd.DataFrame]:
        """The simulated state as the visits-format tables."""
        return history_tables(self.cfg, self.birth, self.female, self.death, self.log, self.cat.codes)


def history_tables(
    cfg: SynthConfig, birth: np.ndarray, female: np.ndarray, death: np.ndarray, log: _EventLog, codes: np.ndarray
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The visits-format tables of a simulation: per patient ``birth`` and ``death`` days (-1: alive) and
    ``female``; the logged events, whose code indices point into ``codes``."""
    ids = pa.array(patient_ids(cfg.patients), pa.string())
    sex = pa.array(np.where(female, FEMALE, MALE).astype(object), pa.string())
    patients = pd.DataFrame(
        {
            PATIENT_ID: _text(ids),
            BIRTH_DATE: _text(_iso(birth)),
            SEX: _text(sex),
            DEATH_DATE: _text(_iso(death, mask=death < 0)),
        }
    )
    patient, visit, day, code = log.columns()
    order = np.lexsort((code, visit, patient))
    patient, visit, day, code = patient[order], visit[order], day[order], code[order]
    repeat = np.r_[False, (patient[1:] == patient[:-1]) & (visit[1:] == visit[:-1]) & (code[1:] == code[:-1])]
    patient, visit, day, code = patient[~repeat], visit[~repeat], day[~repeat], code[~repeat]
    new_visit = np.r_[True, (patient[1:] != patient[:-1]) | (visit[1:] != visit[:-1])]
    visit_number = np.cumsum(new_visit) - 1
    visits = pa.array(visit_ids(int(new_visit.sum())), pa.string())
    events = pd.DataFrame(
        {
            PATIENT_ID: _text(pc.take(ids, patient)),
            DATE: _text(_iso(day)),
            CODE: _text(pc.take(pa.array(codes.astype(object), pa.string()), code)),
            VISIT_ID: _text(pc.take(visits, visit_number)),
        }
    )
    return patients, events


# -------------------------------------------------------------------------------------------------------------
# Deliberate damage, for the ETL's quarantine
# -------------------------------------------------------------------------------------------------------------
BAD_DATES = ("2020-13-45", "2019-02-30", "not a date", "31/31/2020")
CORRUPT_KINDS = ("unparseable_date", "empty_code", "unknown_patient", "before_birth", "duplicate")


def corrupt(
    rng: np.random.Generator, patients: pd.DataFrame, events: pd.DataFrame, fraction: float
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Add ``fraction`` x len(events) bad event rows, split evenly over :data:`CORRUPT_KINDS` (at least one
    of each), scattered at random positions, and blank the birth date of one or two patients."""
    patients = patients.copy()
    blank = rng.choice(len(patients), size=min(len(patients), int(rng.integers(1, 3))), replace=False)
    patients.loc[patients.index[blank], BIRTH_DATE] = None
    if events.empty:
        return patients, events
    each = max(1, round(fraction * len(events) / len(CORRUPT_KINDS)))
    n_visits = events[VISIT_ID].nunique()
    fresh = iter(visit_ids(n_visits + 2 * each)[n_visits:])  # new visits for rows that leave their own
    bad = []
    for kind in CORRUPT_KINDS:
        rows = events.iloc[rng.integers(0, len(events), each)].copy()
        if kind == "unparseable_date":
            rows[DATE] = rng.choice(BAD_DATES, each)
        elif kind == "empty_code":
            rows[CODE] = ""
        elif kind == "unknown_patient":
            rows[PATIENT_ID] = patient_ids(len(patients) + each)[len(patients) :]
            rows[VISIT_ID] = [next(fresh) for _ in range(each)]
        elif kind == "before_birth":
            rows = _before_birth(rng, patients, events, each, [next(fresh) for _ in range(each)])
        bad.append(rows)
    extra = pd.concat(bad, ignore_index=True)
    key = np.r_[np.arange(len(events), dtype=float), rng.uniform(0, len(events), len(extra))]
    both = pd.concat([events, extra], ignore_index=True)
    return patients, both.iloc[np.argsort(key, kind="stable")].reset_index(drop=True)


def _before_birth(
    rng: np.random.Generator, patients: pd.DataFrame, events: pd.DataFrame, n: int, visits: list[str]
) -> pd.DataFrame:
    """``n`` copies of events of patients with a birth date, moved 1 day to 10 years before that birth."""
    births = patients.set_index(PATIENT_ID)[BIRTH_DATE].dropna()
    pool = events[events[PATIENT_ID].isin(births.index)]
    if pool.empty:
        return pool
    rows = pool.iloc[rng.integers(0, len(pool), n)].copy()
    birth = pd.to_datetime(births.loc[rows[PATIENT_ID]].to_numpy())
    offset = pd.to_timedelta(rng.integers(1, 3651, n), unit="D")
    rows[DATE] = np.asarray((birth - offset).strftime("%Y-%m-%d"), dtype=object)
    rows[VISIT_ID] = visits
    return rows


# -------------------------------------------------------------------------------------------------------------
# Small helpers
# -------------------------------------------------------------------------------------------------------------
def patient_ids(n: int) -> np.ndarray:
    """``P000001`` ... (at least six digits).

    >>> patient_ids(3).tolist()
    ['P000001', 'P000002', 'P000003']
    """
    width = max(6, len(str(n)))
    return np.array([f"P{i:0{width}d}" for i in range(1, n + 1)], dtype=object)


def visit_ids(n: int) -> np.ndarray:
    """``V00000001`` ..., unique over the whole table (at least eight digits)."""
    width = max(8, len(str(n)))
    return np.array([f"V{i:0{width}d}" for i in range(1, n + 1)], dtype=object)


def _ramp(years: np.ndarray, delay: np.ndarray, ramp: np.ndarray) -> np.ndarray:
    """0 before ``delay`` years, rising linearly to 1 at ``delay + ramp`` (a step when ``ramp`` is 0).

    >>> _ramp(np.array([0.0, 4.0, 6.0, 20.0]), np.array(2.0), np.array(4.0)).tolist()
    [0.0, 0.5, 1.0, 1.0]
    >>> _ramp(np.array([0.5, 1.0]), np.array(1.0), np.array(0.0)).tolist()
    [0.0, 1.0]
    """
    rising = np.clip((years - delay) / np.where(ramp > 0, ramp, 1.0), 0.0, 1.0)
    return np.asarray(np.where(ramp > 0, rising, years >= delay), dtype=float)


def _age_visit_factor(age: np.ndarray) -> np.ndarray:
    """Routine visit rate multiplier by age in years: infants and the old are seen more often."""
    return np.asarray(1.0 + 3.0 * np.exp(-age / 1.5) + 0.02 * np.maximum(age - 50.0, 0.0))


def _parse_day(text: str, name: str) -> int:
    """An ISO date as days since 1970-01-01."""
    try:
        day = dt.date.fromisoformat(text)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an ISO date like 2010-01-01, got {text!r}") from None
    return (day - dt.date(1970, 1, 1)).days


def _iso(days: np.ndarray, mask: np.ndarray | None = None) -> pa.Array:
    """Days since 1970-01-01 as ISO date strings (null where ``mask``)."""
    dates = pa.array(np.asarray(days, dtype=np.int64).astype("datetime64[D]"), mask=mask)
    return dates.cast(pa.string())


def _text(values: pa.Array) -> pd.Series:
    """An Arrow string array as a pandas text column (building it in Arrow is ~10x faster than Python)."""
    return pd.Series(values, dtype="str")
