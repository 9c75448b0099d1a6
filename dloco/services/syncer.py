"""The syncer's protocol (ALGORITHM.md §5, §6) around `dloco.syncer.SyncerCore`.

`SyncerService.push` validates a contribution into its fragment's round (the payload stays where
the transport put it); `run_due` closes the rounds that are due: get the payloads (a payload lost
with its owner counts as a missing contribution), merge, send the commit to the store, and only
once the store acknowledged adopt the result (`SyncerCore.committed`); a rejected commit (the
store moved on, e.g. restored) makes the syncer adopt the store's state and drop the round.

On (re)start the state comes from the store: Θ_p, s_p, v_p, the registry, Θ̂_p, the last
merged step of every learner and the norm history of the outlier check; pending pushes are soft
state that blocking learners resend and decoupled learners replace with their next push. `push`
and `run_due` may run on different threads: they share the round state under one lock, and the
merge itself reads only what `take` fixed for it. A merged result `dloco.defence` refuses is
logged as `commit_rejected` with its reason, its pushes as rejections, and never committed.
"""

from __future__ import annotations

import dataclasses
import threading
import traceback
from typing import Any

import numpy as np

from dloco import build, compress, events, outer
from dloco.config import RunConfig
from dloco.policy import ContributionMeta, Decision, check_fields
from dloco.services import shards
from dloco.services.wire import Clock, PayloadLostError, StorePeer, Transport
from dloco.syncer import SyncerCore, rejection


class SyncerService:
    def __init__(
        self,
        cfg: RunConfig,
        store: StorePeer,
        transport: Transport,
        clock: Clock,
        shard: int = 0,
        process_s: float | None = None,
    ) -> None:
        """The syncer of shard `shard` (`dloco.services.shards`); `store` is that shard's store.
        `process_s`: how long the process ran before this, reported in ``syncer_start`` with the
        time of each step here (the model, the state fetched from the store: it waits for a store
        that is itself restarting)."""
        self.cfg, self.store, self.transport, self.clock = cfg, store, transport, clock
        self.shard, self.shards = shard, cfg.syncer.shards
        t0 = clock.now()
        bp = build.blueprint(cfg)
        t1 = clock.now()
        frs, registry, shadows, merged, norms = store.syncer_state()
        self.core = SyncerCore(cfg, bp.plan, bp.embedding, frs, registry, shadows, merged, norms)
        self.lock = threading.Lock()
        startup = {"model": t1 - t0, "state": clock.now() - t1}
        if process_s is not None:
            startup = {"process": process_s, **startup}
        start = events.SyncerStart(
            time=clock.wall(), versions=list(self.core.versions), startup_s={k: round(v, 3) for k, v in startup.items()}
        )
        self.events: list[dict] = [start.to_dict()]

    def warm(self) -> None:
        """Compiles the merge path: the wire dtype's merge kernels and each fragment's outer step (run
        on a zero pseudo-gradient, the result dropped), so that a syncer that starts merges its first
        round at once, not seconds late (a short run's learners may reach the budget first). The Ray
        actor runs it on a thread of its own beside the rounds (`actors.syncer`): a round that closes
        first compiles what it needs. A failure is reported; the first merge compiles then."""
        try:
            if self.cfg.compression.dtype in compress.INTEGER_DTYPES:
                from dloco import kernels  # numba: only the processes that merge load it

                kernels.warm(self.cfg.compression.dtype)
                outer.warm_merge_step(outer.outer_config(self.cfg), self.cfg.compression.dtype)  # the fused pass
            c = self.core
            for p in range(c.plan.count):
                c.outer_step(c.values[p], c.states[p], {k: np.zeros_like(v) for k, v in c.values[p].items()})
        except Exception as e:
            err = events.SyncerError(time=self.clock.wall(), error=repr(e), trace=traceback.format_exc(limit=5))
            with self.lock:
                self.events.append(err.to_dict())

    def push(self, meta: ContributionMeta, ref: Any) -> Decision:
        """Accepts or rejects one contribution; `ref` is where the transport put its payload."""
        formed = check_fields(meta).accept  # a malformed push is rejected by `core.push`, touching nothing
        if formed and self.shards > 1 and shards.owner(meta.fragment_id, self.shards) != self.shard:
            d = Decision(False, f"fragment {meta.fragment_id} is not syncer shard {self.shard}'s")
            with self.lock:
                self.events.append(rejection(meta, d.reason, self.clock.wall()))
            return d
        if formed and self.core.registry.get(meta.learner_id) != meta.incarnation:
            registry = self.store.registry()  # a (re)started learner the syncer has not seen yet
            with self.lock:
                self.core.update_registry(registry)
        with self.lock:
            d = self.core.push(meta, ref, self.clock.now(), self.clock.wall())
            if not d.accept:
                self.events.append(rejection(meta, d.reason, self.clock.wall()))
            p = meta.fragment_id
            version = self.core.versions[p] if formed and 0 <= p < len(self.core.versions) else None
        return dataclasses.replace(d, version=version)

    def holds(self, meta: ContributionMeta) -> bool:
        """`SyncerCore.holds`: whether the push `meta` describes is pending, being merged or merged."""
        with self.lock:
            return self.core.holds(meta)

    def run_due(self) -> float | None:
        """Closes every round that is due; returns the seconds until the next deadline (None: none)."""
        while True:
            try:
                with self.lock:
                    due, wait = self.core.ready(self.clock.now(), live_learners=len(self.core.registry))
                for p in due:
                    self.close(p)
            except Exception as e:  # a failed round is reported; its fragment is tried again later
                err = events.SyncerError(time=self.clock.wall(), error=repr(e), trace=traceback.format_exc(limit=5))
                self.events.append(err.to_dict())
                return 0.1
            if not due:
                return wait

    def close(self, p: int) -> None:
        try:
            self._close(p)
        finally:
            with self.lock:
                self.core.release(p)

    def _close(self, p: int) -> None:
        t0 = self.clock.now()
        with self.lock:
            items, grace_used = self.core.take(p, t0)
        pairs, lost = [], {}
        for meta, ref in items:
            try:
                pairs.append((meta, self.transport.get(ref)))
            except PayloadLostError as e:
                pairs.append((meta, None))
                lost[(meta.learner_id, meta.step)] = f"payload lost: {e}"
        outcome = self.core.merge(p, pairs, grace_used=grace_used, lost=lambda m: lost[(m.learner_id, m.step)])
        wall = self.clock.wall()
        self.events.extend({**r, "time": wall} for r in outcome.rejections)
        if outcome.commit is None:  # nothing valid, or a result refused before its commit (`dloco.defence`)
            if outcome.event["event"] == events.CommitRejected.EVENT:
                self.events.append({**outcome.event, "time": wall})
            return
        result = self.store.commit(outcome.commit)
        if result.accepted:
            with self.lock:
                self.core.committed(outcome, self.clock.now() - t0)
            ages = [round(wall - m.sent_at, 3) for m, _ in items if m.learner_id in outcome.event["contributors"]]
            self.events.append(
                {**outcome.event, "time": self.clock.wall(), "sync_s": self.clock.now() - t0, "push_age_s": ages}
            )
        else:  # the store moved on (e.g. restored): adopt its state, the round's work is dropped
            frs, _, shadows, _, norms = self.store.syncer_state()
            version, values, state = frs[p]
            with self.lock:
                self.core.reload(p, version, values, state, shadows[p], norms[p])
            self.events.append(events.CommitRejected(time=wall, fragment=p, reason=result.reason).to_dict())

    def status(self) -> dict:
        with self.lock:
            return {
                "versions": list(self.core.versions),
                "pending": [len(r.pending) for r in self.core.rounds],
                "busy": self.core.busy(),  # rounds that commit without another push
                "grace_s": self.core.grace(),
                "slack_s": self.core.slack(),
            }

    def drain_events(self) -> list[dict]:
        with self.lock:
            events, self.events = self.events, []
            return events
