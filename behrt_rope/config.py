"""Typed configuration: dataclasses, YAML presets and dotted ``key=value`` overrides.

Values are converted by the *declared* field type, never guessed: ``etl.code_truncate=3`` becomes the int 3,
while a ``str`` field given ``250`` stays the string ``"250"``. Unknown keys stop with a "did you mean".

>>> from behrt_rope.etl.config import EtlConfig
>>> cfg = build(EtlConfig, {"split": {"salt": "x"}}, ["code_truncate=3", "split.salt=250"])
>>> cfg.code_truncate, cfg.split.salt
(3, '250')
>>> build(EtlConfig, {}, ["split.sallt=3"])
Traceback (most recent call last):
...
behrt_rope.config.ConfigError: unknown config key 'split.sallt' (did you mean 'split.salt'?)
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

from behrt_rope import atomic
from behrt_rope.errors import UserError

T = TypeVar("T")


class ConfigError(UserError, ValueError):
    """A configuration problem the user can fix; the message says how."""


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML preset with every scalar kept as text; the dataclass field types convert them.

    YAML's own guessing would read the ICD-9 code ``0250`` as the octal number 168: the base loader does not.
    """
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.load(path.read_bytes().decode("utf-8"), Loader=yaml.BaseLoader) or {}
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.object[err.start]:#04x} at offset {err.start})") from None
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        line = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
        problem = getattr(err, "problem", None) or type(err).__name__
        raise ConfigError(f"{path}: not valid YAML{line}: {problem}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config file must hold a mapping at the top level")
    return data


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """Turn ``["a.b=1", "c=x"]`` into a nested dict of raw strings.

    >>> parse_overrides(["model.hidden_size=64", "seed=3"])
    {'model': {'hidden_size': '64'}, 'seed': '3'}
    """
    nested: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        key, value = item.split("=", 1)
        node = nested
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return nested


def build(cls: type[T], data: dict[str, Any], overrides: list[str] | None = None, prefix: str = "") -> T:
    """Instantiate dataclass ``cls`` from ``data`` (a preset) with ``overrides`` applied on top."""
    merged = _merge(data, parse_overrides(overrides or []))
    return _build(cls, merged, prefix)


def to_dict(obj: Any) -> Any:
    """A dataclass tree as plain YAML-able values."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def save(obj: Any, path: str | Path) -> None:
    """Write the resolved configuration next to a stage's outputs."""
    atomic.write_text(path, yaml.safe_dump(to_dict(obj), sort_keys=False))


def field_help(cls: type) -> dict[str, str]:
    """The docstring under each field (attribute docstrings), keyed by field name, for ``--help``."""
    import ast
    import inspect
    import textwrap

    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = ast.parse(source).body[0]
    docs: dict[str, str] = {}
    statements = getattr(body, "body", [])
    for node, nxt in itertools.pairwise(statements):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def describe(cls: type, prefix: str = "", defaults: Any = None) -> list[str]:
    """One line per leaf key: ``key (type, default): help``; used by the CLI's ``--help``.

    ``defaults``: the instance whose values are the defaults shown (a parent's ``default_factory`` may set
    a nested section's defaults apart from its class's, e.g. fine-tuning's trainer).
    """
    lines: list[str] = []
    helps = field_help(cls)
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        tp = hints[f.name]
        default = _field_default(f) if defaults is None else getattr(defaults, f.name)
        if dataclasses.is_dataclass(tp):
            lines.extend(describe(tp, key + ".", default))  # type: ignore[arg-type]
            continue
        lines.append(f"  {key} = {default!r}  ({_type_name(tp)}) {helps.get(f.name, '')}".rstrip())
    return lines


def _field_default(f: dataclasses.Field) -> Any:
    """A field's default value (its factory called), or None when it has none."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``top`` over ``base``, recursively for nested mappings (neither is changed).

    >>> merge({"a": 1, "b": {"c": 2, "d": 3}}, {"b": {"c": 9}})
    {'a': 1, 'b': {'c': 9, 'd': 3}}
    """
    return _merge(base, top)


# -------------------------------------------------------------------------------------------------------------
def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _build(cls: type[T], data: dict[str, Any], prefix: str) -> T:
    if not isinstance(data, dict):
        raise ConfigError(f"config key '{prefix.rstrip('.')}' must be a mapping, got {data!r}")
    hints = get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    for key in data:
        if key not in names:
            full = f"{prefix}{key}"
            candidates = [f"{prefix}{n}" for n in names]
            close = difflib.get_close_matches(full, candidates, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else f" (known: {', '.join(names)})"
            raise ConfigError(f"unknown config key {full!r}{hint}")
    kwargs: dict[str, Any] = {}
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    for name in names:
        if name not in data:
            continue
        tp = hints[name]
        key = f"{prefix}{name}"
        if dataclasses.is_dataclass(tp):
            # Start from the parent's default for this section (its default_factory may differ from the
            # nested class's own defaults), then apply what was given.
            default = _field_default(fields[name])
            base = to_dict(default) if dataclasses.is_dataclass(default) else {}
            merged = _merge(base, data[name]) if isinstance(data[name], dict) else data[name]
            kwargs[name] = _build(tp, merged, key + ".")  # type: ignore[arg-type]
        else:
            kwargs[name] = _convert(data[name], tp, key)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{prefix.rstrip('.') or cls.__name__}: {err}") from err


def _convert(value: Any, tp: Any, key: str) -> Any:
    origin = get_origin(tp)
    args = get_args(tp)
    if origin in (Union, types.UnionType):
        blank = value is None or (isinstance(value, str) and value.strip().lower() in ("", "null", "none", "~"))
        if blank and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _convert(value, arg, key)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if errors else f"config key '{key}': bad value {value!r}")
    if origin is Literal:
        text = str(value)
        choices = [str(a) for a in args]
        if text not in choices:
            raise ConfigError(f"config key '{key}' must be one of {choices}, got {value!r}")
        return args[choices.index(text)]
    if origin in (list, tuple):
        items = value
        if isinstance(value, str):
            items = [v.strip() for v in value.strip("[]()").split(",") if v.strip()]
        if not isinstance(items, (list, tuple)):
            raise ConfigError(f"config key '{key}' must be a list, got {value!r}")
        inner = args[0] if args else str
        converted = [_convert(v, inner, key) for v in items]
        return tuple(converted) if origin is tuple else converted
    if tp is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("true", "1", "yes", "on"):
            return True
        if text in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"config key '{key}' must be true or false, got {value!r}")
    if tp in (int, float):
        if isinstance(value, bool):
            raise ConfigError(f"config key '{key}' must be a number, got {value!r}")
        try:
            number = tp(value)
        except (TypeError, ValueError):
            raise ConfigError(f"config key '{key}' must be {tp.__name__}, got {value!r}") from None
        if tp is int and isinstance(value, float) and value != number:
            raise ConfigError(f"config key '{key}' must be an integer, got {value!r}")
        return number
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"config key '{key}' must be text, got {value!r}")
        return str(value)
    if tp is typing.Any:
        return value
    raise ConfigError(f"config key '{key}': unsupported type {tp}")


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "|".join(str(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))
