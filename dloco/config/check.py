"""`ConfigError` and the field checks that every config section's `__post_init__` runs."""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Mapping, Sequence
from typing import Any


class ConfigError(ValueError):
    """An invalid configuration value; the message names the field, the value and the fix."""


def fail(name: str, value: Any, allowed: str) -> typing.NoReturn:
    raise ConfigError(f"{name}={value!r} is invalid: {allowed}")


def require(ok: bool, name: str, value: Any, allowed: str) -> None:
    if not ok:
        fail(name, value, allowed)


def positive(section: str, obj: Any, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        require(v > 0, f"{section}.{n}", v, "must be > 0")


def choice(section: str, obj: Any, name: str, allowed: Sequence[str]) -> None:
    v = getattr(obj, name)
    require(v in allowed, f"{section}.{name}", v, f"must be one of {', '.join(allowed)}")


def finite(section: str, obj: Any) -> None:
    """Every float of `obj`'s fields, and of its tuples and mappings, is finite.

    Runs first in each section's check: ``nan`` fails every comparison (so a later range check would
    name the wrong rule) and ``inf`` passes the ``> 0`` ones, then breaks a schedule, a timer or a
    weight long after the run started.
    """
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, Mapping):
            items = [(f"{f.name}.{k}", v) for k, v in value.items()]
        elif isinstance(value, tuple):
            items = [(f"{f.name}[{i}]", v) for i, v in enumerate(value)]
        else:
            items = [(f.name, value)]
        for name, v in items:
            if isinstance(v, float) and not math.isfinite(v):
                fail(f"{section}.{name}" if section else name, v, "must be a finite number")


def resource(name: str, value: float) -> None:
    """A Ray resource quantity: 0 (none) or at least Ray's precision of 0.0001, which Ray's
    `.options()` enforces only when the actor is created, after the run has started."""
    require(value == 0 or value >= 1e-4, name, value, "must be 0 or >= 0.0001 (Ray's resource precision)")
