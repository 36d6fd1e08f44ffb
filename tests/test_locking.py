"""One writer per output (issue 11, item 4): a live run's lock stops a second run; a dead run's is taken over.

The live holder is a real second process that takes the lock through the library and waits; the dead
holder is a process that has exited (its pid no longer runs).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fixtures_training import error_line

from behrt_rope import schema as S
from behrt_rope.cli import main
from behrt_rope.locking import OutputLockedError, acquire, output_lock, release

REPO = Path(__file__).resolve().parents[1]
HOLD = """
import sys
from behrt_rope.locking import output_lock
with output_lock(sys.argv[1], "test"):
    print("locked", flush=True)
    sys.stdin.read()
"""


@pytest.fixture
def holder() -> Iterator[object]:
    """``holder(lock_file)`` starts a process holding that lock until the test ends (or ``.release()``)."""
    started: list[subprocess.Popen[str]] = []

    def hold(lock_file: Path) -> subprocess.Popen[str]:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        argv = [sys.executable, "-c", HOLD, str(lock_file)]
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        started.append(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
        return proc

    yield hold
    for proc in started:
        proc.communicate(timeout=30)


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def lock_record(pid: int, host: str | None = None) -> str:
    return json.dumps({"pid": pid, "host": host or socket.gethostname(), "token": "x", "started": "then"})


def one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    return error_line(capsys.readouterr().err)


def write_cohort(folder: Path) -> Path:
    folder.mkdir()
    (folder / f"{S.PATIENTS_TABLE}.csv").write_text("patient_id,birth_date\np1,1950-01-01\np2,1960-02-02\n")
    (folder / f"{S.EVENTS_TABLE}.csv").write_text("patient_id,date,code\np1,2020-01-01,E11\np2,2020-03-03,I10\n")
    return folder


# ---------------------------------------------------------------------------------------------------------
# the library
# ---------------------------------------------------------------------------------------------------------
def test_a_second_acquire_while_held_is_refused_and_release_frees_it(tmp_path: Path) -> None:
    lock = tmp_path / ".lock"
    with output_lock(lock, tmp_path) as record:
        assert json.loads(lock.read_text())["token"] == record["token"]
        with pytest.raises(OutputLockedError, match=f"is being written by process {os.getpid()}"):
            acquire(lock, tmp_path)
    assert not lock.exists()
    release(lock, acquire(lock, tmp_path))
    assert not lock.exists()


def test_stale_lock_of_a_dead_process_is_taken_over(tmp_path: Path) -> None:
    lock = tmp_path / ".lock"
    lock.write_text(lock_record(dead_pid()))
    record = acquire(lock, tmp_path)
    assert json.loads(lock.read_text())["pid"] == os.getpid() == record["pid"]


def test_lock_of_another_host_is_never_taken_over(tmp_path: Path) -> None:
    lock = tmp_path / ".lock"
    lock.write_text(lock_record(dead_pid(), host="elsewhere.invalid"))
    with pytest.raises(OutputLockedError, match=f"delete {lock} if that run is gone"):
        acquire(lock, tmp_path)
    assert json.loads(lock.read_text())["host"] == "elsewhere.invalid"


def test_unreadable_lock_is_taken_over_only_once_it_is_old(tmp_path: Path) -> None:
    """An empty lock file is a writer caught between creating and filling it: waited for, then stale."""
    lock = tmp_path / ".lock"
    lock.write_text("")
    with pytest.raises(OutputLockedError, match="could not take the lock"):
        acquire(lock, tmp_path)
    old = time.time() - 60
    os.utime(lock, (old, old))
    assert acquire(lock, tmp_path)["pid"] == os.getpid()


def test_release_leaves_a_lock_that_another_run_took_over(tmp_path: Path) -> None:
    lock = tmp_path / ".lock"
    mine = acquire(lock, tmp_path)
    lock.write_text(lock_record(12345))
    release(lock, mine)
    assert lock.exists()


# ---------------------------------------------------------------------------------------------------------
# the commands
# ---------------------------------------------------------------------------------------------------------
def test_second_etl_into_a_live_runs_output_stops_at_once(
    tmp_path: Path, holder, capsys: pytest.CaptureFixture[str]
) -> None:
    raw, out = write_cohort(tmp_path / "raw"), tmp_path / "etl"
    out.mkdir()
    live = holder(out / S.LOCK_FILE)
    argv = ["etl", "--input", str(raw), "--out", str(out), "progress=false"]
    assert main(argv) == 1
    err = one_line_error(capsys)
    assert f"{out} is being written by process {live.pid} on {socket.gethostname()}" in err
    assert sorted(p.name for p in out.iterdir()) == [S.LOCK_FILE]  # nothing of the live run's was touched
    live.communicate(timeout=30)  # the live run finishes: its lock is gone
    assert main(argv) == 0 and (out / S.DONE_MARKER).exists() and not (out / S.LOCK_FILE).exists()


def test_a_stage_never_writes_into_another_stage_s_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--out`` naming another stage's finished output (``evaluate --out MODEL_DIR``) is refused untouched: its
    ``.done``, ``config.yaml`` and ``metrics.json`` used to be overwritten, leaving a model predict refused."""
    raw, model = write_cohort(tmp_path / "raw"), tmp_path / "ft"
    model.mkdir()
    files = {S.DONE_MARKER: "finetune\n", S.RESOLVED_CONFIG_FILE: "a: 1\n", S.METRICS_FILE: "{}"}
    for name, text in files.items():
        (model / name).write_text(text)
    assert main(["etl", "--input", str(raw), "--out", str(model), "progress=false"]) == 1
    assert f"{model}: holds a `behrt-rope finetune` output" in one_line_error(capsys)
    assert {p.name: p.read_text() for p in model.iterdir()} == files


def test_stale_lock_left_in_an_output_is_taken_over_by_the_next_run(tmp_path: Path) -> None:
    raw, out = write_cohort(tmp_path / "raw"), tmp_path / "etl"
    out.mkdir()
    (out / S.LOCK_FILE).write_text(lock_record(dead_pid()))
    assert main(["etl", "--input", str(raw), "--out", str(out), "progress=false"]) == 0
    assert (out / S.DONE_MARKER).exists() and not (out / S.LOCK_FILE).exists()


def test_second_predict_to_the_same_file_stops_at_once(
    tmp_path: Path, holder, capsys: pytest.CaptureFixture[str]
) -> None:
    """The check comes before the model is even read: the lock is all it takes."""
    out = tmp_path / "pred.parquet"
    out.write_bytes(b"the live run's earlier output")
    live = holder(tmp_path / f".{out.name}.lock")
    model = tmp_path / "model"
    argv = ["predict", "--model", str(model), "--input", str(tmp_path), "--out", str(out), "progress=false"]
    assert main(argv) == 1
    err = one_line_error(capsys)
    assert f"{out} is being written by process {live.pid}" in err
    assert out.read_bytes() == b"the live run's earlier output"
