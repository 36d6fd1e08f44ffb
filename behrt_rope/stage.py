"""What every stage does around its work: lock, output directory, resolved config, log file, done-marker.

A stage takes the output directory's lock (one writer per output, see :mod:`behrt_rope.locking`), removes
the ``.done`` marker and any temporary files an interrupted run left, writes its outputs (each through a
temporary name renamed into place, see :mod:`behrt_rope.atomic`), then ``config.yaml``, then ``.done``. So a
directory without ``.done`` is incomplete, and every stage that reads another stage's output checks for it
(:func:`require_done`). A rerun with the same resolved configuration finds the marker and skips the work
(idempotent stages); ``overwrite=true`` forces a rerun.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import yaml

from behrt_rope import atomic, schema
from behrt_rope import config as config_lib
from behrt_rope.errors import ArtifactError
from behrt_rope.locking import output_lock

log = logging.getLogger("behrt_rope")
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID")
"""Environment variables that launchers (Lightning, torchrun, SLURM) set in each distributed process."""


def setup_console_logging(level: int = logging.INFO) -> None:
    """Log lines on stderr, one handler per process, following ``sys.stderr`` if it was replaced since
    (test runners and notebooks swap it; a handler left on a closed stream prints "Logging error")."""
    root = logging.getLogger("behrt_rope")
    console = [h for h in root.handlers if getattr(h, "_behrt_console", False)]
    if not console:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
        handler._behrt_console = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    for existing in console:
        if isinstance(existing, logging.StreamHandler) and existing.stream is not sys.stderr:
            with existing.lock or contextlib.nullcontext():  # not setStream: it flushes the old, maybe closed, stream
                existing.stream = sys.stderr
    root.setLevel(level)


def is_primary_process() -> bool:
    """False in the extra processes of a distributed run (rank > 0), which neither lock nor mark outputs."""
    return all(os.environ.get(name, "0") in ("", "0") for name in RANK_VARIABLES)


ALWAYS_IGNORED = ("overwrite", "resume")
"""Instructions about how to run, not settings of the work: a rerun without them is the same run."""


def is_done(
    out_dir: Path, resolved: Any, ignore: Iterable[str] = (), inputs: Iterable[str | Path | None] | None = None
) -> bool:
    """True when ``out_dir`` holds a finished run of exactly this configuration, made from the same runs of
    the stage directories it reads (``inputs``): a model re-trained since makes its evaluation stale.

    ``ignore``: dotted keys (e.g. ``model.wide``) left out of the comparison, for settings that the stage
    records but does not use.
    """
    marker = out_dir / schema.DONE_MARKER
    saved = out_dir / schema.RESOLVED_CONFIG_FILE
    if not (marker.exists() and saved.exists()):
        return False
    before, now = yaml.safe_load(saved.read_text()), config_lib.to_dict(resolved)
    for key in (*ALWAYS_IGNORED, *ignore):
        for tree in (before, now):
            _drop(tree, key.split("."))
    if before != now or inputs is None:  # no inputs given: the configuration decides alone
        return bool(before == now)
    recorded = out_dir / schema.INPUTS_FILE
    made_from = json.loads(recorded.read_text()) if recorded.exists() else {}
    return bool(made_from == input_runs(inputs))


def input_runs(inputs: Iterable[str | Path | None]) -> dict[str, int]:
    """Which finished run each input stage directory holds: its ``.done`` marker's write time (ns), which
    changes with every run that finishes there (a skipped rerun does not rewrite it)."""
    markers = {Path(path).resolve(): Path(path) / schema.DONE_MARKER for path in inputs if path}
    return {str(folder): marker.stat().st_mtime_ns for folder, marker in markers.items() if marker.exists()}


def _drop(tree: Any, path: list[str]) -> None:
    """Remove ``tree[path[0]][path[1]]...`` if it is there."""
    for name in path[:-1]:
        tree = tree.get(name) if isinstance(tree, dict) else None
    if isinstance(tree, dict):
        tree.pop(path[-1], None)


def require_done(stage_dir: str | Path, producer: str) -> Path:
    """``stage_dir`` if it holds a finished ``behrt-rope producer`` output; else a one-line ArtifactError."""
    path = Path(stage_dir)
    if not path.is_dir():
        raise ArtifactError(f"{path}: not found; expected a `behrt-rope {producer}` output directory")
    marker = path / schema.DONE_MARKER
    if not marker.exists() and not (path / schema.LOG_FILE).exists():
        raise ArtifactError(f"{path}: not a `behrt-rope {producer}` output; run `behrt-rope {producer}` first")
    if not marker.exists():
        raise ArtifactError(
            f"{path}: incomplete `behrt-rope {producer}` output (no {schema.DONE_MARKER} marker: its run was "
            f"interrupted or is still running); rerun `behrt-rope {producer}` into it"
        )
    made_by = marker.read_text().strip()
    if made_by != producer:
        raise ArtifactError(f"{path}: holds a `behrt-rope {made_by}` output, expected a `{producer}` output")
    return path


@contextmanager
def stage(out_dir: str | Path, resolved: Any, name: str, inputs: Iterable[str | Path | None] = ()) -> Iterator[Path]:
    """Lock and open a stage's output directory with a log file; on success save the config, which runs of
    the ``inputs`` stage directories it was made from (see :func:`is_done`), and ``.done``.

    In a distributed run only the primary process locks the directory and writes the config and marker.
    """
    made_from = input_runs(inputs)  # before the work: what the run reads is what it was made from
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    primary = is_primary_process()
    with ExitStack() as stack:
        if primary:
            stack.enter_context(output_lock(out / schema.LOCK_FILE, out))
            _refuse_another_stage(out, name)
            (out / schema.DONE_MARKER).unlink(missing_ok=True)
            atomic.remove_partials(out)
        handler = logging.FileHandler(out / schema.LOG_FILE, mode="a")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root = logging.getLogger("behrt_rope")
        root.addHandler(handler)
        stack.callback(handler.close)
        stack.callback(root.removeHandler, handler)
        log.info("%s: writing to %s", name, out)
        yield out
        if primary:
            config_lib.save(resolved, out / schema.RESOLVED_CONFIG_FILE)
            atomic.write_text(out / schema.INPUTS_FILE, json.dumps(made_from, indent=1) + "\n")
            atomic.write_text(out / schema.DONE_MARKER, name + "\n")


def _refuse_another_stage(out: Path, name: str) -> None:
    """A one-line ArtifactError when ``out`` holds another stage's finished output (``evaluate --out
    MODEL_DIR``): writing there would replace its marker, config and metrics and break it for later stages."""
    marker = out / schema.DONE_MARKER
    made_by = marker.read_text().strip() if marker.exists() else name
    if made_by != name:
        raise ArtifactError(
            f"{out}: holds a `behrt-rope {made_by}` output; give `behrt-rope {name}` its own --out directory"
        )


@contextmanager
def file_output(
    out: str | Path, related: Iterable[str | Path] = (), check: Callable[[], None] = lambda: None
) -> Iterator[Path]:
    """Lock a single-file output (``.OUT.lock`` beside it), call ``check`` (which may refuse ``out``), and
    remove it (a file, or a folder of parts) and its ``related`` files, with any temporary files an
    interrupted run left for them.

    The caller writes ``related`` files (sidecars) and then ``out`` itself, atomically and last, so that
    ``out`` exists only when everything it goes with is complete.
    """
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    with output_lock(path.with_name(f".{path.name}.lock"), path):
        check()
        for file in (path, *map(Path, related)):
            if file.is_dir() and not file.is_symlink():
                shutil.rmtree(file)
            else:
                file.unlink(missing_ok=True)
            atomic.remove_partials_of(file)
        yield path


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Pretty, stable JSON written atomically (sorted keys are not used: the writer's order is the reading order)."""
    atomic.write_json(path, payload, default=_jsonable)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "isoformat"):
        return value.isoformat()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value)}")
