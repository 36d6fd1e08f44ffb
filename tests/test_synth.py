"""The synthetic cohort: format, determinism, invariants, the planted temporal structure, and ``synth``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

import numpy as np
import pandas as pd
import pytest

from behrt_rope import cli
from behrt_rope.config import ConfigError
from behrt_rope.schema import (
    BIRTH_DATE,
    CODE,
    DATE,
    DEATH_DATE,
    DONE_MARKER,
    EVENTS_TABLE,
    PATIENT_ID,
    PATIENTS_TABLE,
    SEX,
    VISIT_ID,
    VISITS_OPTIONAL,
    VISITS_REQUIRED,
)
from pipelines import synth as synth_pipeline
from synthetic_data import SynthConfig, catalogue_codes, generate
from synthetic_data.generator import ACUTE, catalogue_markdown

ICD10 = re.compile(r"^[A-Z]\d{2}(\.\d)?$")
DAY = pd.Timedelta(days=1)


@pytest.fixture(scope="module")
def small() -> tuple[pd.DataFrame, pd.DataFrame]:
    return generate(SynthConfig(patients=300, seed=7))


# Large and long enough to measure the planted rates: 25 years give many years after a diabetes onset.
COHORT = SynthConfig(patients=3000, seed=11, start="1996-01-01")


@pytest.fixture(scope="module")
def cohort() -> tuple[pd.DataFrame, pd.DataFrame]:
    return generate(COHORT)


def _dates(values: pd.Series) -> pd.Series:
    return pd.to_datetime(values, format="%Y-%m-%d", errors="coerce")


def _visits(events: pd.DataFrame) -> pd.DataFrame:
    """One row per visit (visit id, patient, date as a timestamp), ordered by patient and date."""
    visits = events.groupby(VISIT_ID, as_index=False).agg({PATIENT_ID: "first", DATE: "first"})
    visits[DATE] = _dates(visits[DATE])
    return visits.sort_values([PATIENT_ID, DATE], ignore_index=True)


# --- format ---------------------------------------------------------------------------------------------
def test_columns_match_the_visits_format(small):
    patients, events = small
    assert list(patients.columns) == [PATIENT_ID, BIRTH_DATE, SEX, DEATH_DATE]
    assert list(events.columns) == [PATIENT_ID, DATE, CODE, VISIT_ID]
    for table, frame in ((PATIENTS_TABLE, patients), (EVENTS_TABLE, events)):
        assert set(VISITS_REQUIRED[table]) <= set(frame.columns)
        assert set(frame.columns) <= set(VISITS_REQUIRED[table]) | set(VISITS_OPTIONAL[table])
        assert all(pd.api.types.is_string_dtype(frame[c]) for c in frame.columns)
    assert patients[PATIENT_ID].is_unique
    assert patients[PATIENT_ID].str.fullmatch(r"P\d{6}").all()
    assert set(patients[SEX]) == {"F", "M"}
    assert _dates(patients[BIRTH_DATE]).notna().all()
    alive = patients[DEATH_DATE].isna()
    assert 0 < alive.sum() < len(patients)
    assert _dates(patients.loc[~alive, DEATH_DATE]).notna().all()
    assert _dates(events[DATE]).notna().all()
    assert (events[CODE].str.len() > 0).all()
    assert set(events[PATIENT_ID]) <= set(patients[PATIENT_ID])


def test_a_visit_is_one_patient_on_one_day_without_repeated_codes(small):
    _, events = small
    per_visit = events.groupby(VISIT_ID).agg(patients=(PATIENT_ID, "nunique"), days=(DATE, "nunique"))
    assert (per_visit["patients"] == 1).all() and (per_visit["days"] == 1).all()
    assert not events.duplicated([VISIT_ID, CODE]).any()
    # a patient's visits fall on distinct days, so grouping by date instead of visit_id gives the same visits
    assert events.groupby([PATIENT_ID, DATE])[VISIT_ID].nunique().max() == 1


def test_codes_are_icd10_with_subcodes(small):
    _, events = small
    codes = pd.Series(events[CODE].unique())
    assert codes.str.fullmatch(ICD10).all()
    assert codes.str.contains(".", regex=False).sum() >= 10
    assert codes.str.fullmatch(r"[A-Z]\d{2}").sum() >= 10
    catalogue = catalogue_codes()
    assert 60 <= len(catalogue) <= 120 and all(ICD10.fullmatch(c) for c in catalogue)
    assert set(codes) <= set(catalogue)


def test_size_per_patient_and_per_visit(small):
    patients, events = small
    n_visits = events[VISIT_ID].nunique()
    assert 8 <= n_visits / len(patients) <= 16
    assert 2 <= len(events) / n_visits <= 4


# --- determinism ----------------------------------------------------------------------------------------
def test_same_seed_same_tables(small):
    again = generate(SynthConfig(patients=300, seed=7))
    pd.testing.assert_frame_equal(small[0], again[0])
    pd.testing.assert_frame_equal(small[1], again[1])


def test_different_seed_different_tables(small):
    other = generate(SynthConfig(patients=300, seed=8))
    assert not small[0].equals(other[0])
    assert not small[1].equals(other[1])


# --- invariants -----------------------------------------------------------------------------------------
def test_no_event_before_birth_after_death_or_outside_the_window(small):
    patients, events = small
    cfg = SynthConfig()
    joined = events.merge(patients, on=PATIENT_ID, validate="many_to_one")
    date = _dates(joined[DATE])
    assert (date >= _dates(joined[BIRTH_DATE])).all()
    died = joined[DEATH_DATE].notna()
    assert (date[died] <= _dates(joined.loc[died, DEATH_DATE])).all()
    assert date.min() >= pd.Timestamp(cfg.start) and date.max() <= pd.Timestamp(cfg.end)
    death = _dates(patients[DEATH_DATE].dropna())
    assert death.max() <= pd.Timestamp(cfg.end)
    age = (pd.Timestamp(cfg.start) - _dates(patients[BIRTH_DATE])).dt.days / 365.25
    assert age.min() >= 0 and age.max() <= cfg.max_age + 0.01 and age.max() > 80


# --- the planted structure ------------------------------------------------------------------------------
def test_complications_follow_time_since_diabetes_onset(cohort):
    """Among incident diabetics, first diabetic complications are far more frequent >= 4 years after the
    first E11.9 than within 2 years of it."""
    _, events = cohort
    events = events.assign(day=_dates(events[DATE]))
    visits = _visits(events)
    first_visit = visits.groupby(PATIENT_ID)[DATE].min()
    last_visit = visits.groupby(PATIENT_ID)[DATE].max()
    onset = events[events[CODE] == "E11.9"].groupby(PATIENT_ID)["day"].min()
    complication = events[events[CODE].isin(["E11.2", "E11.3", "E11.4"])].groupby(PATIENT_ID)["day"].min()
    incident = onset[onset - first_visit.reindex(onset.index) >= 365 * DAY]  # no diabetes at entry
    incident = incident[~(complication.reindex(incident.index) <= incident)]
    stop = complication.reindex(incident.index).fillna(last_visit.reindex(incident.index))
    years = (stop - incident).dt.days / 365.25
    event = complication.reindex(incident.index).notna()
    early_time = years.clip(upper=2.0).sum()
    early_events = (event & (years < 2.0)).sum()
    late_time = (years - 4.0).clip(lower=0).sum()
    late_events = (event & (years >= 4.0)).sum()
    assert len(incident) >= 150 and late_events >= 30
    early_rate = early_events / early_time  # ~0.005 per year: misread prevalent cases only
    late_rate = late_events / late_time  # ~0.12 per year
    assert late_rate > 5 * max(early_rate, 0.01), (early_rate, late_rate)


def test_acute_problems_recur_more_after_a_short_gap(cohort):
    """P(acute code at a visit | same code <= 30 days before) >> P(... | last episode > 1 year before)."""
    _, events = cohort
    visits = _visits(events)
    acute = [a.code for a in ACUTE]
    had = events[events[CODE].isin(acute)][[VISIT_ID, CODE]]
    short_hits = short_n = long_hits = long_n = 0
    for code in acute:
        flag = visits[VISIT_ID].isin(had.loc[had[CODE] == code, VISIT_ID])
        last = visits[DATE].where(flag).groupby(visits[PATIENT_ID]).shift(1)
        last = last.groupby(visits[PATIENT_ID]).ffill()
        gap = (visits[DATE] - last).dt.days
        short, long = gap <= 30, gap > 365
        short_hits, short_n = short_hits + (flag & short).sum(), short_n + short.sum()
        long_hits, long_n = long_hits + (flag & long).sum(), long_n + long.sum()
    assert short_n > 200 and long_n > 200
    assert short_hits / short_n > 3 * long_hits / long_n


def test_onsets_rise_with_age_and_chronic_codes_are_recorded_intermittently(cohort):
    patients, events = cohort
    start = pd.Timestamp(COHORT.start)
    age = (start - _dates(patients[BIRTH_DATE])).dt.days / 365.25
    early = events[(_dates(events[DATE]) < start + pd.DateOffset(years=3)) & (events[CODE] == "I10")]
    with_i10 = patients[PATIENT_ID].isin(early[PATIENT_ID])  # recorded in the first 3 years
    assert with_i10[age >= 65].mean() > 3 * with_i10[(age >= 20) & (age < 40)].mean()
    events = events.assign(day=_dates(events[DATE]))
    first = events[events[CODE] == "I10"].groupby(PATIENT_ID)["day"].min().rename("first")
    later = _visits(events).merge(first, left_on=PATIENT_ID, right_index=True)
    later = later[later[DATE] > later["first"]]
    recorded = later[VISIT_ID].isin(events.loc[events[CODE] == "I10", VISIT_ID]).mean()
    assert 0.4 < recorded < 0.8


# --- deliberate damage ----------------------------------------------------------------------------------
def test_corrupt_fraction_adds_every_kind_of_bad_row():
    _, clean = generate(SynthConfig(patients=300, seed=3))
    patients, events = generate(SynthConfig(patients=300, seed=3, corrupt_fraction=0.02))
    assert 1 <= patients[BIRTH_DATE].isna().sum() <= 2
    extra = len(events) - len(clean)
    assert extra >= 0.015 * len(clean)
    date = _dates(events[DATE])
    assert date.isna().sum() > 0
    assert events[DATE][date.isna()].isin(["2020-13-45", "not a date", "2019-02-30", "31/31/2020"]).all()
    assert (events[CODE].fillna("") == "").sum() > 0
    assert (~events[PATIENT_ID].isin(patients[PATIENT_ID])).sum() > 0
    assert events.duplicated().sum() > 0 and clean.duplicated().sum() == 0
    birth = events[PATIENT_ID].map(patients.set_index(PATIENT_ID)[BIRTH_DATE])
    assert (date < _dates(birth)).sum() > 0
    unknown_rows = np.flatnonzero(~events[PATIENT_ID].isin(patients[PATIENT_ID]))
    assert unknown_rows.min() < len(events) - extra  # scattered among the good rows, not appended


# --- config, pipeline and CLI ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "bad",
    [
        {"patients": 0},
        {"start": "2020-01-01", "end": "2019-01-01"},
        {"start": "yesterday"},
        {"corrupt_fraction": 1.5},
        {"file_format": "xlsx"},
    ],
)
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError):
        SynthConfig(**bad)


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_run_writes_both_tables(tmp_path: Path, fmt: Literal["csv", "parquet"]):
    config = synth_pipeline.Config(out=str(tmp_path / "cohort"), synth=SynthConfig(patients=40, file_format=fmt))
    out = synth_pipeline.run(config)
    assert out == tmp_path / "cohort" and (out / DONE_MARKER).exists()
    patients, events = generate(config.synth)
    if fmt == "csv":
        read_patients = pd.read_csv(out / f"{PATIENTS_TABLE}.csv", dtype=str)
        read_events = pd.read_csv(out / f"{EVENTS_TABLE}.csv", dtype=str)
    else:
        read_patients = pd.read_parquet(out / f"{PATIENTS_TABLE}.parquet")
        read_events = pd.read_parquet(out / f"{EVENTS_TABLE}.parquet")
    pd.testing.assert_frame_equal(read_patients, patients, check_dtype=False)
    pd.testing.assert_frame_equal(read_events, events, check_dtype=False)


def test_switching_format_leaves_one_format(tmp_path: Path):
    for fmt in ("csv", "parquet"):
        synth_pipeline.run(synth_pipeline.Config(out=str(tmp_path), synth=SynthConfig(patients=10, file_format=fmt)))
    assert sorted(p.name for p in tmp_path.glob("*.csv")) == []
    assert sorted(p.name for p in tmp_path.glob("*.parquet")) == ["events.parquet", "patients.parquet"]


def test_run_needs_an_output_directory():
    with pytest.raises(ConfigError, match="--out"):
        synth_pipeline.run(synth_pipeline.Config(out=" "))


def test_cli_synth(tmp_path: Path):
    out = tmp_path / "synth"
    assert cli.main(["synth", "--out", str(out), "--patients", "50", "--seed", "2"]) == 0
    patients = pd.read_csv(out / f"{PATIENTS_TABLE}.csv", dtype=str)
    assert len(patients) == 50
    assert (out / f"{EVENTS_TABLE}.csv").exists()
    assert cli.main(["synth", "--out", str(out), "synth.corrupt_fraction=nope"]) == 1


def test_readme_tells_the_generative_story_of_every_code():
    readme = (Path(__file__).resolve().parents[1] / "synthetic_data" / "README.md").read_text()
    assert catalogue_markdown() in readme, "README.md's tables are stale: paste catalogue_markdown() again"
    missing = [code for code in catalogue_codes() if f"`{code}`" not in readme]
    assert not missing, f"README.md does not describe {missing}"
