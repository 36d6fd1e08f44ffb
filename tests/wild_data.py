"""Synthea-style test inputs as they come from the wild: MEDS exports in several code styles and OMOP CDM.

One seeded cohort (:func:`cohort`) of outpatient encounters (no hospital admissions) is written in either
layout, so the same patients can be read as MEDS and as OMOP. Conditions are SNOMED coded, with an ICD-10-CM
mapping for the ``ICD10CM/`` style; each encounter also carries labs and a medication (rows a diagnosis
reader must filter). Structure to learn: prediabetes is followed by type 2 diabetes, and chronic conditions
are recorded again at later visits. Plain functions, no fixtures: test modules wrap them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import meds
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from behrt_rope import schema as S

# SNOMED code, ICD-10-CM code, description, chronic
CONDITIONS = [
    ("44054006", "E11", "Type 2 diabetes mellitus", True),
    ("15777000", "R73.03", "Prediabetes", True),
    ("38341003", "I10", "Hypertension", True),
    ("55822004", "E78.5", "Hyperlipidemia", True),
    ("195967001", "J45", "Asthma", True),
    ("162864005", "E66.9", "Obesity", True),
    ("65363002", "H66.9", "Otitis media", False),
    ("444814009", "J01.90", "Viral sinusitis", False),
    ("10509002", "J20.9", "Acute bronchitis", False),
    ("271737000", "D64.9", "Anemia", False),
]
LABS = ["LOINC//4548-4", "LOINC//2339-0", "LOINC//8480-6", "LOINC//39156-5"]
MEDICATION = "RXNORM//860975"
ENCOUNTER_CLASSES = ["AMB", "AMB", "AMB", "EMER", "OUTPATIENT"]
CONCEPT_BASE = 4_000_000  # made-up OMOP concept ids: CONCEPT_BASE + index into CONDITIONS


@dataclass
class Cohort:
    """persons: id, birth, death (NaT); encounters: id, person, start (datetime), cls;
    conditions: person, encounter, time, index into CONDITIONS."""

    persons: pd.DataFrame
    encounters: pd.DataFrame
    conditions: pd.DataFrame


def cohort(n_patients: int = 200, seed: int = 0) -> Cohort:
    """A seeded outpatient cohort: 6-14 encounters per person over several years, 1-3 conditions each."""
    rng = np.random.default_rng(seed)
    ids = np.arange(1, n_patients + 1)
    birth = pd.to_datetime("1940-01-01") + pd.to_timedelta(rng.integers(0, 365 * 60, n_patients), unit="D")
    persons = pd.DataFrame({"id": ids, "birth": birth, "death": pd.NaT})
    encounters, conditions = [], []
    for pid, born in zip(ids, birth):
        start = born + pd.Timedelta(days=int(365 * rng.uniform(20, 40)))
        chronic: set[int] = set()
        for k in range(int(rng.integers(6, 15))):
            when = start + pd.Timedelta(days=int(k * 200 + rng.integers(0, 60)), hours=int(rng.integers(8, 17)))
            eid = len(encounters) + 1
            encounters.append((eid, pid, when, ENCOUNTER_CLASSES[int(rng.integers(0, len(ENCOUNTER_CLASSES)))]))
            found = {c for c in chronic if rng.random() < 0.7}
            if 1 in chronic and rng.random() < 0.5:
                found.add(0)  # prediabetes progresses to diabetes
            found |= set(rng.choice(len(CONDITIONS), size=int(rng.integers(1, 3)), replace=False).tolist())
            chronic |= {c for c in found if CONDITIONS[c][3]}
            conditions += [(pid, eid, when, c) for c in sorted(found)]
    return Cohort(
        persons,
        pd.DataFrame(encounters, columns=["id", "person", "start", "cls"]),
        pd.DataFrame(conditions, columns=["person", "encounter", "time", "condition"]),
    )


def meds_code(condition: int, style: str) -> str:
    """A condition's MEDS code in one of the styles seen in the wild.

    >>> meds_code(0, "snomed"), meds_code(0, "icd10cm"), meds_code(2, "snomed_ct")
    ('SNOMED//44054006', 'ICD10CM/E11', 'SNOMED-CT//38341003')
    """
    snomed, icd, _, _ = CONDITIONS[condition]
    return {"snomed": f"SNOMED//{snomed}", "icd10cm": f"ICD10CM/{icd}", "snomed_ct": f"SNOMED-CT//{snomed}"}[style]


def write_meds(root: Path, c: Cohort, style: str = "snomed", diagnoses: bool = True, parts: int = 2) -> Path:
    """``c`` as a MEDS dataset: ``parts`` data shards, a split file and code metadata with descriptions.

    ``style``: snomed (``SNOMED//44054006``, Synthea-derived), icd10cm (``ICD10CM/E11``, meds_etl) or
    snomed_ct. ``diagnoses=False`` leaves the conditions out (only births, encounters, labs, medications).
    Every table is checked against the ``meds`` package's schemas.
    """
    rows = [(p, b, meds.birth_code) for p, b in zip(c.persons["id"], c.persons["birth"])]
    rows += [
        (p, t, f"ENCOUNTER//{cls}")
        for p, t, cls in zip(c.encounters["person"], c.encounters["start"], c.encounters["cls"])
    ]
    for p, t in zip(c.encounters["person"], c.encounters["start"]):
        rows += [(p, t + pd.Timedelta(minutes=20), lab) for lab in LABS]
        rows.append((p, t + pd.Timedelta(minutes=30), MEDICATION))
    if diagnoses:
        rows += [
            (p, t, meds_code(k, style))
            for p, t, k in c.conditions[["person", "time", "condition"]].itertuples(index=False)
        ]
    frame = pd.DataFrame(rows, columns=[S.MEDS_SUBJECT_ID, S.MEDS_TIME, S.MEDS_CODE]).sort_values(
        [S.MEDS_SUBJECT_ID, S.MEDS_TIME], kind="stable"
    )
    frame["numeric_value"] = np.where(frame[S.MEDS_CODE].str.startswith("LOINC"), 5.5, np.nan)
    table = meds.DataSchema.align(
        pa.table(
            {
                S.MEDS_SUBJECT_ID: pa.array(frame[S.MEDS_SUBJECT_ID], pa.int64()),
                S.MEDS_TIME: pa.array(frame[S.MEDS_TIME].to_numpy("datetime64[us]"), pa.timestamp("us")),
                S.MEDS_CODE: pa.array(frame[S.MEDS_CODE], pa.string()),
                "numeric_value": pa.array(frame["numeric_value"], pa.float32()),
            }
        )
    )
    subject = frame[S.MEDS_SUBJECT_ID].to_numpy()
    (root / S.MEDS_DATA_DIR).mkdir(parents=True, exist_ok=True)
    (root / S.MEDS_SPLITS_FILE).parent.mkdir(parents=True, exist_ok=True)
    for i in range(parts):
        pq.write_table(table.filter(pa.array(subject % parts == i)), root / S.MEDS_DATA_DIR / f"{i}.parquet")
    ids = c.persons["id"].to_numpy()
    split = np.where(ids % 10 < 8, meds.train_split, np.where(ids % 10 == 8, meds.tuning_split, meds.held_out_split))
    splits = meds.SubjectSplitSchema.align(
        pa.table({S.MEDS_SUBJECT_ID: pa.array(ids, pa.int64()), S.MEDS_SPLIT: split})
    )
    pq.write_table(splits, root / S.MEDS_SPLITS_FILE)
    codes = [meds_code(k, style) for k in range(len(CONDITIONS))] if diagnoses else []
    metadata = meds.CodeMetadataSchema.align(
        pa.table(
            {
                S.MEDS_CODE: pa.array(codes + LABS, pa.string()),
                S.DESCRIPTION: pa.array([d for _, _, d, _ in CONDITIONS][: len(codes)] + ["lab"] * len(LABS)),
                "parent_codes": pa.array([[]] * (len(codes) + len(LABS)), pa.list_(pa.string())),
            }
        )
    )
    pq.write_table(metadata, root / S.MEDS_CODES_FILE)
    return root


def write_omop(root: Path, c: Cohort, concept_table: bool = True) -> Path:
    """``c`` as OMOP CDM Parquet tables; conditions carry SNOMED concept ids (made up) and source values."""
    root.mkdir(parents=True, exist_ok=True)
    born = pd.DatetimeIndex(c.persons["birth"])
    tables = {
        S.OMOP_PERSON: pd.DataFrame(
            {
                S.OMOP_PERSON_ID: c.persons["id"],
                S.OMOP_YEAR_OF_BIRTH: born.year,
                S.OMOP_MONTH_OF_BIRTH: born.month,
                S.OMOP_DAY_OF_BIRTH: born.day,
                S.OMOP_BIRTH_DATETIME: born,
            }
        ),
        S.OMOP_VISIT: pd.DataFrame(
            {
                S.OMOP_VISIT_OCCURRENCE_ID: c.encounters["id"],
                S.OMOP_PERSON_ID: c.encounters["person"],
                S.OMOP_VISIT_START_DATE: c.encounters["start"].dt.date,
                S.OMOP_VISIT_END_DATE: c.encounters["start"].dt.date,
            }
        ),
        S.OMOP_CONDITION: pd.DataFrame(
            {
                S.OMOP_PERSON_ID: c.conditions["person"],
                S.OMOP_CONDITION_CONCEPT_ID: CONCEPT_BASE + c.conditions["condition"],
                S.OMOP_CONDITION_START_DATE: c.conditions["time"].dt.date,
                S.OMOP_CONDITION_START_DATETIME: c.conditions["time"],
                S.OMOP_VISIT_OCCURRENCE_ID: c.conditions["encounter"],
                S.OMOP_CONDITION_SOURCE_VALUE: [CONDITIONS[k][0] for k in c.conditions["condition"]],
                S.OMOP_CONDITION_SOURCE_CONCEPT_ID: CONCEPT_BASE + c.conditions["condition"],
            }
        ),
    }
    if concept_table:
        tables[S.OMOP_CONCEPT] = pd.DataFrame(
            {
                S.OMOP_CONCEPT_ID: CONCEPT_BASE + np.arange(len(CONDITIONS)),
                S.OMOP_CONCEPT_NAME: [d for _, _, d, _ in CONDITIONS],
                "domain_id": "Condition",
                S.OMOP_VOCABULARY_ID: "SNOMED",
                "concept_class_id": "Clinical Finding",
                "standard_concept": "S",
                S.OMOP_CONCEPT_CODE: [s for s, _, _, _ in CONDITIONS],
            }
        )
    for name, frame in tables.items():
        pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), root / f"{name}.parquet")
    return root
