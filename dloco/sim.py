"""The run in one process on a virtual clock: the in-process transport for `dloco.services`.

The store, syncer and learner services are the same classes the Ray actors wrap; here their
peers are the other service objects, payloads are Python objects (`SimTransport`: a payload
whose owner was killed can no longer be read), and time is virtual (`VirtualClock`). Learner m's
step takes ``step_times[m]`` virtual seconds (default: its group's slowdown × batch size /
`inner.batch_size`), times the `chaos` straggler factor and per-step jitter of the config (the same
seeded draws as a Ray run); a commit's round trip to the store and an update's way to a learner
each take ``sync_time`` virtual seconds.

With `syncer.shards` S > 1 there are S store and syncer services (`dloco.services.shards`), and the
learners reach them through `ShardedStore` and `ShardedSyncer`.

Faults are events on the same clock (`Sim.kill_learner`, `kill_syncer`, `kill_store`, `freeze`):
a killed learner's payloads and in-flight updates are lost and it registers again `restart_s`
later; a killed syncer forgets its pending rounds and is rebuilt from the store at once; a killed
store forgets its sessions and mail and restores from disk at once, and every learner opens its
session again (as its long poll would after the error). Lost payloads come from `chaos`.
Deterministic: the same config, times and faults give the same events, bit for bit.
"""

from __future__ import annotations

import heapq
import itertools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax

from dloco import build, chaos, events, inner
from dloco.config import RunConfig
from dloco.services import shards
from dloco.services.learner import LearnerService
from dloco.services.store import StoreService
from dloco.services.syncer import SyncerService
from dloco.services.wire import PayloadLostError, Update


class VirtualClock:
    def __init__(self) -> None:
        self.t = 0.0
        self.skew = 0.0  # time spent inside a call that takes time (a commit's round trip)

    def now(self) -> float:
        return self.t + self.skew

    def wall(self) -> float:
        return self.t + self.skew


@dataclass(frozen=True)
class _Ref:
    obj: Any
    owner: int


class SimTransport:
    """Payloads by reference; reading one whose owner was killed raises `PayloadLostError`.
    Each transport has its own serial number (`owner`), never reused: an `id()` would be, by the
    transport of a restarted learner allocated where the killed one's was, whose payloads would
    then all read as lost."""

    _serials = itertools.count()

    def __init__(self, dead: set[int]) -> None:
        self.dead = dead  # owners (serial numbers) of killed transports, shared by the run's transports
        self.owner = next(SimTransport._serials)

    def put(self, obj: Any) -> _Ref:
        return _Ref(obj, self.owner)

    def get(self, ref: _Ref) -> Any:
        if ref.owner in self.dead:
            raise PayloadLostError("its owner was killed")
        return ref.obj


def _owner(transport: Any) -> int:
    assert isinstance(transport, SimTransport), transport  # every service in a Sim has one
    return transport.owner


class _StoreFor:
    """A peer's handle on whichever store (of shard `s`) is current (a killed store is replaced at once)."""

    def __init__(self, sim: Sim, commit_time: float = 0.0, s: int = 0) -> None:
        self.sim, self.commit_time, self.s = sim, commit_time, s

    def __getattr__(self, name: str):
        return getattr(self.sim.stores[self.s], name)

    def commit(self, c):
        self.sim.clock.skew += self.commit_time  # the round trip takes this long
        return self.sim.stores[self.s].commit(c)


class _SyncerFor:
    def __init__(self, sim: Sim, s: int = 0) -> None:
        self.sim, self.s = sim, s

    def push(self, meta, ref):
        return self.sim.syncers[self.s].push(meta, ref)

    def holds(self, meta) -> bool:
        return self.sim.syncers[self.s].holds(meta)

    def decisions(self) -> list:
        return []  # in process each push's decision is its return value


@dataclass
class Sim:
    """A run in process (module docstring). Build with `Sim.start`, advance with `run`."""

    cfg: RunConfig
    blueprint: build.Blueprint
    run_dir: Path
    step_times: list[float]
    sync_time: float
    restart_s: float
    mesh: Any
    clock: VirtualClock = field(default_factory=VirtualClock)
    dead: set[int] = field(default_factory=set)
    events: list[dict[str, Any]] = field(default_factory=list)
    bytes_down: list[int] = field(default_factory=list)  # per learner id, every incarnation
    stores: list = field(default_factory=list)  # per shard (`syncer.shards`)
    syncers: list = field(default_factory=list)
    services: dict[int, LearnerService] = field(default_factory=dict)
    next_done: dict[int, float | None] = field(default_factory=dict)
    duration: dict[int, float] = field(default_factory=dict)
    frozen_until: dict[int, float] = field(default_factory=dict)
    restarts: list[tuple[float, int]] = field(default_factory=list)  # (when, learner) of pending restarts
    deliveries: list[tuple[float, int, int, int, Update]] = field(default_factory=list)  # (t, m, inc, seq, u)
    faults: list[tuple[float, int, str, Any]] = field(default_factory=list)  # (at, seq, kind, arg)
    _seq: int = 0

    @classmethod
    def start(
        cls,
        cfg: RunConfig,
        run_dir: str | os.PathLike,
        step_times: list[float] | None = None,
        sync_time: float = 0.0,
        devices: int | None = None,
        restart_s: float = 5.0,
    ) -> Sim:
        mesh = inner.make_mesh(jax.devices()[:devices] if devices else None)
        sim = cls(
            cfg, build.blueprint(cfg), Path(run_dir), step_times or default_step_times(cfg), sync_time, restart_s, mesh
        )
        n = cfg.syncer.shards
        sim.stores = [StoreService(cfg, sim.run_dir, SimTransport(sim.dead), sim.clock, shard=s) for s in range(n)]
        sim.bytes_down = [0] * cfg.learners.count
        for m in range(cfg.learners.count):
            sim._spawn(m)
        sim.syncers = [sim._syncer(s) for s in range(n)]
        sim._collect()
        return sim

    def _syncer(self, s: int) -> SyncerService:
        return SyncerService(self.cfg, _StoreFor(self, self.sync_time, s), SimTransport(self.dead), self.clock, s)

    # ---- what tests and benchmarks read --------------------------------------------------------
    @property
    def now(self) -> float:
        return self.clock.t

    @property
    def store_service(self) -> StoreService:
        return self.stores[0]

    @property
    def syncer_service(self) -> SyncerService:
        return self.syncers[0]

    @property
    def store(self):
        return self.stores[0].core

    @property
    def syncer(self):
        return self.syncers[0].core

    @property
    def learners(self) -> list:
        return [self.services[m].core for m in sorted(self.services)]

    def global_params(self) -> dict:
        n = len(self.stores)
        return self.blueprint.plan.join(
            [self.stores[shards.owner(p, n)].core.fragment(p)[1] for p in range(self.blueprint.plan.count)]
        )

    def evaluate(self) -> float:
        mesh = inner.make_mesh()
        ev = inner.make_eval_step(self.blueprint.model, mesh)
        params = inner.replicate(self.global_params(), mesh)
        return inner.evaluate(ev, params, build.eval_set(self.cfg, self.blueprint.corpus), mesh)

    # ---- faults -----------------------------------------------------------------------------
    def at(self, t: float, kind: str, arg: Any = None) -> None:
        """Schedules a fault: ("kill_learner", m), ("freeze", (m, seconds)), ("kill_syncer", shard),
        ("kill_store", shard) (shard None: 0)."""
        heapq.heappush(self.faults, (t, self._seq, kind, arg))
        self._seq += 1

    def _fault(self, kind: str, arg: Any) -> None:
        target, skipped, duration = {"kill_syncer": "syncer", "kill_store": "store"}.get(kind, ""), None, None
        s = (arg or 0) if kind in ("kill_syncer", "kill_store") else 0
        target = shards.names(target, len(self.stores))[s] if target else target
        if kind == "kill_learner":
            target = f"learner-{arg}"
            svc = self.services.pop(arg, None)
            if svc is None:
                skipped = "learner not running"
            else:
                self.dead.add(_owner(svc.transport))
                self.next_done.pop(arg, None)
                self.restarts.append((self.now + self.restart_s, arg))
        elif kind == "freeze":
            m, duration = arg
            target = f"learner-{m}"
            self.frozen_until[m] = max(self.frozen_until.get(m, 0.0), self.now + duration)
        elif kind == "kill_syncer":
            self.dead.add(_owner(self.syncers[s].transport))
            self.syncers[s] = self._syncer(s)
        elif kind == "kill_store":
            self.dead.add(_owner(self.stores[s].transport))
            self.stores[s].close()  # as its process's death would: the new store takes the lock
            self.stores[s] = StoreService(self.cfg, self.run_dir, SimTransport(self.dead), self.clock, shard=s)
            for m, svc in self.services.items():  # each learner's long poll fails and is sent again
                in_transit = [u for _, mm, _, _, u in self.deliveries if mm == m]
                self._mail(m, self.stores[s].updates(m, svc.incarnation, svc.known(in_transit)))
        else:
            raise ValueError(f"unknown fault {kind!r}")
        fault = events.Fault(
            time=self.now,
            target=target,
            kind="freeze" if kind == "freeze" else "kill",
            source="schedule",
            duration=duration,
            skipped=skipped,
        )
        self.events.append(fault.to_dict())

    # ---- the loop ---------------------------------------------------------------------------
    def _spawn(self, m: int) -> None:
        n = range(len(self.stores))
        store, syncer = shards.peers(self.cfg, [_StoreFor(self, 0.0, s) for s in n], [_SyncerFor(self, s) for s in n])
        svc = LearnerService(self.cfg, m, store, syncer, SimTransport(self.dead), self.clock, self.mesh)
        self.services[m] = svc
        self.duration[m] = self._step_time(m)
        self.next_done[m] = self.now + self.duration[m]

    def _step_time(self, m: int) -> float:
        svc = self.services[m]
        return self.step_times[m] * chaos.step_factor(self.cfg.chaos, m, svc.core.step_count + 1, svc.straggler)

    def _mail(self, m: int, updates: list[Update]) -> None:
        inc = self.services[m].incarnation
        for u in updates:
            heapq.heappush(self.deliveries, (self.now + self.sync_time, m, inc, self._seq, u))
            self._seq += 1

    def _collect(self) -> None:
        for svc in (*self.stores, *self.syncers, *self.services.values()):
            if svc is not None:
                # every event is checked against its schema (`dloco.events.parse`) as it arrives
                self.events.extend(events.parse({**e, "time": self.now}).to_dict() for e in svc.drain_events())

    def _close_due(self) -> float | None:
        waits = []
        for syncer in self.syncers:  # shards commit side by side: each one's round trips from now
            waits.append(syncer.run_due())
            self.clock.skew = 0.0
        for store in self.stores:
            for m in self.services:
                if store.has_mail(m):
                    self._mail(m, store.updates(m, self.services[m].incarnation, []))
        self._collect()
        return min((w for w in waits if w is not None), default=None)

    def _deliver(self) -> None:
        while self.deliveries and self.deliveries[0][0] <= self.now:
            _, m, inc, _, u = heapq.heappop(self.deliveries)
            svc = self.services.get(m)
            if svc is None or svc.incarnation != inc:
                continue  # sent to a learner that was killed since
            before = svc.bytes_in
            try:
                svc.receive([u])
            except PayloadLostError:
                continue
            self.bytes_down[m] += svc.bytes_in - before

    def run(self, steps: int, until: float | None = None) -> Sim:
        """Runs until every learner took `steps` inner steps (and what they sent is merged and
        delivered), or the virtual clock reaches `until`."""
        while True:
            active = {m for m, svc in self.services.items() if svc.core.step_count < steps}
            times = [t for m, t in self.next_done.items() if t is not None and m in active]
            if self.deliveries:
                times.append(self.deliveries[0][0])
            for syncer in self.syncers:
                due, wait = syncer.core.ready(self.now, live_learners=len(syncer.core.registry))
                if due:
                    times.append(self.now)
                if wait is not None:
                    times.append(self.now + wait)
            if active or self.restarts:
                times += [t for t, _ in self.restarts]
                times += [t for t, *_ in self.faults[:1]]
            for m in active:
                nxt = self.services[m].resend_due() if self.next_done.get(m) is None else None
                if nxt is not None:
                    times.append(nxt)
            if not times or (until is not None and min(times) > until):
                break
            self.clock.t = min(times)
            self._tick(steps)
        return self

    def _tick(self, steps: int) -> None:
        now = self.now
        while self.faults and self.faults[0][0] <= now:
            _, _, kind, arg = heapq.heappop(self.faults)
            self._fault(kind, arg)
        for t, m in [r for r in self.restarts if r[0] <= now]:
            self.restarts.remove((t, m))
            self._spawn(m)
        self._collect()
        self._deliver()
        self._close_due()
        for m in sorted(self.services):
            svc = self.services[m]
            if self.next_done.get(m) != now or svc.core.step_count >= steps:
                continue
            if self.frozen_until.get(m, 0.0) > now:  # alive but silent: the step ends after the freeze
                self.next_done[m] = self.frozen_until[m]
                continue
            svc.core.apply_inbox()
            svc.catch_up()  # told it is too far behind: fetch before pushing again
            svc.step(step_time=self.duration[m])
            self._collect()
            self._close_due()
            self.duration[m] = self._step_time(m)
            self.next_done[m] = now + self.duration[m]
        for m in sorted(self.services):  # blocking baselines wait here for their merges
            svc = self.services[m]
            self._deliver()
            if not svc.ready():
                self.next_done[m] = None
                svc.resend_due()
                self._collect()
            elif self.next_done.get(m) is None:
                self.next_done[m] = now + self.duration[m]


def default_step_times(cfg: RunConfig) -> list[float]:
    return [g.slowdown * (g.batch_size or cfg.inner.batch_size) / cfg.inner.batch_size for g in cfg.learners.expand()]


def run_local(
    cfg: RunConfig,
    run_dir: str | os.PathLike,
    steps: int,
    step_times: list[float] | None = None,
    sync_time: float = 0.0,
    devices: int | None = None,
) -> Sim:
    """Runs M learners for `steps` inner steps each; each learner uses the first `devices` devices."""
    return Sim.start(cfg, run_dir, step_times, sync_time, devices).run(steps)
