"""One writer per output: a lock file naming the process (pid, host) that writes an output directory.

The lock is created with ``O_EXCL``, so of two runs started at once exactly one gets it. A run that finds a
lock held by a live process stops at once with :class:`OutputLockedError`. A lock left by a process that has
died (same host, pid no longer running) is stale: it is taken over, under an ``flock`` of the folder so that
two runs cannot both take over the same stale lock. A lock held from another host cannot be checked; the
error says so and names the file to delete once that run is known to be gone.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from behrt_rope.errors import UserError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: takeover is then guarded by O_EXCL alone
    fcntl = None  # type: ignore[assignment]


class OutputLockedError(UserError):
    """Another live run is writing the same output."""


@contextmanager
def output_lock(lock_file: str | Path, what: str | Path) -> Iterator[dict[str, Any]]:
    """Hold ``lock_file`` while the body writes ``what``; yields the lock's record (pid, host, token)."""
    path = Path(lock_file)
    record = acquire(path, what)
    try:
        yield record
    finally:
        release(path, record)


def acquire(path: Path, what: str | Path) -> dict[str, Any]:
    """Create the lock or take over a stale one; raise :class:`OutputLockedError` when a live run holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "token": uuid.uuid4().hex,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(sys.argv[:2]),
    }
    for _ in range(5):
        if _create(path, record):
            return record
        holder = _read(path)
        if holder is None:  # being written this instant, or vanished: look again
            time.sleep(0.05)
            holder = _read(path)
            if holder is None and path.exists() and time.time() - path.stat().st_mtime < 5:
                continue
        if holder is not None and not is_stale(holder):
            raise OutputLockedError(_held_message(path, what, holder))
        _take_over(path, holder)
    raise OutputLockedError(f"{what}: could not take the lock {path}; another run keeps replacing it")


def release(path: Path, record: dict[str, Any]) -> None:
    """Remove the lock if it is still ours (a takeover by another run is left alone)."""
    holder = _read(path)
    if holder is not None and holder.get("token") == record["token"]:
        path.unlink(missing_ok=True)


def is_stale(holder: dict[str, Any]) -> bool:
    """True when the lock's process is known to be gone: same host and its pid is not running."""
    if holder.get("host") != socket.gethostname():
        return False
    pid = holder.get("pid")
    return not isinstance(pid, int) or not pid_alive(pid)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (a zombie counts as gone)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _create(path: Path, record: dict[str, Any]) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    return True


def _read(path: Path) -> dict[str, Any] | None:
    try:
        holder = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


def _take_over(path: Path, stale: dict[str, Any] | None) -> None:
    """Delete the stale lock ``stale`` unless, by the time the folder is locked, it has been replaced."""
    with _folder_guard(path.parent):
        now = _read(path)
        if now == stale or (now is None and stale is None):
            path.unlink(missing_ok=True)


@contextmanager
def _folder_guard(folder: Path) -> Iterator[None]:
    if fcntl is None:
        yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError as err:  # pragma: no cover
            if err.errno != errno.EBADF:
                raise
        os.close(fd)


def _held_message(path: Path, what: str | Path, holder: dict[str, Any]) -> str:
    who = f"process {holder.get('pid')} on {holder.get('host')} (started {holder.get('started')})"
    if holder.get("host") != socket.gethostname():
        return (
            f"{what} is being written by {who}; wait for it to finish, or delete {path} if that run is gone "
            "(it runs on another host, so this one cannot check)"
        )
    return f"{what} is being written by {who}; wait for it to finish or stop it, then run again"
