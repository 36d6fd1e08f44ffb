"""``behrt-rope synth``: write a seeded synthetic cohort in the visits format.

Writes ``patients.<fmt>`` and ``events.<fmt>`` (``fmt`` = ``synth.file_format``, csv or parquet) into
``out``, with the resolved ``config.yaml``, ``run.log`` and the ``.done`` marker. The cohort itself is
described in ``synthetic_data/README.md``. With ``oracle=true`` it also writes ``oracle.parquet``: for one
random cut visit per patient, the generator's true probability of each code at the next visit (see
``synthetic_data/oracle.py``), which ``behrt-rope evaluate ... oracle=DIR`` turns into a ceiling. With
``record_oracle=true`` (clinical process) it also writes ``oracle_record.parquet``: at the same cuts, the best
prediction from the recorded history alone (``synthetic_data/record_oracle.py``); ``evaluate ... oracle=DIR``
then measures every predictor against both ceilings, ``oracle=DIR/oracle_record.parquet`` against that
learnable one alone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from behrt_rope import atomic
from behrt_rope.config import ConfigError
from behrt_rope.schema import EVENTS_TABLE, ORACLE_FILE, PATIENT_ID, PATIENTS_TABLE, RECORD_ORACLE_FILE, VISIT_ID
from behrt_rope.stage import is_done, stage
from synthetic_data.generator import SynthConfig, generate
from synthetic_data.oracle import oracle_table
from synthetic_data.record_oracle import record_oracle_table

log = logging.getLogger("behrt_rope.synth")
FORMATS = ("csv", "parquet")


@dataclass
class Config:
    """Settings of ``behrt-rope synth``."""

    out: str = ""
    """Output directory; receives patients.<fmt> and events.<fmt>."""
    overwrite: bool = False
    """Regenerate even when the output directory already holds a finished run of this configuration."""
    oracle: bool = False
    """Also write oracle.parquet: true next-visit code probabilities at one random cut visit per patient."""
    oracle_replicas: int = 500
    """Monte Carlo copies of each patient's next visit behind the oracle (standard error <= 0.5/sqrt(n))."""
    record_oracle: bool = False
    """Also write oracle_record.parquet (clinical process): next-visit probabilities at the oracle's cuts given
    only the recorded history, the ceiling a model of the record can reach; about 0.1 s per patient and 500
    particles on one core."""
    record_oracle_particles: int = 1000
    """Importance-sampling copies per patient behind the record oracle."""
    synth: SynthConfig = field(default_factory=SynthConfig)


def run(config: Config) -> Path:
    """Generate the cohort of ``config.synth`` and write it to ``config.out``; return that directory."""
    if not config.out.strip():
        raise ConfigError("synth needs an output directory: pass --out DIR (config key 'out')")
    if config.record_oracle and config.synth.process != "clinical":
        raise ConfigError("record_oracle=true needs synth.process=clinical: the recurrence oracle already is one")
    out = Path(config.out)
    if not config.overwrite and is_done(out, config):
        log.info("synth: %s already holds this cohort; skipping (overwrite=true to regenerate)", out)
        return out
    with stage(out, config, "synth") as out_dir:
        patients, events = generate(config.synth)
        fmt = config.synth.file_format
        write_table(patients, out_dir / f"{PATIENTS_TABLE}.{fmt}")
        write_table(events, out_dir / f"{EVENTS_TABLE}.{fmt}")
        _remove_other_formats(out_dir, fmt)
        if config.oracle:
            oracle = oracle_table(config.synth, config.oracle_replicas)
            with atomic.atomic_path(out_dir / ORACLE_FILE) as tmp:
                pq.write_table(pa.Table.from_pandas(oracle, preserve_index=False), tmp)
            log.info("synth: oracle for %d cut visits -> %s", oracle[PATIENT_ID].nunique(), ORACLE_FILE)
        else:
            (out_dir / ORACLE_FILE).unlink(missing_ok=True)
        _write_record_oracle(config, out_dir)
        log.info(
            "synth: %d patients, %d events, %d visits -> %s (%s)",
            len(patients),
            len(events),
            events[VISIT_ID].nunique(),
            out_dir,
            fmt,
        )
    return out_dir


def _write_record_oracle(config: Config, out_dir: Path) -> None:
    """``oracle_record.parquet`` when asked for (removed otherwise, so a rerun never leaves a stale one)."""
    if not config.record_oracle:
        (out_dir / RECORD_ORACLE_FILE).unlink(missing_ok=True)
        return
    result = record_oracle_table(config.synth, config.record_oracle_particles, config.oracle_replicas)
    with atomic.atomic_path(out_dir / RECORD_ORACLE_FILE) as tmp:
        pq.write_table(pa.Table.from_pandas(result.table, preserve_index=False), tmp)
    low = float(np.quantile(result.ess, 0.05)) if len(result.ess) else float("nan")
    log.info(
        "synth: record oracle for %d cut visits -> %s (effective copies per patient: median %.0f, 5%% below %.0f)",
        len(result.ess),
        RECORD_ORACLE_FILE,
        float(np.median(result.ess)) if len(result.ess) else float("nan"),
        low,
    )


def write_table(frame: pd.DataFrame, path: Path) -> None:
    """Write a table of text columns as CSV (missing values as empty fields) or Parquet (plain ``string``)."""
    with atomic.atomic_path(path) as tmp:
        if path.suffix == ".csv":
            frame.to_csv(tmp, index=False)
            return
        table = pa.Table.from_pandas(frame, preserve_index=False)
        table = table.cast(pa.schema([(name, pa.string()) for name in table.column_names]))
        pq.write_table(table, tmp)


def _remove_other_formats(out_dir: Path, fmt: str) -> None:
    """A directory holding both patients.csv and patients.parquet would be ambiguous to read."""
    for other in FORMATS:
        if other != fmt:
            for table in (PATIENTS_TABLE, EVENTS_TABLE):
                (out_dir / f"{table}.{other}").unlink(missing_ok=True)
