"""Run a ``behrt-rope`` command and SIGKILL it at a chosen moment (a helper the crash tests start).

    python tests/killer.py WHEN OUT -- COMMAND ARGS...

WHEN is ``rename:N`` (kill just before the N-th file is renamed into place under OUT: its temporary file is
written, the real one not yet), ``file:NAME`` (the same, before the first rename onto a file called NAME),
``step:N`` (kill as the training step after N optimizer steps starts) or
``never``. The process kills itself with SIGKILL, so nothing (no ``finally``, no atexit) runs: exactly what
a power cut or the OOM killer leaves. Exits 0 only if the command finished without being killed.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def kill_before_rename(out: Path, number: int = 0, name: str = "") -> None:
    real_replace = os.replace
    count = 0

    def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str], **kwargs: object) -> None:
        nonlocal count
        target = Path(os.path.abspath(dst))
        if target.is_relative_to(out):
            count += 1
            if count == number or target.name == name:
                die()
        real_replace(src, dst, **kwargs)  # type: ignore[arg-type]

    os.replace = replace  # type: ignore[assignment]


def kill_at_step(number: int) -> None:
    from behrt_rope.training import tasks

    for cls in (tasks.MaskedLMTask, tasks.MultiLabelTask):
        original = cls.training_step

        def training_step(self, batch, batch_idx, _original=original):  # type: ignore[no-untyped-def]
            if self.trainer.global_step == number:
                die()
            return _original(self, batch, batch_idx)

        cls.training_step = training_step  # type: ignore[method-assign]


def main() -> int:
    when, out, sep, *argv = sys.argv[1:]
    assert sep == "--", "usage: killer.py WHEN OUT -- COMMAND ARGS..."
    kind, _, number = when.partition(":")
    if kind == "rename":
        kill_before_rename(Path(os.path.abspath(out)), number=int(number))
    elif kind == "file":
        kill_before_rename(Path(os.path.abspath(out)), name=number)
    elif kind == "step":
        kill_at_step(int(number))
    from behrt_rope.cli import main as cli

    return cli(argv)


if __name__ == "__main__":
    raise SystemExit(main())
