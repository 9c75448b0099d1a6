"""Running accounts of a run, fed one event at a time: what the driver keeps instead of every event.

`Tally.add` folds each event into counters and per-learner, per-fragment accumulators and keeps a
bounded ring of recent events; memory stays flat however long the run, and each query is O(learners
+ fragments + stalls), not O(events). `dloco.metrics`' functions over a whole event list
(`learner_time`, `goodput`, `downtimes`) fold the events through a Tally too, and merged progress
has one definition, `push_progress`; the test of the tally checks it against `metrics.uptime` and
`metrics.longest_commit_gaps` and the hand-computed traces.

Events from different actors reach the driver slightly out of time order; the accounts need only
the orders that causality fixes (a learner's registration before its merges, a kill before the
restart, the one syncer's merges in commit order).
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from typing import Any


def push_progress(
    e: Mapping[str, Any], merged_to: dict[tuple[int, int], int], fragments: int
) -> list[dict[str, float]]:
    """What one merge event added, per contributor: ``time``, ``learner``, ``seconds`` (new steps ×
    typical step time / P) and ``tokens`` (new steps × tokens per step / P). A push at step s with
    c_steps = n covers (s − n, s]; only steps above the highest one already merged into the fragment
    (`merged_to`, updated here) are new. The one definition of merged progress and tokens merged."""
    p, out = int(e["fragment"]), []
    cycles = e.get("cycle_s") or [0.0] * len(e["contributors"])
    for m, step, n, tok, cycle in zip(
        e["contributors"], e["steps"], e["inner_steps"], e["tokens"], cycles, strict=True
    ):
        hi = merged_to.get((int(m), p), -1)
        new = max(0, step - max(hi, step - n))
        merged_to[(int(m), p)] = max(hi, step)
        per_step = tok / n if n else 0.0
        out.append(
            {
                "time": float(e["time"]),
                "learner": int(m),
                "seconds": new * cycle / fragments,
                "tokens": new * per_step / fragments,
            }
        )
    return out


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length of the union of closed intervals (lo, hi)."""
    total, cur_lo, cur_hi = 0.0, 0.0, None
    for lo, hi in sorted(intervals):
        if cur_hi is None or lo > cur_hi:
            if cur_hi is not None:
                total += cur_hi - cur_lo
            cur_lo, cur_hi = lo, hi
        else:
            cur_hi = max(cur_hi, hi)
    if cur_hi is not None:
        total += cur_hi - cur_lo
    return total


class Tally:
    """Accounts of one run over `fragments` fragments (module docstring)."""

    def __init__(self, fragments: int, stall_threshold: float, start: float, ring: int = 1000) -> None:
        self.fragments, self.stall_threshold, self.start = fragments, stall_threshold, start
        self.counts: Counter[str] = Counter()
        self.recent: deque[dict[str, Any]] = deque(maxlen=ring)
        self.last: dict[str, dict[str, Any]] = {}  # event kind → its newest event
        self.first_commit: float | None = None
        self.first_start: float | None = None  # the first learner's first registration: training begins
        self.payloads_lost = 0
        self._learners: dict[int, dict[str, float | None]] = {}  # m → start, stop, merged, merged_tokens
        self._merged_to: dict[tuple[int, int], int] = {}  # (learner, fragment) → highest step merged
        self._last_commit: dict[int, float] = {}  # fragment → time of its last commit
        self._stalls: list[tuple[float, float]] = []  # closed stalled intervals (gaps > threshold)
        self._prev_any: float = start  # last commit of any fragment
        self._gaps: list[float] = []  # min-heap of the longest gaps between commits of any fragment
        self._kills: list[dict[str, Any]] = []
        self._restarting: dict[int, dict[str, Any]] = {}
        self._rejoining: dict[tuple[int, int], dict[str, Any]] = {}
        self._spares: dict[int, list[float | None]] = {}  # spare → [started, took over (None: idle)]
        self.last_error: dict[str, Any] | None = None  # the newest error event (ERRORS)
        self.failing_since: float | None = None  # first syncer or store error since the last merge

    ERRORS = ("syncer_error", "store_error", "actor_error")

    def error_counts(self) -> dict[str, int]:
        """Errors seen so far, by kind (only kinds that occurred)."""
        return {k: self.counts[k] for k in self.ERRORS if self.counts[k]}

    def failing_for(self, now: float) -> float:
        """Seconds the run has been failing: since the first ``syncer_error`` or ``store_error``
        after the newest merge (0 while merges succeed: a failed snapshot alone, with commits
        still succeeding, never adds up). The driver ends a run when this exceeds
        `store.fail_after_s`."""
        return 0.0 if self.failing_since is None else max(0.0, now - self.failing_since)

    def add(self, e: Mapping[str, Any]) -> None:
        kind = str(e.get("event"))
        e = dict(e)
        self.counts[kind] += 1
        if kind == "fault" and e.get("skipped"):
            self.counts["fault_skipped"] += 1
        self.recent.append(e)
        self.last[kind] = e
        t = float(e.get("time", 0.0))
        if kind == "learner_start":
            # events of the store and the syncer are drained separately: a merge of the learner's
            # push may be tallied before its registration, and provisioning starts at the earlier
            acc = self._learner(int(e["learner"]), t)
            acc["start"] = min(float(acc["start"] or t), t)
            self.first_start = t if self.first_start is None else min(self.first_start, t)
        elif kind == "spare_start":
            self._spares[int(e["spare"])] = [t, None]
        elif kind == "spare_takeover" and int(e["spare"]) in self._spares:
            self._spares[int(e["spare"])][1] = t
        if kind in ("learner_start", "learner_restart") and int(e["learner"]) in self._learners:
            self._learners[int(e["learner"])]["stop"] = None  # back after it left (a drain): provisioned again
        elif kind == "learner_stop" and int(e["learner"]) in self._learners:
            self._learners[int(e["learner"])]["stop"] = t
        elif kind == "payload_lost":
            self.payloads_lost += 1
        elif (
            kind == "fault"
            and e.get("kind") == "kill"
            and str(e.get("target", "")).startswith("learner-")
            and not e.get("skipped")
        ):
            m = int(e["target"].split("-")[1])
            d: dict[str, Any] = {"learner": m, "killed": t, "back": None, "downtime_s": None, "merged_again": None}
            d["rejoin_s"] = None
            self._restarting[m] = d
            self._kills.append(d)
        # a registration from before the kill, arriving after it (the driver records its own faults
        # at once and drains the store's events later), is not the learner coming back
        back = self._restarting.get(int(e["learner"])) if kind in ("learner_start", "learner_restart") else None
        if back is not None and t >= back["killed"]:
            d = self._restarting.pop(int(e["learner"]))
            if kind == "learner_start":  # killed before it first registered: its restart is a first start
                self.counts["restart_from_startup"] += 1
            d["back"], d["downtime_s"] = t, t - d["killed"]
            self._rejoining[(int(e["learner"]), int(e.get("incarnation", 1)))] = d
        if kind in self.ERRORS:
            self.last_error = e
            if kind != "actor_error" and self.failing_since is None:
                self.failing_since = t
        if kind == "merge":
            self.failing_since = None
            self._merge(e, t)

    def _learner(self, m: int, t: float) -> dict[str, float | None]:
        if m not in self._learners:
            self._learners[m] = {"start": t, "stop": None, "merged": 0.0, "merged_tokens": 0.0}
        return self._learners[m]

    def _merge(self, e: dict[str, Any], t: float) -> None:
        p = int(e["fragment"])
        for r in push_progress(e, self._merged_to, self.fragments):
            acc = self._learner(int(r["learner"]), t)
            acc["merged"] = float(acc["merged"] or 0.0) + r["seconds"]
            acc["merged_tokens"] = float(acc["merged_tokens"] or 0.0) + r["tokens"]
        for m, inc in zip(e["contributors"], e.get("incarnations", ()), strict=False):
            d = self._rejoining.pop((int(m), int(inc)), None)
            if d is not None:
                d["merged_again"], d["rejoin_s"] = t, t - d["killed"]
        if self.first_commit is None:
            self.first_commit = t
        prev = self._last_commit.get(p, self.first_commit)
        if t - prev > self.stall_threshold:
            self._stalls.append((prev + self.stall_threshold, t))
        self._last_commit[p] = max(prev, t)
        gap, self._prev_any = t - self._prev_any, max(self._prev_any, t)
        heapq.heappush(self._gaps, gap)
        if len(self._gaps) > 16:
            heapq.heappop(self._gaps)

    # ---- queries -----------------------------------------------------------------------------
    def learner_time(self, end: float) -> dict[int, dict[str, float]]:
        """Per learner: provisioned and merged seconds and merged tokens (`metrics.learner_time`)."""
        return {
            m: {
                "provisioned": max(0.0, (end if v["stop"] is None else float(v["stop"])) - float(v["start"] or 0.0)),
                "merged": float(v["merged"] or 0.0),
                "merged_tokens": float(v["merged_tokens"] or 0.0),
            }
            for m, v in self._learners.items()
        }

    def merged_tokens(self) -> float:
        """Tokens merged so far: Σ over merged pushes of their new steps × tokens per step / P."""
        return sum(float(v["merged_tokens"] or 0.0) for v in self._learners.values())

    def spare_time(self, end: float) -> float:
        """Seconds spare learners were provisioned while idle: from their start to their takeover
        (or `end`). An idle spare is a provisioned host, so goodput counts it."""
        return sum(
            max(0.0, min(end, end if stop is None else stop) - float(start or 0.0))
            for start, stop in self._spares.values()
        )

    def goodput(self, end: float) -> float:
        per = self.learner_time(end).values()
        provisioned = sum(v["provisioned"] for v in per) + self.spare_time(end)
        return sum(v["merged"] for v in per) / provisioned if provisioned > 0 else 0.0

    def uptime(self, end: float) -> float:
        """`metrics.uptime` from the first commit (the run's start while there is none) to `end`:
        the model starts advancing at its first commit, so start-up is no stall (ALGORITHM.md §8)."""
        since = self.start if self.first_commit is None else self.first_commit
        if end <= since:
            return 1.0
        open_ = [
            (self._last_commit.get(p, since) + self.stall_threshold, end)
            for p in range(self.fragments)
            if end - self._last_commit.get(p, since) > self.stall_threshold
        ]
        return max(0.0, 1.0 - union_length([*self._stalls, *open_]) / (end - since))

    def downtimes(self) -> list[dict[str, Any]]:
        return [dict(d) for d in self._kills]

    def longest_commit_gaps(self, end: float, n: int = 3) -> list[float]:
        return sorted([*self._gaps, end - self._prev_any], reverse=True)[:n]


def summarize(
    tally: Tally,
    *,
    config: Mapping[str, Any],
    stop_at: float,
    end: float,
    eval_loss_start: float,
    eval_loss_end: float | None,
    tokens_trained: int,
    statuses: Mapping[int, Mapping[str, Any]],
    store: Mapping[str, Any],
    learners: int,
    run_dir: str,
    error: str | None = None,
    auth_mode: str | None = None,
    launched: float | None = None,
) -> dict[str, Any]:
    """``summary.json`` of a run: the tally's accounts up to `stop_at` (when the run was told to
    stop) and what the driver measured at the end (`end`: after the final evaluation).

    Start-up, from `launched` (when `actors.launch.start` was called; the tally's start if None):
    ``startup_s`` to the first learner's registration (its train step is compiled by then:
    `actors.learner`), ``first_merge_s`` to the first commit; None if it never came."""
    launched = tally.start if launched is None else launched
    per_learner = tally.learner_time(stop_at)
    merged = sum(v["merged_tokens"] for v in per_learner.values())
    faults = tally.counts["fault"]
    kills = tally.downtimes()
    return {
        "algorithm": config.get("algorithm"),
        "eval_loss_start": eval_loss_start,
        "eval_loss_end": eval_loss_end,
        "tokens_trained": tokens_trained,
        "tokens_merged": merged,
        "tokens_merged_ratio": merged / tokens_trained if tokens_trained else 0.0,
        "goodput": tally.goodput(stop_at),
        "learner_time": per_learner,
        "spare_s": tally.spare_time(stop_at),  # idle spares' provisioned seconds (in goodput's denominator)
        "faults": faults - tally.counts["fault_skipped"],
        "faults_skipped": tally.counts["fault_skipped"],
        "downtime_s": sorted(d["downtime_s"] for d in kills if d["downtime_s"] is not None),  # kill → registered
        "rejoin_s": sorted(d["rejoin_s"] for d in kills if d["rejoin_s"] is not None),  # kill → merged again
        "longest_commit_gaps_s": tally.longest_commit_gaps(stop_at),
        "payloads_lost": tally.payloads_lost,
        "uptime": tally.uptime(stop_at),
        "merges": tally.counts["merge"],
        "rejected": tally.counts["rejection"],
        "learners": learners,
        # a learner killed during start-up comes back as a first start: still a restart
        "restarts": tally.counts["learner_restart"] + tally.counts["restart_from_startup"],
        "errors": tally.error_counts(),
        "last_error": None if tally.last_error is None else tally.last_error.get("error"),
        "error": error,  # why the run ended early (None: it reached its budget or was stopped)
        "auth_mode": auth_mode,
        "bytes_up": sum(s["bytes_out"] for s in statuses.values()),
        "bytes_down": sum(s["bytes_in"] for s in statuses.values()),
        "versions": store["versions"],
        "copies": store.get("copies"),  # the store's per-learner copies: bytes held, peak, limit, dropped
        "store_shards": store.get("shards"),  # with syncer.shards > 1: each shard's summary
        "placement": {m: s.get("node") for m, s in sorted(statuses.items())},
        "wall_time_s": end - tally.start,
        "startup_s": None if tally.first_start is None else tally.first_start - launched,
        "first_merge_s": None if tally.first_commit is None else tally.first_commit - launched,
        "run_dir": run_dir,
        "config": dict(config),
    }
