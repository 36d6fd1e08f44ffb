"""Settings of the ETL stage (``behrt-rope etl``); saved with its outputs and re-applied by ``predict``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from behrt_rope.etl.code_styles import DEFAULT_CODE_PATTERNS, DEFAULT_VOCABULARY_ALIASES
from behrt_rope.schema import SPLITS


@dataclass
class SplitConfig:
    """Deterministic patient-level split by a salted hash of the patient id."""

    train: float = 0.8
    """Share of patients in the train split."""
    tuning: float = 0.1
    """Share of patients in the tuning split (validation, early stopping)."""
    held_out: float = 0.1
    """Share of patients in the held_out split (the evaluation report)."""
    salt: str = "behrt-rope"
    """Text mixed into the hash; change it to draw a different split."""

    def __post_init__(self) -> None:
        shares = (self.train, self.tuning, self.held_out)
        if any(s < 0 for s in shares) or abs(sum(shares) - 1.0) > 1e-6:
            raise ValueError(f"split shares {dict(zip(SPLITS, shares))} must be >= 0 and sum to 1")


@dataclass
class MedsConfig:
    """How MEDS events become diagnosis tokens (``--format meds``)."""

    code_patterns: list[str] = field(default_factory=lambda: list(DEFAULT_CODE_PATTERNS))
    """Diagnosis code styles, tried in order, each TEMPLATE=REGEX: the regex (RE2) selects codes, its group
    ``code`` is the code and the template names the vocabulary from the other groups (docs/formats.md).
    The defaults read MIMIC-IV MEDS, meds_etl (ICD10CM/...) and Synthea-style (SNOMED//...) codes."""
    vocabulary_aliases: list[str] = field(default_factory=lambda: list(DEFAULT_VOCABULARY_ALIASES))
    """NAME=CANONICAL spellings of one vocabulary (SNOMED-CT=SNOMED), so that they give one token."""
    visit_rule: Literal["auto", "admission", "encounter", "same_time", "same_day"] = "auto"
    """What makes a visit: auto picks admission when the data has admission events, else encounter when it
    has encounter events, else same_day; or inside an admission, at an encounter, one timestamp, one day."""
    admission_prefix: str = "HOSPITAL_ADMISSION"
    """Code prefix of admission events (visit_rule=admission)."""
    discharge_prefix: str = "HOSPITAL_DISCHARGE"
    """Code prefix of discharge events (visit_rule=admission)."""
    encounter_prefixes: list[str] = field(default_factory=lambda: ["ENCOUNTER//", "VISIT//", "Visit/"])
    """Code prefixes of encounter (visit) events (visit_rule=encounter)."""
    birth_code: str = "MEDS_BIRTH"
    """Code of the birth event."""
    death_code: str = "MEDS_DEATH"
    """Code of the death event."""
    sex_prefixes: list[str] = field(default_factory=lambda: ["GENDER//", "SEX//", "Gender/", "Sex/"])
    """Code prefixes of a subject's sex (``GENDER//F``: MIMIC-IV MEDS; ``Gender/F``: meds_etl from OMOP); what
    follows the prefix is read as in the visits format's ``sex`` column (``behrt_rope/etl/sex.py``)."""


@dataclass
class OmopConfig:
    """How OMOP CDM tables become diagnosis tokens (``--format omop``)."""

    code_source: Literal["auto", "concept_id", "source_value"] = "auto"
    """auto: condition_concept_id when a concept table is there, else condition_source_value; or either."""
    vocabulary: str = ""
    """Vocabulary of codes the concept table does not name (source values without a known source concept,
    or concept ids without a concept table): SNOMED gives SNOMED/65363002; empty: the code alone."""
    skip_zero_concept: bool = True
    """Quarantine condition_concept_id 0 (OMOP's 'no matching concept') when code_source=concept_id."""


@dataclass
class EtlConfig:
    """From raw histories to the token dataset."""

    format: Literal["visits", "meds", "omop"] = "visits"
    """Input layout: our visits format, MEDS, or OMOP CDM."""
    code_truncate: int | None = None
    """Keep the first N characters of each code (dots removed first); BEHRT used 3 for ICD-10. null: keep."""
    strip_code_dots: bool = True
    """Remove '.' from codes (I10.0 and I100 are the same ICD-10 code)."""
    min_code_count: int = 1
    """Codes seen fewer times than this in the train split become [UNK]."""
    max_seq_len: int = 512
    """Longest token stream, [CLS] and [SEP]s included; whole oldest visits are dropped to fit. 512 rather than
    BEHRT's 256: at 256 the heaviest users (3-4% of patients, 11-14% of the next-visit samples on our cohorts)
    lost the start of their history, which carries when a code was first recorded and how often
    (docs/benchmarks.md, "Fifteenth round")."""
    keep_first_records: bool = False
    """When a history is longer than ``max_seq_len``, the older visits that do not fit keep the codes recorded
    there for the first time (at most half the stream; a visit with none is dropped) instead of being dropped
    whole, so the stream still shows every code the patient has had and when it was first recorded, at the
    cost of some recent whole visits. False (the default): drop whole oldest visits, as BEHRT did; on a tuning
    cohort where a quarter of the histories are cut the two were level (docs/benchmarks.md, "Sixteenth
    round")."""
    max_invalid_fraction: float = 0.5
    """If more than this share of a date column fails to parse, stop: the column has the wrong format."""
    shards: int = 1
    """Process patients in this many hash shards, one in memory at a time (for inputs larger than memory)."""
    split: SplitConfig = field(default_factory=SplitConfig)
    meds: MedsConfig = field(default_factory=MedsConfig)
    omop: OmopConfig = field(default_factory=OmopConfig)

    def __post_init__(self) -> None:
        if self.code_truncate is not None and self.code_truncate < 1:
            raise ValueError("code_truncate must be a positive number of characters, or null to keep codes")
        if self.max_seq_len < 3:
            raise ValueError("max_seq_len must be at least 3 ([CLS], one code, [SEP])")
        if self.min_code_count < 1:
            raise ValueError("min_code_count must be >= 1")
        if self.shards < 1:
            raise ValueError("shards must be >= 1")
