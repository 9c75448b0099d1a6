"""Run accounting from events (ALGORITHM.md §8): uptime, tokens merged, and the end-of-run table.

Pure functions over the event dicts a run writes to ``metrics.jsonl``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any


def uptime(commit_times: Mapping[int, Sequence[float]], start: float, end: float, stall_threshold: float) -> float:
    """Share of [start, end] in which no fragment waited longer than `stall_threshold` for a commit.

    Fragment p stalls during ``[t_prev + threshold, t_next]`` for every gap between consecutive
    commits (the run's start counts as a commit, the run's end closes the last gap). Uptime is
    1 − |union of stalled intervals| / (end − start).
    """
    if end <= start:
        return 1.0
    stalled: list[tuple[float, float]] = []
    for times in commit_times.values():
        prev = start
        for t in [*sorted(times), end]:
            if t - prev > stall_threshold:
                stalled.append((prev + stall_threshold, t))
            prev = max(prev, t)
    total, cur_lo, cur_hi = 0.0, None, None
    for lo, hi in sorted(stalled):
        if cur_hi is None or lo > cur_hi:
            if cur_hi is not None:
                total += cur_hi - cur_lo
            cur_lo, cur_hi = lo, hi
        else:
            cur_hi = max(cur_hi, hi)
    if cur_hi is not None:
        total += cur_hi - cur_lo
    return max(0.0, 1.0 - total / (end - start))


def tokens_merged(ledger: Mapping[Any, Sequence[int]]) -> float:
    """Tokens whose progress reached the global model: Σ_m mean_p tokens merged into fragment p."""
    return float(sum(sum(v) / len(v) for v in ledger.values() if len(v)))


def commit_times(events: Iterable[Mapping[str, Any]]) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for e in events:
        if e.get("event") == "merge":
            out.setdefault(int(e["fragment"]), []).append(float(e["time"]))
    return out


def table(summary: Mapping[str, Any]) -> str:
    """The short end-of-run table printed by ``dloco train``."""
    s = summary
    rows = [
        ("eval loss", f"{s['eval_loss_start']:.3f} -> {s['eval_loss_end']:.3f}"),
        ("tokens", f"{s['tokens_trained']:,} trained, {s['tokens_merged']:,.0f} merged"),
        ("merges", f"{s['merges']} (rejected contributions: {s['rejected']})"),
        ("learners", f"{s['learners']} (restarts: {s['restarts']})"),
        ("goodput / uptime", f"{s['goodput']:.3f} / {s['uptime']:.3f}"),
        ("bytes on the wire", f"{s['bytes_up']:,} up, {s['bytes_down']:,} down"),
        ("wall time", f"{s['wall_time_s']:.1f} s"),
        ("run dir", str(s["run_dir"])),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
