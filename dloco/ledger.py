"""The token ledger of a fragment (ALGORITHM.md §4, §8): per learner, what of its training the
fragment holds.

An entry is ``{tokens, cursor, step, incarnation, high}``: tokens merged in all, and of the last
merged push its data cursor, step and incarnation; ``high`` is the highest step of the learner any
incarnation had merged into the fragment. A restarted learner resumes at its oldest merged
cursor over all fragments (`merged_cursor`) and retrains the steps between that and ``high`` for
the other fragments: those steps count once (`fresh_tokens`), as the run summary counts them.
Entries written before ``high`` existed read their ``step`` as ``high``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class MergedPush:
    """One learner's push included in a commit (what the ledger records)."""

    learner_id: int
    incarnation: int
    step: int
    tokens: int
    steps: int
    cursor: dict | None


def fresh_tokens(mp: MergedPush, high: int) -> int:
    """The tokens of `mp`'s steps above `high` (its push spans steps step − steps + 1 .. step)."""
    fresh = mp.step - max(high, mp.step - mp.steps)
    if mp.steps <= 0 or fresh <= 0:
        return 0
    return mp.tokens * fresh // mp.steps


def record(ledger: Mapping[int, dict], merged: Iterable[MergedPush]) -> dict[int, dict]:
    """The ledger after a commit that merged `merged` (a new dict; `ledger` is left as it is)."""
    out = {m: dict(e) for m, e in ledger.items()}
    for mp in merged:
        e: dict = out.get(mp.learner_id, {"tokens": 0, "step": 0})
        high = int(e.get("high", e["step"]))
        out[mp.learner_id] = {
            "tokens": int(e["tokens"]) + fresh_tokens(mp, high),
            "cursor": mp.cursor,
            "step": mp.step,
            "incarnation": mp.incarnation,
            "high": max(high, mp.step),
        }
    return out


def cursor_key(c: object) -> tuple[int, int] | None:
    """(epoch, index) of a stored cursor; None if it is not one (e.g. written by an older version
    that did not validate pushes' cursors): such an entry cannot say where to resume."""
    if c is None:
        return (-1, -1)
    try:
        key = (int(c["epoch"]), int(c["index"]))  # type: ignore[index]
    except (TypeError, KeyError, ValueError, OverflowError):
        return None
    return key if min(key) >= 0 else None


def merged_cursor(ledgers: Iterable[Mapping[int, dict]], learner_id: int) -> tuple[dict | None, int]:
    """The data position up to which the learner's progress reached every fragment, and that
    push's step: the oldest cursor of its last merged pushes; (None, 0), the start of its stream,
    if some fragment never merged a push of it or holds a cursor that is not one."""
    entries = [ledger.get(learner_id) for ledger in ledgers]
    if any(e is None or cursor_key(e.get("cursor")) is None for e in entries):
        return None, 0
    first = min(entries, key=lambda e: cursor_key(e["cursor"]))  # type: ignore[arg-type,index,return-value]
    return first["cursor"], int(first["step"])  # type: ignore[index]


def tokens_merged(ledgers: list[Mapping[int, dict]]) -> dict[int, list[int]]:
    """learner → tokens merged into each fragment."""
    out: dict[int, list[int]] = {}
    for p, ledger in enumerate(ledgers):
        for m, e in ledger.items():
            out.setdefault(m, [0] * len(ledgers))[p] = int(e["tokens"])
    return out
