"""The command line as a user meets it: exit codes, one-line errors, outputs, shipped presets, --help."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import yaml
from conftest import write_visits

from behrt_rope import cli
from behrt_rope import schema as S

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
PRESETS = sorted(CONFIGS.rglob("*.yaml")) if CONFIGS.is_dir() else []
PATIENTS = [{"patient_id": "p1", "birth_date": "2000-01-01"}, {"patient_id": "p2", "birth_date": "1990-01-01"}]
EVENTS = [
    {"patient_id": "p1", "date": "2010-01-01", "code": "E11.9"},
    {"patient_id": "p2", "date": "2011-01-01", "code": "I10"},
    {"patient_id": "p3", "date": "2011-01-01", "code": "I10"},
]


@pytest.fixture(autouse=True)
def fresh_console_logging() -> Iterator[None]:
    """Each test gets its own console handler, bound to the stderr that capsys captures for it."""
    root = logging.getLogger("behrt_rope")

    def drop() -> None:
        for handler in [h for h in root.handlers if getattr(h, "_behrt_console", False)]:
            root.removeHandler(handler)

    drop()
    yield
    drop()


def _error_line(stderr: str) -> str:
    """The last stderr line (log lines may come before it); it must be the only 'error' line."""
    lines = stderr.strip().splitlines()
    assert [line for line in lines if "error" in line] == lines[-1:], stderr
    return lines[-1]


# ---------------------------------------------------------------------------------------------------------
# etl
# ---------------------------------------------------------------------------------------------------------
def test_etl_success_writes_every_artifact(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src, out = write_visits(tmp_path / "in", PATIENTS, EVENTS), tmp_path / "out"
    rc = cli.main(["etl", "--input", str(src), "--out", str(out), "etl.code_truncate=3", "progress=false"])
    assert rc == 0
    assert capsys.readouterr().out.strip() == str(out)
    for name in (
        S.VOCAB_FILE,
        S.QUARANTINE_FILE,
        S.MANIFEST_FILE,
        S.ETL_SETTINGS_FILE,
        S.RESOLVED_CONFIG_FILE,
        S.LOG_FILE,
        S.DONE_MARKER,
        f"{S.TOKENS_DIR}/part-00000.parquet",
    ):
        assert (out / name).is_file(), name
    assert not (out / ".shards").exists()
    settings = json.loads((out / S.ETL_SETTINGS_FILE).read_text())
    assert settings["etl"]["code_truncate"] == 3 and settings["patient_id_type"] == "string"
    resolved = yaml.safe_load((out / S.RESOLVED_CONFIG_FILE).read_text())
    assert resolved["etl"]["code_truncate"] == 3 and resolved["input"] == str(src)
    manifest = json.loads((out / S.MANIFEST_FILE).read_text())
    assert manifest["reconciles"] and manifest["quarantine_reasons"] == {S.Reason.UNKNOWN_PATIENT: 1}
    assert "events.csv: 3 rows = 2 used + 1 quarantined" in (out / S.LOG_FILE).read_text()


def test_etl_rerun_of_a_finished_run_is_skipped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src, out = write_visits(tmp_path / "in", PATIENTS, EVENTS), tmp_path / "out"
    argv = ["etl", "--input", str(src), "--out", str(out), "progress=false"]
    assert cli.main(argv) == 0
    stamp = (out / S.MANIFEST_FILE).stat().st_mtime_ns
    capsys.readouterr()
    assert cli.main(argv) == 0
    assert "already holds this run; skipping" in capsys.readouterr().err
    assert (out / S.MANIFEST_FILE).stat().st_mtime_ns == stamp
    assert cli.main([*argv, "overwrite=true"]) == 0
    assert (out / S.MANIFEST_FILE).stat().st_mtime_ns != stamp


def test_missing_input_dir_exits_1_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nowhere"
    rc = cli.main(["etl", "--input", str(missing), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 1
    assert err == f"behrt-rope etl: error: input directory not found: {missing}\n"
    assert not (tmp_path / "out").exists()


def test_missing_column_exits_1_naming_file_column_and_example(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    events = pd.DataFrame(EVENTS).rename(columns={"code": "icd"})
    src = write_visits(tmp_path / "in", PATIENTS, events)
    rc = cli.main(["etl", "--input", str(src), "--out", str(tmp_path / "out")])
    line = _error_line(capsys.readouterr().err)
    assert rc == 1
    assert line == (
        f"behrt-rope etl: error: {src / 'events.csv'}: missing required column 'code' "
        "(found columns ['patient_id', 'date', 'icd']; example row: "
        "{'patient_id': 'p1', 'date': '2010-01-01', 'icd': 'E11.9'})"
    )
    assert not (tmp_path / "out" / S.DONE_MARKER).exists()


def test_missing_table_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = write_visits(tmp_path / "in", PATIENTS, EVENTS)
    (src / "events.csv").unlink()
    assert cli.main(["etl", "--input", str(src), "--out", str(tmp_path / "out")]) == 1
    assert _error_line(capsys.readouterr().err).startswith(f"behrt-rope etl: error: {src}: no 'events' table")


def test_unknown_config_key_suggests_the_right_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = write_visits(tmp_path / "in", PATIENTS, EVENTS)
    rc = cli.main(["etl", "--input", str(src), "--out", str(tmp_path / "out"), "etl.code_trunc=3"])
    assert rc == 1
    assert capsys.readouterr().err == (
        "behrt-rope etl: error: unknown config key 'etl.code_trunc' (did you mean 'etl.code_truncate'?)\n"
    )


def test_bad_setting_value_is_a_user_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = write_visits(tmp_path / "in", PATIENTS, EVENTS)
    assert cli.main(["etl", "--input", str(src), "--out", str(tmp_path / "o"), "etl.max_seq_len=2"]) == 1
    assert "max_seq_len must be at least 3" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------
# Shipped presets and --help
# ---------------------------------------------------------------------------------------------------------
def _leaves(tree: dict[str, Any], prefix: str = "") -> list[str]:
    keys: list[str] = []
    for key, value in tree.items():
        keys.extend(_leaves(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key}"])
    return keys


@pytest.mark.parametrize("preset", PRESETS, ids=[str(p.relative_to(CONFIGS)) for p in PRESETS])
def test_every_shipped_config_parses_through_the_cli(preset: Path) -> None:
    command = preset.parent.name
    assert command in cli.COMMANDS, f"{preset}: presets live in configs/<command>/ (one of {list(cli.COMMANDS)})"
    module = cli._load_pipeline(command)
    if module is None:
        pytest.skip(f"behrt-rope {command} is not built yet")
    required = [a for f in cli.COMMANDS[command].flags if f.required for a in (f.name, "x")]
    args = cli.build_parser().parse_args([command, *required, "--config", str(preset)])
    resolved = cli.resolve_config(command, args, module)
    tree = cli.config_lib.to_dict(resolved)
    for key in _leaves(cli.config_lib.load_yaml(preset)):
        node: Any = tree
        for part in key.split("."):
            node = node[part]


def test_presets_exist_for_etl() -> None:
    assert any(p.parent.name == "etl" for p in PRESETS)


def test_help_lists_all_six_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for command in ("synth", "etl", "pretrain", "finetune", "predict", "evaluate"):
        assert f"\n    {command} " in out, command
    assert set(cli.COMMANDS) == {"synth", "etl", "pretrain", "finetune", "predict", "evaluate"}


def test_etl_help_lists_its_config_keys(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["etl", "--help"])
    out = capsys.readouterr().out
    for key in (
        "--input",
        "--out",
        "--format",
        "--config",
        "etl.code_truncate = None",
        "etl.max_seq_len = 512",
        "etl.shards = 1",
        "etl.split.salt = 'behrt-rope'",
    ):
        assert key in out, key


def test_no_command_prints_help_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def test_overrides_on_both_sides_of_a_flag_are_all_taken(tmp_path: Path) -> None:
    """``key=value`` overrides between and after flags (argparse takes one run of them and refused the rest as
    unrecognised); a flag's value holding '=' stays that flag's value."""
    src, out = write_visits(tmp_path / "in", PATIENTS, EVENTS), tmp_path / "a=b"
    argv = ["etl", "etl.code_truncate=3", "--input", str(src), "progress=false", "--out", str(out), "etl.shards=1"]
    assert cli.main(argv) == 0
    resolved = yaml.safe_load((out / S.RESOLVED_CONFIG_FILE).read_text())
    assert resolved["etl"]["code_truncate"] == 3 and resolved["etl"]["shards"] == 1 and resolved["out"] == str(out)
    assert resolved["progress"] is False
