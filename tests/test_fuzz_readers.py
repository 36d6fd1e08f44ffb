"""Fuzzed readers and config loader (issue 11, item 6): malformed input gives a reconciled result or one line.

Hypothesis builds input directories for each format (visits, MEDS, OMOP) whose cells mix valid values with
wrong types, nulls, empty strings, very long strings, non-UTF-8 bytes, dates in 1800 and 2200 and mixed time
zones, whose column names are duplicated, misspelled or missing, and whose files are empty or hold no rows.
The ETL must then either finish with a manifest that reconciles with the rows written, or stop with a
one-line :class:`~behrt_rope.errors.UserError` naming the file (a column and an example when a column is at
fault). Any other exception fails the test: it is what a user would see as a traceback.
"""

from __future__ import annotations

import csv
import io
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from behrt_rope import config as config_lib
from behrt_rope import schema as S
from behrt_rope.errors import UserError
from behrt_rope.etl.config import EtlConfig
from behrt_rope.etl.runner import run_etl
from pipelines import etl as etl_pipeline
from pipelines import finetune as finetune_pipeline
from pipelines import pretrain as pretrain_pipeline

NON_UTF8 = "caf\udce9"  # written with surrogateescape: the byte 0xE9 alone, invalid UTF-8
POOLS: dict[str, list[Any]] = {
    "id": ["p1", "p2", "p3", "1", "2", "17", " p1 ", "-4"],
    "int": ["1980", "5", "12", "0", "-3", "1.5", "99999999999999999999", "2020"],
    "date": [
        "2020-01-01",
        "1800-03-04",
        "2200-12-31",
        "2020-01-01T10:00:00+05:00",
        "2020-01-01T23:30:00-08:00",
        "2020-06-01T00:00:00Z",
        "2020-01-01 10:00:00",
        "2020-02-30",
        "01/02/2020",
        "1999-12-31T23:59:59.999999",
    ],
    "code": [
        "E11",
        "250",
        "I10.9",
        "0250",
        "DIAGNOSIS//ICD//10//E11",
        "DIAGNOSIS//ICD//9//25000",
        "MEDS_BIRTH",
        "MEDS_DEATH",
        "HOSPITAL_ADMISSION//x",
        "HOSPITAL_DISCHARGE//y",
        "Ä😀",
    ],
}
ANYTHING = st.one_of(
    st.none(),
    st.just(""),
    st.text(max_size=12),
    st.just("Z" * 20_000),
    st.just(NON_UTF8),
    st.integers(-(10**6), 10**6).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(str),
    *(st.sampled_from(pool) for pool in POOLS.values()),
)
PARQUET_TYPES = ["string", "string", "int64", "float64", "timestamp", "timestamp_tz", "date32", "bool", "binary"]
PARQUET_TYPES.append("null")

# (table, columns and their kinds) per format; the reader's required columns come first
LAYOUTS: dict[str, dict[str, list[tuple[str, str]]]] = {
    "visits": {
        S.PATIENTS_TABLE: [(S.PATIENT_ID, "id"), (S.BIRTH_DATE, "date"), (S.SEX, "code"), (S.DEATH_DATE, "date")],
        S.EVENTS_TABLE: [
            (S.PATIENT_ID, "id"),
            (S.DATE, "date"),
            (S.CODE, "code"),
            (S.VISIT_ID, "id"),
            (S.CODE_SYSTEM, "code"),
        ],
    },
    "meds": {
        f"{S.MEDS_DATA_DIR}/0": [(S.MEDS_SUBJECT_ID, "id"), (S.MEDS_TIME, "date"), (S.MEDS_CODE, "code")],
    },
    "omop": {
        S.OMOP_PERSON: [
            (S.OMOP_PERSON_ID, "id"),
            (S.OMOP_YEAR_OF_BIRTH, "int"),
            (S.OMOP_MONTH_OF_BIRTH, "int"),
            (S.OMOP_DAY_OF_BIRTH, "int"),
            (S.OMOP_BIRTH_DATETIME, "date"),
        ],
        S.OMOP_CONDITION: [
            (S.OMOP_PERSON_ID, "id"),
            (S.OMOP_CONDITION_CONCEPT_ID, "int"),
            (S.OMOP_CONDITION_START_DATE, "date"),
            (S.OMOP_CONDITION_SOURCE_VALUE, "code"),
            (S.OMOP_VISIT_OCCURRENCE_ID, "id"),
        ],
        S.OMOP_VISIT: [
            (S.OMOP_VISIT_OCCURRENCE_ID, "id"),
            (S.OMOP_PERSON_ID, "id"),
            (S.OMOP_VISIT_START_DATE, "date"),
            (S.OMOP_VISIT_END_DATE, "date"),
        ],
    },
}


@dataclass
class FuzzTable:
    """One generated input file: its column names (possibly mangled), rows of text cells, how it is stored."""

    names: list[str]
    rows: list[list[str | None]]
    fmt: str  # csv | parquet
    types: list[str]  # per column, for parquet
    damage: str  # none | empty_file | header_only


@st.composite
def fuzz_table(draw: st.DrawFn, columns: list[tuple[str, str]], parquet_only: bool) -> FuzzTable:
    names = [c for c, _ in columns]
    kinds = [k for _, k in columns]
    n_rows = draw(st.integers(0, 8))
    cells = {k: st.one_of(st.sampled_from(POOLS[k]), st.sampled_from(POOLS[k]), ANYTHING) for k in POOLS}
    rows = [[draw(cells[k]) for k in kinds] for _ in range(n_rows)]
    mangle = draw(st.sampled_from(["none", "none", "none", "drop", "duplicate", "misspell", "upper", "extra"]))
    i = draw(st.integers(0, len(names) - 1))
    if mangle == "drop":
        names, kinds = names[:i] + names[i + 1 :], kinds[:i] + kinds[i + 1 :]
        rows = [r[:i] + r[i + 1 :] for r in rows]
    elif mangle == "duplicate":
        names, kinds = [*names, names[i]], [*kinds, kinds[i]]
        rows = [[*r, draw(ANYTHING)] for r in rows]
    elif mangle == "misspell":
        names[i] = names[i][:-1] + "_" if len(names[i]) > 1 else names[i] + "x"
    elif mangle == "upper":
        names[i] = names[i].upper()
    elif mangle == "extra":
        names, kinds = [*names, "notes"], [*kinds, "code"]
        rows = [[*r, draw(ANYTHING)] for r in rows]
    fmt = "parquet" if parquet_only else draw(st.sampled_from(["csv", "parquet"]))
    types = [draw(st.sampled_from(PARQUET_TYPES)) for _ in names]
    damage = draw(st.sampled_from(["none"] * 6 + ["empty_file", "header_only"]))
    return FuzzTable(names, rows, fmt, types, damage)


def csv_bytes(table: FuzzTable) -> bytes:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(table.names)
    writer.writerows([["" if v is None else v for v in row] for row in table.rows])
    return buffer.getvalue().encode("utf-8", "surrogateescape")


def arrow_column(values: list[str | None], kind: str) -> pa.Array:
    """``values`` (text) as an Arrow array of type ``kind``; what does not convert becomes null."""
    text = pd.Series(values, dtype=object)
    if kind == "string":
        return pa.array([None if v is None else v.encode("utf-8", "replace").decode() for v in values], pa.string())
    if kind == "binary":
        return pa.array([None if v is None else v.encode("utf-8", "surrogateescape") for v in values], pa.binary())
    if kind == "null":
        return pa.nulls(len(values))
    if kind in ("int64", "float64"):
        numbers = pd.to_numeric(text, errors="coerce")
        if kind == "int64":
            whole = numbers.where((numbers % 1 == 0) & (numbers.abs() < 2**62))
            return pa.array(whole.astype("Int64"), pa.int64(), from_pandas=True)
        return pa.array(numbers.astype("float64"), pa.float64(), from_pandas=True)
    if kind == "bool":
        return pa.array([None if v is None else len(v) % 2 == 0 for v in values], pa.bool_())
    strings = text.where(text.map(lambda v: isinstance(v, str)))
    times = pd.to_datetime(strings, errors="coerce", utc=True, format="mixed")
    if kind == "timestamp_tz":
        return pa.array(times.dt.tz_convert("Europe/Paris"), pa.timestamp("us", "Europe/Paris"), from_pandas=True)
    naive = pa.array(times.dt.tz_localize(None), pa.timestamp("us"), from_pandas=True)
    return naive.cast(pa.date32()) if kind == "date32" else naive


def write_table(folder: Path, name: str, table: FuzzTable) -> Path:
    path = folder / f"{name}.{table.fmt}"
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [] if table.damage == "header_only" else table.rows
    if table.damage == "empty_file":
        path.write_bytes(b"")
    elif table.fmt == "csv":
        path.write_bytes(csv_bytes(FuzzTable(table.names, rows, "csv", table.types, table.damage)))
    else:
        columns = [[r[j] for r in rows] for j in range(len(table.names))]
        arrays = [arrow_column(values, kind) for values, kind in zip(columns, table.types)]
        pq.write_table(pa.Table.from_arrays(arrays, names=table.names), path)
    return path


def check(input_dir: Path, fmt: str, written: dict[str, int]) -> None:
    """Run the ETL: a reconciled manifest, or a one-line error naming the file; nothing else."""
    out = input_dir.parent / "out"
    shutil.rmtree(out, ignore_errors=True)
    try:
        manifest = run_etl(input_dir, out, EtlConfig(format=fmt), progress=False)  # type: ignore[arg-type]
    except UserError as err:
        message = str(err)
        assert message and "\n" not in message and len(message) < 1500, message  # one line, long values cut
        assert str(input_dir) in message, message  # names the file (or the input folder)
        if "column '" in message:
            assert "example" in message, message
        return
    assert manifest["reconciles"], manifest["tables"]
    assert manifest["events_used"]["reconciles"], manifest["events_used"]
    for name, report in manifest["tables"].items():
        if name in written:
            assert report["rows"] == written[name], (name, report)


def fuzz_format(fmt: str, tables: dict[str, FuzzTable]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        input_dir = Path(tmp) / "input"
        written = {}
        for name, table in tables.items():
            path = write_table(input_dir, name, table)
            written[str(path.relative_to(input_dir))] = 0 if table.damage != "none" else len(table.rows)
        check(input_dir, fmt, written)


FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.fixed_dictionaries({t: fuzz_table(cols, parquet_only=False) for t, cols in LAYOUTS["visits"].items()}))
def test_fuzzed_visits_input(tables: dict[str, FuzzTable]) -> None:
    fuzz_format("visits", tables)


@FUZZ
@given(st.fixed_dictionaries({t: fuzz_table(cols, parquet_only=True) for t, cols in LAYOUTS["meds"].items()}))
def test_fuzzed_meds_input(tables: dict[str, FuzzTable]) -> None:
    fuzz_format("meds", tables)


@FUZZ
@given(st.fixed_dictionaries({t: fuzz_table(cols, parquet_only=False) for t, cols in LAYOUTS["omop"].items()}))
def test_fuzzed_omop_input(tables: dict[str, FuzzTable]) -> None:
    fuzz_format("omop", tables)


# ---------------------------------------------------------------------------------------------------------
# the config loader
# ---------------------------------------------------------------------------------------------------------
CONFIGS = [EtlConfig, etl_pipeline.Config, pretrain_pipeline.Config, finetune_pipeline.Config]
KEYS = ["seed", "code_truncate", "split.train", "split.sallt", "model.hidden_size", "trainer.batch_size", "task.name"]
YAML_VALUE = st.one_of(
    ANYTHING.filter(lambda v: v != NON_UTF8),
    st.lists(st.text(max_size=5), max_size=3),
    st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2),
)


def yaml_document(data: st.DrawFn) -> bytes:
    """Almost-YAML: mappings of real and misspelled keys to odd values, or raw bytes."""
    kind = data(st.sampled_from(["mapping", "mapping", "bytes", "text"]))
    if kind == "bytes":
        return data(st.binary(max_size=60))
    if kind == "text":
        return data(st.text(max_size=60)).encode("utf-8", "surrogateescape")
    keys = st.one_of(st.sampled_from(KEYS), st.text(max_size=8))
    lines = []
    for key, value in data(st.dictionaries(keys, YAML_VALUE, max_size=4)).items():
        lines.append(f"{key}: {value!r}" if data(st.booleans()) else f"{key}: {value}")
    return "\n".join(lines).encode("utf-8", "surrogateescape")


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_fuzzed_config_files_and_overrides(data: st.DataObject) -> None:
    document = yaml_document(data.draw)
    assignment = st.tuples(st.one_of(st.sampled_from(KEYS), st.text(max_size=8)), YAML_VALUE.map(str))
    overrides = data.draw(st.lists(st.one_of(assignment.map("=".join), st.text(max_size=10)), max_size=3))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "preset.yaml"
        path.write_bytes(document)
        for cls in CONFIGS:
            try:
                config_lib.build(cls, config_lib.load_yaml(path), overrides)
            except UserError as err:
                assert str(err) and "\n" not in str(err), str(err)


@pytest.mark.parametrize(
    ("document", "expected"),
    [
        (b"seed: [1, 2\n", "not valid YAML"),
        (b"\xff\xfeseed: 1\n", "not UTF-8"),
        (b"- a\n- b\n", "must hold a mapping"),
    ],
)
def test_broken_config_files_give_one_line_errors(tmp_path: Path, document: bytes, expected: str) -> None:
    path = tmp_path / "preset.yaml"
    path.write_bytes(document)
    with pytest.raises(UserError, match=expected) as caught:
        config_lib.load_yaml(path)
    assert "\n" not in str(caught.value) and str(path) in str(caught.value)


def test_override_with_a_line_break_in_its_key_gives_one_line() -> None:
    with pytest.raises(UserError) as caught:
        config_lib.build(EtlConfig, {}, ["split\n.train=0.5"])
    assert "\n" not in str(caught.value) and "unknown config key 'split\\n'" in str(caught.value)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"patient_id,date,code\np1,2020-01-01,caf\xe9\n", r"column 'code'\); example: line 2: b'p1,2020-01"),
        (b"", "cannot read the file"),
        (b"patient_id,date,code,code\np1,2020-01-01,E11,I10\n", "column 'code' appears 2 times"),
        (b"patient_id,date,cod\np1,2020-01-01,E11\n", "missing required column 'code'"),
    ],
)
def test_events_file_problems_are_named(tmp_path: Path, content: bytes, expected: str) -> None:
    """The examples the fuzzers found or probe, pinned: each a one-line message naming the events file."""
    (tmp_path / f"{S.PATIENTS_TABLE}.csv").write_text("patient_id,birth_date\np1,1950-01-01\n")
    (tmp_path / f"{S.EVENTS_TABLE}.csv").write_bytes(content)
    with pytest.raises(UserError, match=expected) as caught:
        run_etl(tmp_path, tmp_path / "out", EtlConfig(), progress=False)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(str(tmp_path / f"{S.EVENTS_TABLE}.csv"))
