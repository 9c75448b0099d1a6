"""Generates docs/CONFIG.md from the config dataclasses: ``python scripts/gen_config_docs.py``.

`render()` walks `dloco.config.RunConfig` recursively (one section per nested dataclass, including
the items of tuple-of-dataclass fields such as ``learners.groups[]``) and lists every field with
its dotted name, type, default, the ALGORITHM.md symbol named in `dloco.config`'s docstring, and
the comment on its line in the source; then the presets and the per-algorithm defaults as dotted
overrides. `tests/test_docs.py` compares `render()` with the committed file.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "CONFIG.md"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from dloco import config  # noqa: E402


def symbols() -> dict[str, str]:
    """Dotted name → symbol, from the ``M  learners.count`` pairs in `dloco.config`'s docstring."""
    return {name: sym for sym, name in re.findall(r"(\S)\s{2,}([a-z_]+\.[a-z_]+)", config.__doc__ or "")}


def _type_name(tp: Any) -> str:
    if isinstance(tp, type) and typing.get_origin(tp) is None:
        return tp.__name__
    text = str(tp)
    for prefix in ("typing.", "collections.abc."):
        text = text.replace(prefix, "")
    return re.sub(r"\bdloco\.config\.(?:\w+\.)*", "", text)  # the sections live in dloco.config's modules


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        if dataclasses.is_dataclass(value):
            return "(section)"
    else:
        return "(required)"
    return _value(value)


def _value(value: Any) -> str:
    """A value as it is written in a YAML RunConfig."""
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {v}" for k, v in value.items()) + "}"
    if isinstance(value, tuple):
        return "[" + ", ".join(map(str, value)) + "]"
    if isinstance(value, int) and abs(value) >= 10_000:
        return f"{value:_}"
    return repr(value)


def _comments(cls: type) -> dict[str, str]:
    """Field name → the ``# comment`` at the end of its line in the class source."""
    out = {}
    for line in inspect.getsource(cls).splitlines():
        m = re.match(r"\s+(\w+): [^#]*?=[^#]*#\s*(.+)$", line)
        if m:
            out[m.group(1)] = m.group(2).strip()
    return out


def _choices(cls: type) -> dict[str, str]:
    """Field name → its allowed values, from the ``choice(section, self, "name", allowed)`` checks."""
    out, src = {}, inspect.getsource(cls)
    local = dict(re.findall(r"^\s+(\w+) = (\([^)]*\))\s*$", src, re.M))  # e.g. dtypes = ("fp32", ...)
    for m in re.finditer(r'\bchoice\(\s*"\w*",\s*self,\s*"(\w+)",\s*([^\n]+?)\)\s*$', src, re.M):
        name, allowed = m.group(1), m.group(2).strip()
        allowed = local.get(allowed, allowed)
        if re.fullmatch(r"[A-Z_]+", allowed):
            values = getattr(config, allowed, None)
        elif re.fullmatch(r"tuple\(\w+\)", allowed):
            values = getattr(config, allowed[6:-1], None)
        else:
            values = re.findall(r'"([^"]*)"', allowed) or None
        if values:
            out[name] = "one of: " + ", ".join(map(str, values))
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _item_type(tp: Any) -> type | None:
    """The dataclass inside ``tuple[X, ...]``, else None."""
    if typing.get_origin(tp) is tuple:
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        if args and dataclasses.is_dataclass(args[0]):
            return args[0]
    return None


def _sections(cls: type, prefix: str) -> list[tuple[str, type]]:
    out = [(prefix, cls)]
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out += _sections(tp, f"{prefix}{f.name}.")
        elif (item := _item_type(tp)) is not None:
            out += _sections(item, f"{prefix}{f.name}[].")
    return out


def _section(prefix: str, cls: type, syms: dict[str, str]) -> list[str]:
    title = f"`{prefix[:-1]}` — {cls.__name__}" if prefix else f"Top level — {cls.__name__}"
    lines = [f"## {title}", "", inspect.cleandoc(cls.__doc__ or ""), ""]
    lines += ["| key | type | default | symbol | note |", "|---|---|---|---|---|"]
    hints = typing.get_type_hints(cls)
    notes = _comments(cls)
    allowed = _choices(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        name = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            note = f"section, see `{name}` below"
        elif _item_type(tp) is not None:
            note = f"list of {_item_type(tp).__name__}, see `{name}[]` below"
        else:
            note = "; ".join(n for n in (allowed.get(f.name), notes.get(f.name)) if n)
        dotted = name.replace("[].", ".")
        cells = [f"`{name}`", f"`{_type_name(tp)}`", f"`{_default(f)}`", syms.get(dotted, ""), note]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return [*lines, ""]


def _flatten(values: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for k, v in values.items():
        if isinstance(v, Mapping) and k != "resources":
            out += _flatten(v, f"{prefix}{k}.")
        else:
            out.append((f"{prefix}{k}", v))
    return out


def _overrides(title: str, intro: str, table: Mapping[str, Mapping[str, Any]]) -> list[str]:
    lines = [f"## {title}", "", intro, ""]
    for name, values in table.items():
        lines += [f"### `{name}`", ""]
        flat = _flatten(values)
        if not flat:
            lines += ["(no overrides: the dataclass defaults)", ""]
            continue
        lines += ["| key | value |", "|---|---|"]
        lines += [f"| `{k}` | `{_cell(_value(v))}` |" for k, v in flat]
        lines.append("")
    return lines


def render() -> str:
    """The full text of docs/CONFIG.md for the current `dloco.config`."""
    syms = symbols()
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated from dloco/config/ by scripts/gen_config_docs.py; do not edit by hand.",
        "     Regenerate with: python scripts/gen_config_docs.py (tests/test_docs.py fails when stale). -->",
        "",
        inspect.cleandoc(config.__doc__ or ""),
        "",
        "Every key below can be set in a YAML RunConfig (nested mappings) or on the command line",
        "(`dloco train --set section.key=value`). Symbols are those of `docs/ALGORITHM.md` §2",
        "(see also `docs/SYMBOLS.md`).",
        "",
    ]
    for prefix, cls in _sections(config.RunConfig, ""):
        lines += _section(prefix, cls, syms)
    lines += _overrides(
        "Presets",
        "A preset is a set of overrides on the dataclass defaults, applied first (`preset: NAME`).",
        config.PRESETS,
    )
    algo = getattr(config, "ALGORITHM_DEFAULTS", None)
    if algo:
        intro = (
            "What each baseline implies (ALGORITHM.md §9), applied over the preset and under the YAML file "
            "and overrides (`algorithm: NAME`); a conflicting explicit value fails validation."
        )
        blocking = getattr(config, "BLOCKING_ALGORITHMS", ())
        if blocking:
            names = ", ".join(f"`{a}`" for a in blocking)
            intro += f" For {names}, `syncer.quorum` defaults to `learners.count` (K = M) unless set."
        lines += _overrides("Algorithm defaults", intro, algo)
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(render())
    print(OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
