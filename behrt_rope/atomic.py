"""Crash-safe file writes: write under a temporary name in the same folder, then rename into place.

A rename within one file system is atomic, so a reader (or a later stage) sees either the old file, the new
complete file, or none; never half of one. A process killed mid-write leaves only a temporary file, named
``.NAME.partial-PID``, which :func:`remove_partials` clears before a stage writes again.

>>> import tempfile
>>> folder = Path(tempfile.mkdtemp())
>>> write_text(folder / "a.txt", "done")
>>> sorted(p.name for p in folder.iterdir()), (folder / "a.txt").read_text()
(['a.txt'], 'done')
"""

from __future__ import annotations

import glob
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

PARTIAL_MARK = ".partial-"  # in the names of temporary files and folders: '.NAME.partial-PID'


def partial_name(path: Path) -> Path:
    """The temporary sibling of ``path`` that this process writes before renaming.

    >>> partial_name(Path("out/model.json")).name.startswith(".model.json.partial-")
    True
    """
    return path.with_name(f".{path.name}{PARTIAL_MARK}{os.getpid()}")


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path to write ``path``'s content to; on success it is flushed and renamed into place.

    On an exception the temporary file is removed and ``path`` is left as it was.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = partial_name(target)
    _remove(tmp)
    try:
        yield tmp
        if not tmp.exists():
            raise FileNotFoundError(f"{tmp}: nothing was written for {target}")
        _fsync_file(tmp)
        os.replace(tmp, target)
        _fsync_dir(target.parent)
    finally:
        _remove(tmp)


def write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_text(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    write_bytes(path, text.encode("utf-8"))


def write_json(path: str | Path, payload: Any, default: Any = None) -> None:
    """Pretty JSON, written atomically (keys in the writer's order, which is the reading order)."""
    write_text(path, json.dumps(payload, indent=2, default=default) + "\n")


@contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield a temporary folder to fill; on success it replaces ``path`` (a folder) as a whole.

    The old folder is first renamed aside and removed after the new one is in place, so a kill between the
    two renames leaves no ``path`` at all (its stage has no ``.done`` marker yet, so nothing reads it).
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = partial_name(target)
    _remove(tmp)
    tmp.mkdir()
    try:
        yield tmp
        old = target.with_name(f".{target.name}.old{PARTIAL_MARK}{os.getpid()}")
        if target.exists():
            os.replace(target, old)
        os.replace(tmp, target)
        _fsync_dir(target.parent)
        _remove(old)
    finally:
        _remove(tmp)


def remove_partials(folder: str | Path) -> int:
    """Delete every temporary file or folder that an interrupted writer left under ``folder``; return how many.

    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> _ = (folder / ".x.parquet.partial-123").write_text("half")
    >>> remove_partials(folder), list(folder.iterdir())
    (1, [])
    """
    root = Path(folder)
    if not root.is_dir():
        return 0
    found = [p for p in root.rglob(f"*{PARTIAL_MARK}*") if p.name.startswith(".")]
    removed = 0
    for p in sorted(found, key=lambda p: len(p.parts)):  # parents first; their children go with them
        if p.exists() or p.is_symlink():
            _remove(p)
            removed += 1
    return removed


def remove_partials_of(path: str | Path) -> int:
    """Delete the temporary files that interrupted writers of ``path`` left beside it; return how many.

    Only ``path``'s own (``.NAME.partial-PID``), so it is safe in a folder that other outputs share.

    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> _ = (folder / ".a.parquet.partial-7").write_text("half")
    >>> _ = (folder / ".b.parquet.partial-7").write_text("someone else's")
    >>> remove_partials_of(folder / "a.parquet"), sorted(p.name for p in folder.iterdir())
    (1, ['.b.parquet.partial-7'])
    """
    target = Path(path)
    found = list(target.parent.glob(f".{glob.escape(target.name)}{PARTIAL_MARK}*"))
    for p in found:
        _remove(p)
    return len(found)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _fsync_file(path: Path) -> None:
    """Flush a written file (or every file of a written folder) to disk before it is renamed into place."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable (a no-op where folders cannot be opened, e.g. on Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
