"""The run in one process, without Ray, on a virtual clock (deterministic).

Drives the same cores the Ray actors wrap (`LearnerCore`, `SyncerCore`, `StoreCore`) through the
same sequence of calls: learners step and push, the syncer closes rounds when `ready` says so,
merges, commits to the store, and the store's new fragments reach the learners `learner.install`
names (`dloco.publish`: every learner, or those whose push the version merged). Learner m's
step takes ``step_times[m]`` virtual seconds (default: its group's slowdown × batch size /
`inner.batch_size`), times the `chaos` straggler factor and per-step jitter of the config (the
same seeded draws as a Ray run, `dloco.chaos.step_factor`); a commit reaches learners
``sync_time`` virtual seconds after it closes.
Used by tests, notebooks and fast ablations.
"""

from __future__ import annotations

import heapq
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax

from dloco import build, chaos, inner, publish
from dloco.config import RunConfig
from dloco.data import Cursor
from dloco.learner import Delivery, LearnerCore
from dloco.store import StoreCore
from dloco.syncer import SyncerCore


@dataclass
class LocalRun:
    """Everything a finished local run leaves: the cores, its events and the virtual end time."""

    cfg: RunConfig
    blueprint: build.Blueprint
    store: StoreCore
    syncer: SyncerCore
    learners: list[LearnerCore]
    events: list[dict[str, Any]] = field(default_factory=list)
    now: float = 0.0
    bytes_down: list[int] = field(default_factory=list)  # per learner: merged fragments received

    def global_params(self) -> dict:
        return self.blueprint.plan.join([self.store.fragment(p)[1] for p in range(self.blueprint.plan.count)])

    def evaluate(self) -> float:
        mesh = inner.make_mesh()
        ev = inner.make_eval_step(self.blueprint.model, mesh)
        params = inner.replicate(self.global_params(), mesh)
        return inner.evaluate(ev, params, build.eval_set(self.cfg, self.blueprint.corpus), mesh)


def default_step_times(cfg: RunConfig) -> list[float]:
    return [g.slowdown * (g.batch_size or cfg.inner.batch_size) / cfg.inner.batch_size for g in cfg.learners.expand()]


def run_local(
    cfg: RunConfig,
    run_dir: str | os.PathLike,
    steps: int,
    step_times: list[float] | None = None,
    sync_time: float = 0.0,
    devices: int | None = None,
) -> LocalRun:
    """Runs M learners for `steps` inner steps each; each learner uses the first `devices` devices."""
    bp = build.blueprint(cfg)
    store = StoreCore(
        Path(run_dir) / "store",
        list(bp.initial),
        build.initial_outer(cfg, bp),
        cfg.store.snapshot_every,
        cfg.store.keep,
    )
    M = cfg.learners.count
    tokens = bp.corpus.load_split("train")
    mesh = inner.make_mesh(jax.devices()[:devices] if devices else None)
    learners = []
    for m in range(M):
        reg = store.register(m)
        cursor = Cursor.from_dict(reg.cursor) if reg.cursor else None
        stream = build.stream(cfg, tokens, m, cursor, build.learner_batch_size(cfg, m))
        fr = [store.held(p) for p in range(bp.plan.count)]
        learners.append(
            LearnerCore(
                cfg,
                m,
                reg.incarnation,
                bp.model,
                mesh,
                bp.plan,
                [v for _, v in fr],
                [ver for ver, _ in fr],
                stream,
                reg.step,
            )
        )
    syncer = SyncerCore(
        cfg,
        bp.plan,
        bp.embedding,
        [(*store.fragment(p), store.outer_state(p)) for p in range(bp.plan.count)],
        store.live_registry(),
        held=[store.held(p)[1] for p in range(bp.plan.count)],
    )
    run = LocalRun(cfg, bp, store, syncer, learners, bytes_down=[0] * M)
    P = bp.plan.count
    per_learner_delta = cfg.learner.install == "own" and cfg.compression.publish == "delta"
    copies = publish.Copies(cfg.compression.publish_dtype, cfg.compression.block)
    sent = [list(core.version) for core in learners]  # per learner: the newest version sent of each p
    if per_learner_delta:
        for m in range(M):
            for p in range(P):
                copies.set(m, p, *store.held(p))
    times = step_times or default_step_times(cfg)
    slow = chaos.stragglers(cfg.chaos, M)

    def step_time(m: int) -> float:  # learner m's next step, with the config's stragglers and jitter
        return times[m] * chaos.step_factor(cfg.chaos, m, learners[m].step_count + 1, m in slow)

    dur = [step_time(m) for m in range(M)]  # learner m's current step duration
    next_done: list[float | None] = list(dur)  # when learner m completes its next step
    deliveries: list[tuple[float, int, int, Delivery]] = []  # (time, learner, seq, delivery)
    seq = 0

    def deliver(m: int, d: Delivery) -> None:
        if not learners[m].receive(d):  # a delta on top of a version it missed: fetch Θ̂_p in full
            version, values = store.held(d.fragment_id)
            full = Delivery(d.fragment_id, version, values, d.included_step)
            learners[m].receive(full)
            run.bytes_down[m] += full.nbytes
            sent[m][d.fragment_id] = max(sent[m][d.fragment_id], version)
            if per_learner_delta:
                copies.set(m, d.fragment_id, version, values)

    def send(m: int, p: int, version: int, included: int | None, commit, now: float) -> None:
        """Queues fragment p at `version` for learner m, as its wire form (module docstring)."""
        nonlocal seq
        if per_learner_delta:
            kind, obj, base = copies.prepare(m, p, version, sent[m][p], store.fragment(p)[1], store.held(p)[1])
            if kind == "delta":
                d = Delivery(p, version, None, included, delta=obj, base_version=base)
            else:
                d = Delivery(p, version, obj, included)
        elif commit.delta is None:
            d = Delivery(p, version, store.held(p)[1], included)
        else:  # publish: delta to every learner: the syncer's q, valid on top of version − 1
            d = Delivery(p, version, None, included, delta=commit.delta)
        sent[m][p] = version
        run.bytes_down[m] += d.nbytes
        heapq.heappush(deliveries, (now + sync_time, m, seq, d))
        seq += 1

    def close_due(now: float) -> None:
        while True:
            due, _ = syncer.ready(now, live_learners=M)
            if not due:
                return
            for p in due:
                items, grace_used = syncer.take(p, now)
                outcome = syncer.merge(p, items, grace_used=grace_used)
                run.events.extend({**r, "time": now} for r in outcome.rejections)
                if outcome.commit is None:
                    continue
                result = store.commit(outcome.commit)
                if not result.accepted:
                    raise RuntimeError(f"local commit rejected: {result.reason}")
                syncer.committed(outcome, sync_time)
                run.events.append({**outcome.event, "time": now})
                included = {m: e["step"] for m, e in store.last_merged(p).items()}
                for m in range(M):
                    in_flight = [d for _, mm, _, d in deliveries if mm == m]
                    if publish.due(
                        cfg.learner.install,
                        result.version,
                        sent[m][p],
                        learners[m].pending(in_flight)[p],
                        included.get(m),
                        cfg.syncer.max_staleness,
                    ):
                        send(m, p, result.version, included.get(m), outcome.commit, now)

    while True:
        active = [t for m, t in enumerate(next_done) if t is not None and learners[m].step_count < steps]
        candidates = active + [deliveries[0][0]] if deliveries else active
        _, wait = syncer.ready(run.now, live_learners=M)
        if wait is not None:
            candidates.append(run.now + wait)
        if not candidates:
            break
        now = run.now = min(candidates)
        while deliveries and deliveries[0][0] <= now:
            _, m, _, d = heapq.heappop(deliveries)
            deliver(m, d)
        close_due(now)
        for m, core in enumerate(learners):
            if next_done[m] == now and core.step_count < steps:
                core.apply_inbox()
                _, pushes = core.step(step_time=dur[m])
                for push in pushes:
                    decision = syncer.push(push.meta, push.payload, now)
                    if not decision.accept:
                        run.events.append({"event": "rejection", "learner": m, "reason": decision.reason, "time": now})
                close_due(now)
                dur[m] = step_time(m)
                next_done[m] = now + dur[m]
        for m, core in enumerate(learners):  # blocking baselines wait here for their merges
            while deliveries and deliveries[0][0] <= now:
                _, mm, _, d = heapq.heappop(deliveries)
                deliver(mm, d)
            core.apply_inbox()
            if core.waiting_for():
                next_done[m] = None
            elif next_done[m] is None:
                next_done[m] = now + dur[m]
    return run
