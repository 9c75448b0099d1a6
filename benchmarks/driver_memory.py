"""Driver memory and per-evaluation cost over a long run: every event kept vs the running tally.

Feeds N synthetic events shaped as a decoupled run writes them (M learners, P fragments, one
merge per push at K = 1, an evaluation and a goodput record every 100 merges, a restart now and
then) through two recorders side by side in one process:

- ``all events`` (the driver before): every event dict appended to a list; `status()` scans the
  list for merges, rejections and the newest evaluation; goodput/uptime are `dloco.metrics` over
  the whole list (what the supervisor did every `metrics.eval_every_s`).
- ``tally`` (the driver now): `dloco.tally.Tally` (counters, per-learner and per-fragment
  accounts, a 1,000-event ring).

Memory is what `tracemalloc` sees allocated by each recorder (the events themselves are built
once and shared, as the driver receives them). Prints a table and writes JSON:

    python benchmarks/driver_memory.py [--events 200000] [--out benchmarks/results/driver_memory.json]
"""

from __future__ import annotations

import argparse
import json
import time
import tracemalloc
from pathlib import Path

from dloco import metrics
from dloco.tally import Tally


def synthetic_events(n: int, learners: int = 8, fragments: int = 4, seed_time: float = 1_800_000_000.0):
    """n events of a decoupled run: merges at K = 1 (one per push), evals, goodput, restarts."""
    t, step = seed_time, [0] * learners
    out = [
        {"event": "learner_start", "time": t, "learner": m, "incarnation": 1, "cursor": None, "step": 0}
        for m in range(learners)
    ]
    version = [0] * fragments
    i = 0
    while len(out) < n:
        i += 1
        t += 0.05
        m, p = i % learners, (i // learners) % fragments
        step[m] += 6
        version[p] += 1
        out.append(
            {
                "event": "merge",
                "time": t,
                "fragment": p,
                "version": version[p],
                "contributors": [m],
                "incarnations": [1],
                "steps": [step[m]],
                "tokens": [6 * 512],
                "inner_steps": [24],
                "weights": [1.0],
                "share": 0.25,
                "staleness": [3],
                "cycle_s": [0.21],
                "grace_s": 0.0,
                "grace_window_s": 0.0,
                "slack_s": 0.0,
                "bytes_in": 57_344,
                "bytes_out": 229_376,
                "rejected": 0,
                "sync_s": 0.011,
                "push_age_s": [0.02],
                "t": t - seed_time,
            }
        )
        if i % 100 == 0:
            out.append({"event": "eval", "time": t, "loss": 3.0, "tokens": i * 3072, "t": t - seed_time})
            out.append({"event": "goodput", "time": t, "goodput": 0.9, "uptime": 1.0, "t": t - seed_time})
        if i % 5000 == 0:
            out.append(
                {
                    "event": "rejection",
                    "time": t,
                    "fragment": p,
                    "learner": m,
                    "incarnation": 1,
                    "step": step[m],
                    "base_version": 0,
                    "reason": "stale",
                    "t": t - seed_time,
                }
            )
    return out[:n]


class AllEvents:
    """The driver before: every event in a list, status and goodput computed over all of it."""

    def __init__(self, fragments: int, threshold: float, start: float) -> None:
        self.events: list[dict] = []
        self.fragments, self.threshold, self.start = fragments, threshold, start

    def add(self, e: dict) -> None:
        self.events.append(dict(e))

    def status(self) -> dict:
        merges = sum(e["event"] == "merge" for e in self.events)
        rejected = sum(e["event"] == "rejection" for e in self.events)
        evals = [e for e in self.events if e["event"] == "eval"]
        return {"merges": merges, "rejected": rejected, "eval_loss": evals[-1]["loss"] if evals else None}

    def goodput(self, now: float) -> tuple[float, float]:
        commits = metrics.commit_times(self.events)
        since = min((t for ts in commits.values() for t in ts), default=self.start)
        g = metrics.goodput(self.events, now, self.fragments)
        return g, metrics.uptime(commits, since, now, self.threshold, self.fragments)


class Tallied:
    def __init__(self, fragments: int, threshold: float, start: float) -> None:
        self.tally = Tally(fragments, threshold, start)

    def add(self, e: dict) -> None:
        self.tally.add(e)

    def status(self) -> dict:
        last = self.tally.last.get("eval")
        c = self.tally.counts
        return {"merges": c["merge"], "rejected": c["rejection"], "eval_loss": last["loss"] if last else None}

    def goodput(self, now: float) -> tuple[float, float]:
        return self.tally.goodput(now), self.tally.uptime(now)


def measure(cls, events, fragments: int) -> dict:
    start, end = events[0]["time"], events[-1]["time"] + 1.0
    tracemalloc.start()  # memory in one pass, time in another (tracing slows every allocation)
    base = tracemalloc.get_traced_memory()[0]
    rec = cls(fragments, 10.0, start)
    for e in events:
        rec.add(e)
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    del rec
    t0 = time.perf_counter()
    rec = cls(fragments, 10.0, start)
    for e in events:
        rec.add(e)
    feed = time.perf_counter() - t0
    t0 = time.perf_counter()
    status = rec.status()
    t_status = time.perf_counter() - t0
    t0 = time.perf_counter()
    goodput, uptime = rec.goodput(end)
    t_goodput = time.perf_counter() - t0
    return {
        "memory_mib": held / 2**20,
        "feed_s": feed,
        "status_s": t_status,
        "goodput_s": t_goodput,
        "merges": status["merges"],
        "goodput": goodput,
        "uptime": uptime,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--out", default="benchmarks/results/driver_memory.json")
    args = ap.parse_args()
    fragments = 4
    events = synthetic_events(args.events, fragments=fragments)
    size = len(json.dumps(events[len(events) // 2]))
    rows = {"all events": measure(AllEvents, events, fragments), "tally": measure(Tallied, events, fragments)}
    a, b = rows["all events"], rows["tally"]
    assert (
        a["merges"] == b["merges"] and abs(a["goodput"] - b["goodput"]) < 1e-9 and abs(a["uptime"] - b["uptime"]) < 1e-9
    )
    print(f"{args.events:,} events (a merge event is {size} bytes as JSON); both recorders agree on every number")
    print(f"{'recorder':<12} {'memory MiB':>11} {'feed s':>8} {'status() s':>11} {'goodput+uptime s':>17}")
    for name, r in rows.items():
        print(f"{name:<12} {r['memory_mib']:>11.1f} {r['feed_s']:>8.2f} {r['status_s']:>11.4f} {r['goodput_s']:>17.4f}")
    ratio = {k: a[k] / b[k] if b[k] else None for k in ("memory_mib", "status_s", "goodput_s")}
    print("all events / tally: " + ", ".join(f"{k} {v:.0f}x" for k, v in ratio.items() if v))
    out = {"events": args.events, "merge_event_json_bytes": size, "rows": rows, "ratio_all_over_tally": ratio}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
