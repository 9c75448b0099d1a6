"""Chaos carried out on a Ray run (ALGORITHM.md §10): the seeded schedule, and faults by hand.

`FaultInjector` runs `dloco.chaos.schedule` on the run's wall clock in a thread — real kills of
learner, syncer and store processes (Ray restarts them; the downtime is what a restart really
costs) and freezes — and hands every fault to `record` as a ``fault`` event with its time and
whether it was carried out or skipped and why. Manual faults are logged the same way with
``source: manual``. It knows the run's actors only through the `actors` callable, so the driver
stays the one owner of them.

The schedule's clock starts when every learner of the run has registered once (its process up,
the corpus mapped, the step compiled): a fault at ``at`` is carried out ``at`` seconds after that,
however long the start took on this machine, so a seeded kill never lands on a learner still
compiling and one schedule meets every algorithm in the same state. `up` is that moment.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

import ray

from dloco import chaos, events
from dloco.config import RunConfig


class FaultInjector:
    def __init__(self, cfg: RunConfig, started: float, actors: Callable[[], dict[str, Any]], record) -> None:
        self.schedule = chaos.schedule(cfg.chaos, cfg.learners.count)
        self.started, self.actors, self.record = started, actors, record
        self.down: dict[int, float] = {}  # learner → time of the kill it has not yet come back from
        self.up: float | None = None  # when every learner had registered once: the schedule's time 0
        self._waiting = set(range(cfg.learners.count))  # learners not registered yet
        self._up = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dloco-chaos", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def observe(self, e: dict[str, Any]) -> None:
        """A learner registered: it is back from its kill."""
        # killed before its first registration: learner_start; a registration from before the kill
        # that arrives after it (store events are drained later) is not the learner coming back
        if e["event"] in ("learner_start", "learner_restart") and e["time"] >= self.down.get(e["learner"], math.inf):
            self.down.pop(e["learner"], None)
        if e["event"] in ("learner_start", "learner_restart") and self._waiting:
            self._waiting.discard(e["learner"])
            if not self._waiting:
                self.up = float(e["time"])
                self._up.set()

    def _run(self) -> None:
        while not self._up.wait(0.2):
            if self._stop.is_set():
                return
        assert self.up is not None
        for f in self.schedule:
            if self._stop.wait(max(0.0, self.up + f.at - time.time())):
                return
            self.fault(f.target, f.kind, f.duration, source="schedule", at=f.at)

    def fault(self, target: str, kind: str, duration: float = 0.0, source: str = "manual", at=None) -> dict:
        now, skipped = time.time(), None
        actors = self.actors()
        if target.startswith("learner-"):
            m = int(target.split("-")[1])
            actor = actors["learners"].get(m)
            if actor is None:
                skipped = "learner not running"
            elif m in self.down:
                skipped = "learner still down from an earlier kill"
            elif kind == "kill":
                self.down[m] = now
                ray.kill(actor, no_restart=False)
            else:
                actor.freeze.remote(duration)
        else:
            ray.kill(actors[target], no_restart=False)
        e = events.Fault(
            time=now,
            target=target,
            kind=kind,
            source=source,
            at=at,
            duration=duration if kind == "freeze" else None,
            skipped=skipped,
        ).to_dict()
        self.record(e)
        return e
