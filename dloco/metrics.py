"""Run accounting from events (ALGORITHM.md §8): goodput, uptime, downtime, and the end-of-run table.

Pure functions over the event dicts a run writes to ``metrics.jsonl``, so every number in a
summary can be recomputed from the file.

Goodput = learner-time whose progress was merged ÷ learner-time provisioned:

    provisioned_m = end − (time learner m first registered)         (dead, restarting, compiling,
                                                                      frozen and discarded time included)
    merged_m      = Σ_{merges of any fragment} new_steps_m · cycle_m / P
    goodput       = Σ_m merged_m / Σ_m provisioned_m

`new_steps_m` counts the steps of m's merged push (its c_steps up to its step t) that were not
merged into that fragment before (`learner_time`), and `cycle_m` is the learner's typical seconds
per step at that push (`typical_cycle`: its mean work per step plus its typical wait for merges,
stalled waits left out); a
step's progress reaches the model fragment by fragment, hence the mean over the P fragments.

Decision: the typical cycle, not each step's own duration, values a merged step, so the normal
wait of a synchronous step (its all-reduce) counts as productive while a wait stretched by a stall
(a lock-step peer dead or frozen) counts only its normal length; steps never merged (lost with a
killed learner, overwritten after an install, trained after the run's last merge) count nothing.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from dloco.tally import Tally, push_progress, union_length


def uptime(
    commit_times: Mapping[int, Sequence[float]],
    start: float,
    end: float,
    stall_threshold: float,
    fragments: int | None = None,
) -> float:
    """Share of [start, end] in which no fragment waited longer than `stall_threshold` for a commit.

    `fragments` (P) makes a fragment that never committed count as waiting since `start`.

    Fragment p stalls during ``[t_prev + threshold, t_next]`` for every gap between consecutive
    commits (the run's start counts as a commit, the run's end closes the last gap). Uptime is
    1 − |union of stalled intervals| / (end − start).
    """
    if end <= start:
        return 1.0
    stalled: list[tuple[float, float]] = []
    every = {p: () for p in range(fragments or 0)} | dict(commit_times)
    for times in every.values():
        prev = start
        for t in [*sorted(times), end]:
            if t - prev > stall_threshold:
                stalled.append((prev + stall_threshold, t))
            prev = max(prev, t)
    return max(0.0, 1.0 - union_length(stalled) / (end - start))


def typical_cycle(busy: Sequence[float], waits: Sequence[float] = (), outlier: float = 3.0) -> float:
    """Typical seconds per step: mean work per step plus the typical wait for merges.

    `busy` holds each recent step's working time (the step, polls, installs, pushes), `waits` its
    time blocked waiting for a merge (blocking algorithms only). Waits longer than `outlier` × their
    median are stalls (a lock-step peer dead or frozen) and left out; work is averaged as it is,
    slow steps included, since that time was spent on progress.
    """
    if not busy:
        return 0.0
    work = sum(busy) / len(busy)
    if not waits:
        return work
    med = statistics.median(waits)
    kept = [w for w in waits if w <= outlier * med]
    return work + (sum(kept) / len(kept) if kept else 0.0)


def merged_progress(events: Iterable[Mapping[str, Any]], fragments: int) -> list[dict[str, float]]:
    """What each merged push added to the global model, in time order: one record per contributor
    of each merge with its ``time``, ``learner``, ``seconds`` (new steps × typical step time / P)
    and ``tokens`` (new steps × tokens per step / P).

    A merged push of learner m at local step s with c_steps = n covers its steps (s − n, s] of that
    fragment; only steps beyond the highest one already merged into the fragment are new, so
    progress that reached the model twice (a push sent before the previous one's merge was
    installed) or was retrained after a restart counts once (`dloco.tally.push_progress`).
    """
    out: list[dict[str, float]] = []
    merged_to: dict[tuple[int, int], int] = {}  # (learner, fragment) → highest step merged
    for e in _in_time_order(events):
        if e.get("event") == "merge":
            out += push_progress(e, merged_to, fragments)
    return out


def _in_time_order(events: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return sorted(events, key=lambda e: float(e.get("time", 0.0)))


def _tally(events: Iterable[Mapping[str, Any]], fragments: int) -> Tally:
    t = Tally(fragments, math.inf, 0.0, ring=1)
    for e in _in_time_order(events):
        t.add(e)
    return t


def learner_time(events: Iterable[Mapping[str, Any]], end: float, fragments: int) -> dict[int, dict[str, float]]:
    """Per learner: ``provisioned`` and ``merged`` seconds and ``merged_tokens`` (module docstring).

    Provisioning starts at the learner's ``learner_start`` event (or its first merge) and ends at
    `end` or at its ``learner_stop`` (it left the run for good); merged time and tokens are
    `merged_progress`'s. The events are folded in time order into a `dloco.tally.Tally`, the
    running form the driver keeps.
    """
    return _tally(events, fragments).learner_time(end)


def goodput(events: Iterable[Mapping[str, Any]], end: float, fragments: int) -> float:
    """Σ merged learner-time ÷ Σ provisioned learner-time (module docstring); 0 if nothing was provisioned."""
    return _tally(events, fragments).goodput(end)


def downtimes(events: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each carried-out learner kill with what it cost (ALGORITHM.md §10: restart + rejoin, measured).

    A kill is a ``fault`` event of kind ``kill`` on ``learner-<m>`` that was not skipped. Its
    restart ends at the next registration of m (``learner_restart``, or ``learner_start`` if it was
    killed before it first registered): ``back``, ``downtime_s`` = back − killed. Its rejoin ends at
    the first merge holding a push of that new incarnation: ``merged_again``, ``rejoin_s`` =
    merged_again − killed. Either is None if the run ended first.
    """
    return _tally(events, 1).downtimes()


def longest_commit_gaps(events: Iterable[Mapping[str, Any]], start: float, end: float, n: int = 3) -> list[float]:
    """The `n` longest waits, in seconds, between consecutive commits of the whole model (any fragment)."""
    times = sorted(t for ts in commit_times(events).values() for t in ts)
    gaps = [b - a for a, b in zip([start, *times], [*times, end], strict=True)]
    return sorted(gaps, reverse=True)[:n]


def commit_times(events: Iterable[Mapping[str, Any]]) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for e in events:
        if e.get("event") == "merge":
            out.setdefault(int(e["fragment"]), []).append(float(e["time"]))
    return out


def table(summary: Mapping[str, Any]) -> str:
    """The short end-of-run table printed by ``dloco train``."""
    s = summary
    down = s.get("downtime_s") or []

    def loss(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.3f}"

    def secs(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.1f} s"

    errors = s.get("errors") or {}
    rows = [
        ("algorithm", s.get("algorithm", "decoupled")),
        ("eval loss", f"{loss(s['eval_loss_start'])} -> {loss(s['eval_loss_end'])}"),
        ("tokens", f"{s['tokens_trained']:,} trained, {s['tokens_merged']:,.0f} merged"),
        ("merges", f"{s['merges']} (rejected contributions: {s['rejected']})"),
        ("learners", f"{s['learners']} (restarts: {s['restarts']})"),
        ("goodput / uptime", f"{s['goodput']:.3f} / {s['uptime']:.3f}"),
        (
            "faults",
            f"{s.get('faults', 0)} carried out, {s.get('faults_skipped', 0)} skipped"
            + (f"; learner downtime median {sorted(down)[len(down) // 2]:.1f} s" if down else ""),
        ),
        ("bytes on the wire", f"{s['bytes_up']:,} up, {s['bytes_down']:,} down"),
        ("wall time", f"{s['wall_time_s']:.1f} s"),
        ("start-up", f"first step after {secs(s.get('startup_s'))}, first merge after {secs(s.get('first_merge_s'))}"),
        ("run dir", str(s["run_dir"])),
    ]
    if errors:
        counts = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in errors.items())
        rows.insert(-2, ("errors", f"{counts}; last: {s.get('last_error')}"))
    if s.get("error"):
        rows.insert(0, ("RUN FAILED", str(s["error"])))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
