"""The ``behrt-rope`` command line: parses arguments and dispatches to a pipeline; nothing else.

Each command maps its named flags onto dotted config keys, loads ``--config FILE`` (a YAML preset) and any
``key=value`` overrides on top, and calls ``pipelines.<command>.run(config)``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
import traceback
from dataclasses import dataclass
from types import ModuleType

from behrt_rope import config as config_lib
from behrt_rope.errors import UserError
from behrt_rope.stage import setup_console_logging


@dataclass(frozen=True)
class Flag:
    """A named command-line flag that sets one config key."""

    name: str
    key: str
    help: str
    required: bool = False
    choices: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Command:
    module: str
    summary: str
    flags: tuple[Flag, ...]


_FORMATS = ("visits", "meds", "omop")
COMMANDS: dict[str, Command] = {
    "synth": Command(
        "pipelines.synth",
        "write a seeded synthetic cohort in the visits format",
        (
            Flag("--out", "out", "output directory", required=True),
            Flag("--patients", "synth.patients", "number of patients"),
            Flag("--seed", "synth.seed", "random seed"),
        ),
    ),
    "etl": Command(
        "pipelines.etl",
        "turn raw histories into the token dataset (vocabulary, splits, manifest, quarantine)",
        (
            Flag("--input", "input", "directory with the raw tables", required=True),
            Flag("--out", "out", "output directory", required=True),
            Flag("--format", "etl.format", "input layout", choices=_FORMATS),
        ),
    ),
    "pretrain": Command(
        "pipelines.pretrain",
        "masked-language-model pre-training on the train split",
        (
            Flag("--data", "data", "ETL output directory", required=True),
            Flag("--out", "out", "output directory", required=True),
            Flag("--max-epochs", "trainer.max_epochs", "passes over the train split"),
            Flag("--max-minutes", "trainer.max_minutes", "wall-clock budget of the stage (0: none)"),
            Flag("--resume", "resume", "checkpoint to resume from ('last' for OUT/checkpoints/last.ckpt)"),
        ),
    ),
    "finetune": Command(
        "pipelines.finetune",
        "train multi-label diagnosis prediction for a task",
        (
            Flag("--data", "data", "ETL output directory", required=True),
            Flag("--out", "out", "output directory", required=True),
            Flag("--pretrained", "pretrained", "pre-training output directory (default: from scratch)"),
            Flag("--task", "task.name", "prediction task", choices=("next_visit", "6m", "12m")),
            Flag("--max-epochs", "trainer.max_epochs", "passes over the train split"),
            Flag("--max-minutes", "trainer.max_minutes", "wall-clock budget of the stage (0: none)"),
            Flag("--resume", "resume", "checkpoint to resume from ('last' for OUT/checkpoints/last.ckpt)"),
        ),
    ),
    "predict": Command(
        "pipelines.predict",
        "score raw histories with a fine-tuned model",
        (
            Flag("--model", "model", "fine-tuning output directory", required=True),
            Flag("--input", "input", "directory with the raw tables", required=True),
            Flag("--format", "format", "input layout", choices=_FORMATS),
            Flag("--out", "out", "predictions Parquet file", required=True),
            Flag("--as-of", "as_of", "last day of history used (ISO date; default: today)"),
        ),
    ),
    "evaluate": Command(
        "pipelines.evaluate",
        "held-out metrics, plots and report.html, beside a logistic-regression baseline",
        (
            Flag("--model", "model", "fine-tuning output directory", required=True),
            Flag("--data", "data", "ETL output directory", required=True),
            Flag("--out", "out", "output directory", required=True),
        ),
    ),
}


def _load_pipeline(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(COMMANDS[name].module)
    except ModuleNotFoundError as err:
        if err.name == COMMANDS[name].module:
            return None
        raise


def build_parser(detail: str | None = None) -> argparse.ArgumentParser:
    """The parser. Only command ``detail`` imports its pipeline (for the config keys in its epilog), so
    that ``behrt-rope etl`` does not pay for importing torch and Lightning."""
    parser = argparse.ArgumentParser(
        prog="behrt-rope",
        description="BEHRT with rotary position embedding: EHR visit histories to diagnosis-risk predictions.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, command in COMMANDS.items():
        epilog = None
        if name == detail:
            module = _load_pipeline(name)
            epilog = (
                "not built yet in this version"
                if module is None
                else ("config keys (set with key=value):\n" + "\n".join(config_lib.describe(module.Config)))
            )
        p = sub.add_parser(
            name,
            help=command.summary,
            description=command.summary,
            epilog=epilog,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        for flag in command.flags:
            dest = flag.name.lstrip("-").replace("-", "_")
            p.add_argument(flag.name, dest=dest, required=flag.required, choices=flag.choices, help=flag.help)
        p.add_argument("--config", help="YAML preset (see configs/)")
        p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(chosen if chosen in COMMANDS else None)
    args = parser.parse_args(overrides_last(argv))
    if args.command is None:
        parser.print_help()
        return 2
    module = _load_pipeline(args.command)
    if module is None:
        print(f"behrt-rope {args.command}: not built yet in this version", file=sys.stderr)
        return 2
    setup_console_logging()
    try:
        resolved = resolve_config(args.command, args, module)
        out = module.run(resolved)
    except UserError as err:
        print(f"behrt-rope {args.command}: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"behrt-rope {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # an internal error: one line for the user, the traceback on request
        if os.environ.get("BEHRT_ROPE_DEBUG"):
            traceback.print_exc()
        print(
            f"behrt-rope {args.command}: internal error: {type(err).__name__}: {err} "
            "(set BEHRT_ROPE_DEBUG=1 for the traceback)",
            file=sys.stderr,
        )
        return 3
    print(out)
    return 0


def overrides_last(argv: list[str]) -> list[str]:
    """``argv`` with its ``key=value`` overrides moved after the flags, in their order: argparse takes one run
    of positionals only, and refused overrides on both sides of a flag as unrecognised. A flag's value
    (the argument after a flag without '=') stays in place, whatever it holds.

    >>> overrides_last(["etl", "a=1", "--out", "x=y", "b=2", "--format", "meds"])
    ['etl', '--out', 'x=y', '--format', 'meds', 'a=1', 'b=2']
    """
    kept: list[str] = []
    overrides: list[str] = []
    is_value = False
    for arg in argv:
        (overrides if not is_value and "=" in arg and not arg.startswith("-") else kept).append(arg)
        is_value = arg.startswith("--") and "=" not in arg and arg not in ("--help", "--version")
    return kept + overrides


def resolve_config(name: str, args: argparse.Namespace, module: ModuleType) -> object:
    """Preset, then named flags, then ``key=value`` overrides; later wins."""
    preset = config_lib.load_yaml(args.config) if args.config else {}
    overrides: list[str] = []
    for flag in COMMANDS[name].flags:
        value = getattr(args, flag.name.lstrip("-").replace("-", "_"))
        if value is not None:
            overrides.append(f"{flag.key}={value}")
    overrides.extend(args.overrides)
    cfg = config_lib.build(module.Config, preset, overrides)
    assert dataclasses.is_dataclass(cfg)
    return cfg


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("behrt-rope")
    except PackageNotFoundError:
        return "0+unknown"


if __name__ == "__main__":
    raise SystemExit(main())
