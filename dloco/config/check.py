"""`ConfigError` and the field checks that every config section's `__post_init__` runs."""

from __future__ import annotations

import typing
from collections.abc import Sequence
from typing import Any


class ConfigError(ValueError):
    """An invalid configuration value; the message names the field, the value and the fix."""


def _fail(name: str, value: Any, allowed: str) -> typing.NoReturn:
    raise ConfigError(f"{name}={value!r} is invalid: {allowed}")


def _check(ok: bool, name: str, value: Any, allowed: str) -> None:
    if not ok:
        _fail(name, value, allowed)


def _positive(section: str, obj: Any, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        _check(v > 0, f"{section}.{n}", v, "must be > 0")


def _choice(section: str, obj: Any, name: str, allowed: Sequence[str]) -> None:
    v = getattr(obj, name)
    _check(v in allowed, f"{section}.{name}", v, f"must be one of {', '.join(allowed)}")
