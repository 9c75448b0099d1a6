"""Building a `RunConfig` from plain values: preset → YAML file → dotted overrides (``"sync.every=48"``).

Values are checked against the dataclass field types (ints widen to floats) before the sections'
own validation runs; every failure raises `ConfigError` naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from dloco.config.check import ConfigError, fail, require
from dloco.config.run import ALGORITHM_DEFAULTS, ALGORITHMS, BLOCKING_ALGORITHMS, PRESETS, RunConfig
from dloco.config.system import LearnersConfig


def _section_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


_NUMBER = re.compile(r"[+-]?(\d[\d_]*(\.\d*)?|\.\d+)([eE][+-]?\d+)?")


def _number(value: Any) -> Any:
    """A number in any notation: YAML 1.1 (PyYAML) reads ``3e-4`` or ``2e8`` (no dot) as a string."""
    if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        return float(value.strip().replace("_", ""))
    return value


def _coerce(name: str, value: Any, tp: Any) -> Any:
    """Checks a YAML/override value against the field type; ints widen to floats; a number in any
    notation (``3e-4``, ``2e8``, ``1_000``) is a number, and an integral one fits an int field."""
    origin = typing.get_origin(tp)
    if origin is typing.Union or isinstance(tp, types.UnionType):
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
        origin = typing.get_origin(tp)
    if tp is bool:
        require(isinstance(value, bool), name, value, "must be true or false")
    elif tp is int:
        if isinstance(n := _number(value), float) and n.is_integer():
            value = int(n)
        require(isinstance(value, int) and not isinstance(value, bool), name, value, "must be an integer")
    elif tp is float:
        value = _number(value)
        require(isinstance(value, int | float) and not isinstance(value, bool), name, value, "must be a number")
        value = float(value)
    elif tp is str:
        require(isinstance(value, str), name, value, "must be a string")
    elif origin is tuple and not dataclasses.is_dataclass(typing.get_args(tp)[0]):
        require(isinstance(value, list | tuple), name, value, "must be a list")
        value = tuple(_coerce(f"{name}[{i}]", v, typing.get_args(tp)[0]) for i, v in enumerate(value))
    elif origin is tuple and dataclasses.is_dataclass(typing.get_args(tp)[0]):
        require(isinstance(value, list | tuple), name, value, "must be a list of mappings")
        item = typing.get_args(tp)[0]
        value = tuple(
            _build(item, v, f"{name}[{i}].") if isinstance(v, Mapping) else fail(f"{name}[{i}]", v, "must be a mapping")
            for i, v in enumerate(value)
        )
    elif origin in (Mapping, dict) or tp in (Mapping, dict):
        require(isinstance(value, Mapping), name, value, "must be a mapping")
        value = {str(k): _coerce(f"{name}.{k}", v, typing.get_args(tp)[1]) for k, v in value.items()}
    return value


def _build(cls: type, values: Mapping[str, Any], prefix: str) -> Any:
    hints = _section_types(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if key not in fields:
            fail(name, value, f"unknown key; allowed keys here: {', '.join(sorted(fields))}")
        tp = hints[key]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            require(isinstance(value, Mapping), name, value, "must be a mapping of its fields")
            kwargs[key] = _build(tp, value, f"{name}.")
        else:
            kwargs[key] = _coerce(name, value, tp)
    return cls(**kwargs)


def _merge(base: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in update.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) and k != "resources":
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def _parse_override(text: str) -> dict[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        fail("override", text, "use dotted KEY=VALUE, e.g. sync.every=48")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    node: dict[str, Any] = {}
    cur = node
    parts = key.strip().split(".")
    for p in parts[:-1]:
        cur[p] = {}
        cur = cur[p]
    cur[parts[-1]] = value
    return node


def from_dict(values: Mapping[str, Any]) -> RunConfig:
    """Builds a `RunConfig` from nested plain values on top of the named preset (default tiny)."""
    preset = values.get("preset", "tiny")
    require(preset in PRESETS, "preset", preset, f"must be one of {', '.join(PRESETS)}")
    algorithm = values.get("algorithm", "decoupled")
    require(algorithm in ALGORITHMS, "algorithm", algorithm, f"must be one of {', '.join(ALGORITHMS)}")
    merged = _merge(_merge(PRESETS[preset], ALGORITHM_DEFAULTS.get(algorithm, {})), values)
    if algorithm in BLOCKING_ALGORITHMS and "quorum" not in merged.get("syncer", {}):
        learners = _build(LearnersConfig, merged.get("learners", {}), "learners.")
        merged = _merge(merged, {"syncer": {"quorum": learners.count}})  # K = M unless set
    return _build(RunConfig, merged, "")


def load(path: str | Path | None = None, overrides: Sequence[str] = ()) -> RunConfig:
    """Loads a run config: preset → YAML file → dotted overrides (``"sync.every=48"``).

    A ``.json`` file is read as JSON: a run's ``config.json`` loads as the config it was written
    from (YAML 1.1 would read a float such as ``1e-08`` as a string).

    Raises:
      ConfigError: unknown key, wrong type, invalid value or invalid combination; a file that is
        not UTF-8 YAML (or JSON) holding a mapping.
      OSError: `path` cannot be read (FileNotFoundError, IsADirectoryError, PermissionError, ...).
    """
    values: dict[str, Any] = {}
    if path is not None:
        kind = "JSON" if Path(path).suffix == ".json" else "YAML"
        try:
            text = Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not a {kind} file: not UTF-8 text ({e.reason} at byte {e.start})") from None
        try:
            loaded = (json.loads(text) if kind == "JSON" else yaml.safe_load(text)) or {}
        except (yaml.YAMLError, ValueError) as e:
            raise ConfigError(f"{path}: not valid {kind} ({e})") from None
        require(isinstance(loaded, Mapping), str(path), type(loaded).__name__, f"must be a {kind} mapping")
        values = dict(loaded)
    for text in overrides:
        values = _merge(values, _parse_override(text))
    return from_dict(values)


def replace(cfg: RunConfig, *overrides: str) -> RunConfig:
    """Returns `cfg` with dotted overrides applied (validated like `load`)."""
    values = _merge(cfg.to_dict(), {})
    for text in overrides:
        values = _merge(values, _parse_override(text))
    return _build(RunConfig, values, "")
