"""What every stage does around its work: output directory, resolved config, log file, done-marker.

A stage writes its outputs, then ``config.yaml``, then the ``.done`` marker. A rerun with the same resolved
configuration finds the marker and skips the work (idempotent stages); ``overwrite=true`` forces a rerun.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from behrt_rope import config as config_lib
from behrt_rope import schema

log = logging.getLogger("behrt_rope")


def setup_console_logging(level: int = logging.INFO) -> None:
    """Log lines on stderr, once per process."""
    root = logging.getLogger("behrt_rope")
    if not any(getattr(h, "_behrt_console", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
        handler._behrt_console = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    root.setLevel(level)


def is_done(out_dir: Path, resolved: Any) -> bool:
    """True when ``out_dir`` holds a finished run of exactly this configuration."""
    marker = out_dir / schema.DONE_MARKER
    saved = out_dir / schema.RESOLVED_CONFIG_FILE
    if not (marker.exists() and saved.exists()):
        return False
    return bool(yaml.safe_load(saved.read_text()) == config_lib.to_dict(resolved))


@contextmanager
def stage(out_dir: str | Path, resolved: Any, name: str) -> Iterator[Path]:
    """Open a stage's output directory with a log file; on success save the config and the done-marker."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / schema.DONE_MARKER).unlink(missing_ok=True)
    handler = logging.FileHandler(out / schema.LOG_FILE, mode="a")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("behrt_rope")
    root.addHandler(handler)
    log.info("%s: writing to %s", name, out)
    try:
        yield out
        config_lib.save(resolved, out / schema.RESOLVED_CONFIG_FILE)
        (out / schema.DONE_MARKER).write_text(name + "\n")
    finally:
        root.removeHandler(handler)
        handler.close()


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Pretty, stable JSON (sorted keys are not used: the writer's order is the reading order)."""
    path.write_text(json.dumps(payload, indent=2, default=_jsonable) + "\n")


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "isoformat"):
        return value.isoformat()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value)}")
