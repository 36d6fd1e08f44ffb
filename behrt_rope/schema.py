"""The on-disk contract: every column name, Arrow type, split name, special token and file name.

Nothing else in behrt-rope writes a column name or an artifact file name as a bare string: it imports it
from here. ``tests/test_schema.py`` checks that the join keys agree across the tables defined below.
"""

from __future__ import annotations

from typing import Final

import pyarrow as pa

# ---------------------------------------------------------------------------------------------------------
# Raw input: the visits format (SPEC "Raw input: the visits format")
# ---------------------------------------------------------------------------------------------------------
PATIENT_ID: Final = "patient_id"
BIRTH_DATE: Final = "birth_date"
DEATH_DATE: Final = "death_date"
SEX: Final = "sex"
DATE: Final = "date"
CODE: Final = "code"
VISIT_ID: Final = "visit_id"
CODE_SYSTEM: Final = "code_system"
DESCRIPTION: Final = "description"  # a code's human-readable name

PATIENTS_TABLE: Final = "patients"
EVENTS_TABLE: Final = "events"
VISITS_REQUIRED: Final[dict[str, tuple[str, ...]]] = {
    PATIENTS_TABLE: (PATIENT_ID, BIRTH_DATE),
    EVENTS_TABLE: (PATIENT_ID, DATE, CODE),
}
VISITS_OPTIONAL: Final[dict[str, tuple[str, ...]]] = {
    PATIENTS_TABLE: (SEX, DEATH_DATE),
    EVENTS_TABLE: (VISIT_ID, CODE_SYSTEM),
}

# ---------------------------------------------------------------------------------------------------------
# Canonical tables: what every reader (visits, meds, omop) hands to the shared cleaning step
# ---------------------------------------------------------------------------------------------------------
TIME: Final = "time"  # event timestamp (timestamp[us]); dates become midnight
SOURCE_TABLE: Final = "source_table"  # which input table (file) a row came from
SOURCE_ROW: Final = "source_row"  # 0-based row number inside that table
REASON: Final = "reason"
TIME_RAW: Final = "time_raw"  # the time as read, kept for the quarantine file
BIRTH_RAW: Final = "birth_date_raw"
DEATH_RAW: Final = "death_date_raw"
SEX_RAW: Final = "sex_raw"

CANONICAL_PATIENTS: Final = pa.schema(
    [
        (PATIENT_ID, pa.string()),
        (BIRTH_DATE, pa.string()),  # raw text until the cleaning step parses it
        (DEATH_DATE, pa.string()),
        (SOURCE_TABLE, pa.string()),
        (SOURCE_ROW, pa.int64()),
    ]
)
CANONICAL_EVENTS: Final = pa.schema(
    [
        (PATIENT_ID, pa.string()),
        (TIME, pa.string()),  # raw text until the cleaning step parses it
        (CODE, pa.string()),
        (CODE_SYSTEM, pa.string()),
        (VISIT_ID, pa.string()),
        (SOURCE_TABLE, pa.string()),
        (SOURCE_ROW, pa.int64()),
    ]
)

# Quarantine: every rejected input row, with its raw values as text and the reason.
QUARANTINE: Final = pa.schema(
    [
        (SOURCE_TABLE, pa.string()),
        (SOURCE_ROW, pa.int64()),
        (PATIENT_ID, pa.string()),
        (TIME, pa.string()),
        (CODE, pa.string()),
        (REASON, pa.string()),
    ]
)


class Reason:
    """Quarantine reasons (the ``reason`` column). One row can carry only the first that applies."""

    MISSING_PATIENT_ID: Final = "missing_patient_id"
    UNPARSEABLE_BIRTH_DATE: Final = "unparseable_birth_date"
    UNPARSEABLE_DEATH_DATE: Final = "unparseable_death_date"
    DEATH_BEFORE_BIRTH: Final = "death_before_birth"
    CONFLICTING_PATIENT_ROWS: Final = "conflicting_patient_rows"
    UNPARSEABLE_DATE: Final = "unparseable_date"
    EMPTY_CODE: Final = "empty_code"
    UNKNOWN_PATIENT: Final = "unknown_patient"
    PATIENT_REJECTED: Final = "patient_rejected"  # the patient's own row was quarantined
    BEFORE_BIRTH: Final = "event_before_birth"
    AFTER_DEATH: Final = "event_after_death"
    VISIT_TOO_LONG: Final = "visit_exceeds_max_seq_len"
    DUPLICATE: Final = "exact_duplicate"  # listed in the quarantine file, counted as duplicates_dropped
    # reader-detected (set by a reader in the optional REASON column of its canonical events, see raw.py)
    MISSING_BIRTH: Final = "missing_birth"  # MEDS: the subject has events but no MEDS_BIRTH event
    NO_MATCHING_CONCEPT: Final = "no_matching_concept"  # OMOP: condition_concept_id 0
    UNKNOWN_CONCEPT: Final = "concept_not_in_concept_table"  # OMOP: a concept id the concept table lacks
    # set by predict in the REASON column, checked after the row's own checks
    AFTER_AS_OF: Final = "event_after_as_of"  # dated after predict's as_of day (by default the day it runs)


# ---------------------------------------------------------------------------------------------------------
# Splits and special tokens
# ---------------------------------------------------------------------------------------------------------
TRAIN: Final = "train"
TUNING: Final = "tuning"
HELD_OUT: Final = "held_out"
SPLITS: Final = (TRAIN, TUNING, HELD_OUT)

PAD: Final = "[PAD]"
CLS: Final = "[CLS]"
SEP: Final = "[SEP]"
MASK: Final = "[MASK]"
UNK: Final = "[UNK]"
SPECIAL_TOKENS: Final = (PAD, CLS, SEP, MASK, UNK)
PAD_ID: Final = 0
CLS_ID: Final = 1
SEP_ID: Final = 2
MASK_ID: Final = 3
UNK_ID: Final = 4
N_SPECIAL: Final = len(SPECIAL_TOKENS)  # ids below this are special; [UNK] counts as special for masking

# ---------------------------------------------------------------------------------------------------------
# ETL output: the token dataset (one row per patient, list columns aligned token by token)
# ---------------------------------------------------------------------------------------------------------
SPLIT: Final = "split"
TOKEN_IDS: Final = "token_ids"  # list<int32>: vocabulary ids, [CLS] first, [SEP] closing every visit
AGES: Final = "ages"  # list<float32>: age at the token's visit, years ((date - birth) days / 365.25)
SEGMENTS: Final = "segments"  # list<int8>: 0 for even visits, 1 for odd ones; [CLS] takes visit 0's
VISIT_INDEX: Final = "visit_index"  # list<int16>: 0-based visit number after truncation
VISIT_DATES: Final = "visit_dates"  # list<timestamp[us]>: the visit's time (earliest event in it)
N_VISITS: Final = "n_visits"
N_TOKENS: Final = "n_tokens"
N_THINNED_VISITS: Final = "n_thinned_visits"  # int32: the stream's first visits that hold only first records
LAST_EVENT_TIME: Final = "last_event_time"
SEX_VALUES: Final = ("unknown", "female", "male", "other")
"""SEX in the token dataset: one of these (behrt_rope/etl/sex.py); the model reads its position as an id."""

TOKENS: Final = pa.schema(
    [
        (PATIENT_ID, pa.string()),
        (SPLIT, pa.string()),
        (BIRTH_DATE, pa.timestamp("us")),
        (DEATH_DATE, pa.timestamp("us")),
        (N_VISITS, pa.int32()),
        (N_TOKENS, pa.int32()),
        (N_THINNED_VISITS, pa.int32()),
        (LAST_EVENT_TIME, pa.timestamp("us")),
        (SEX, pa.string()),
        (TOKEN_IDS, pa.list_(pa.int32())),
        (AGES, pa.list_(pa.float32())),
        (SEGMENTS, pa.list_(pa.int8())),
        (VISIT_INDEX, pa.list_(pa.int16())),
        (VISIT_DATES, pa.list_(pa.timestamp("us"))),
    ]
)

TOKEN: Final = "token"
VOCAB: Final = pa.schema([("token_id", pa.int32()), (TOKEN, pa.string()), ("train_count", pa.int64())])
# Human-readable names of vocabulary tokens, when the input carries them (MEDS code metadata, OMOP concept)
CODE_DESCRIPTIONS: Final = pa.schema([(TOKEN, pa.string()), (DESCRIPTION, pa.string())])

# ---------------------------------------------------------------------------------------------------------
# Predictions (SPEC "Predictions file")
# ---------------------------------------------------------------------------------------------------------
PREDICTION_TIME: Final = "prediction_time"
PROBABILITY: Final = "probability"
MEDS_SUBJECT_ID: Final = "subject_id"
# MEDS prediction layout (meds-evaluation's PredictionSchema): one file per label code, see
# behrt_rope/evaluation/meds_predictions.py
MEDS_BOOLEAN_VALUE: Final = "boolean_value"  # the observed outcome, when known
MEDS_PREDICTED_VALUE: Final = "predicted_boolean_value"
MEDS_PREDICTED_PROBABILITY: Final = "predicted_boolean_probability"
MEDS_PREDICTIONS_INDEX: Final = "index.json"  # label code -> file name
MEDS_PREDICTIONS_DIR: Final = "predictions_meds"  # evaluate's held-out predictions in the MEDS layout

# ---------------------------------------------------------------------------------------------------------
# Raw input: MEDS and OMOP CDM (read by etl/readers/meds.py and etl/readers/omop.py; docs/formats.md)
# ---------------------------------------------------------------------------------------------------------
MEDS_TIME: Final = "time"
MEDS_CODE: Final = "code"
MEDS_SPLIT: Final = "split"
MEDS_DATA_DIR: Final = "data"  # data/**/*.parquet
MEDS_SPLITS_FILE: Final = "metadata/subject_splits.parquet"
MEDS_CODES_FILE: Final = "metadata/codes.parquet"  # code metadata: code, description, parent_codes

OMOP_PERSON: Final = "person"
OMOP_CONDITION: Final = "condition_occurrence"
OMOP_VISIT: Final = "visit_occurrence"
OMOP_DEATH: Final = "death"
OMOP_PERSON_ID: Final = "person_id"
OMOP_BIRTH_DATETIME: Final = "birth_datetime"
OMOP_YEAR_OF_BIRTH: Final = "year_of_birth"
OMOP_MONTH_OF_BIRTH: Final = "month_of_birth"
OMOP_DAY_OF_BIRTH: Final = "day_of_birth"
OMOP_GENDER_CONCEPT_ID: Final = "gender_concept_id"
OMOP_GENDER_SOURCE_VALUE: Final = "gender_source_value"
OMOP_DEATH_DATE: Final = "death_date"
OMOP_DEATH_DATETIME: Final = "death_datetime"
OMOP_CONDITION_CONCEPT_ID: Final = "condition_concept_id"
OMOP_CONDITION_SOURCE_VALUE: Final = "condition_source_value"
OMOP_CONDITION_START_DATE: Final = "condition_start_date"
OMOP_CONDITION_START_DATETIME: Final = "condition_start_datetime"
OMOP_VISIT_OCCURRENCE_ID: Final = "visit_occurrence_id"
OMOP_VISIT_START_DATE: Final = "visit_start_date"
OMOP_VISIT_START_DATETIME: Final = "visit_start_datetime"
OMOP_VISIT_END_DATE: Final = "visit_end_date"
OMOP_VISIT_END_DATETIME: Final = "visit_end_datetime"
OMOP_CONDITION_SOURCE_CONCEPT_ID: Final = "condition_source_concept_id"
OMOP_CONCEPT: Final = "concept"
OMOP_CONCEPT_ID: Final = "concept_id"
OMOP_CONCEPT_NAME: Final = "concept_name"
OMOP_VOCABULARY_ID: Final = "vocabulary_id"
OMOP_CONCEPT_CODE: Final = "concept_code"

# ---------------------------------------------------------------------------------------------------------
# Artifact file names, per stage output directory
# ---------------------------------------------------------------------------------------------------------
TOKENS_DIR: Final = "tokens"  # tokens/part-00000.parquet, one part per patient shard
VOCAB_FILE: Final = "vocab.parquet"
CODE_DESCRIPTIONS_FILE: Final = "code_descriptions.parquet"
QUARANTINE_FILE: Final = "quarantine.parquet"
MANIFEST_FILE: Final = "manifest.json"
ETL_SETTINGS_FILE: Final = "etl_settings.json"  # what predict needs to re-apply the ETL
RESOLVED_CONFIG_FILE: Final = "config.yaml"
LOG_FILE: Final = "run.log"
DONE_MARKER: Final = ".done"  # written last: a directory without it is incomplete
INPUTS_FILE: Final = ".inputs.json"  # the finished runs of the stage directories this run read (see stage.py)
LOCK_FILE: Final = ".lock"  # held by the run writing the directory (pid, host); see locking.py
METRICS_FILE: Final = "metrics.json"
CHECKPOINT_DIR: Final = "checkpoints"
BEST_CHECKPOINT: Final = "best.ckpt"
LAST_CHECKPOINT: Final = "last.ckpt"
MODEL_WEIGHTS_FILE: Final = "model.safetensors"  # the weights: tensors only, no code (safetensors)
MODEL_META_FILE: Final = "model.json"  # model config, vocabulary, labels, task, ETL settings, versions
LEGACY_MODEL_FILE: Final = "model.pt"  # the pickle of 0.1.0: refused, never loaded
LABEL_VOCAB_FILE: Final = "label_vocab.parquet"
REPORT_FILE: Final = "report.html"
ORACLE_FILE: Final = "oracle.parquet"  # synth: true next-visit probabilities at one cut per patient
RECORD_ORACLE_FILE: Final = "oracle_record.parquet"  # synth: the same, given only the recorded history
PLOTS_DIR: Final = "plots"
