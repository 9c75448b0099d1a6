"""The learner's protocol (ALGORITHM.md §4, §9, §10) around `dloco.learner.LearnerCore`.

On construction a learner tokenizes its corpus with the driver's tokenizer and checks that the
corpus is the driver's (`expect`: `build.corpus_identity`; a node with other files refuses to
start), registers with the store (a new incarnation), installs the shadow fragments Θ̂_p and resumes
its data stream from its merged cursor. `step` trains one batch and sends the pushes that fell due:
the payload is put with the transport and announced to the syncer. `receive` takes the store's
updates: the payload is fetched and queued for install; a delta on top of a version the learner does
not hold, or a payload that cannot be fetched any more, is replaced by a fetch of Θ̂_p in full.

Chaos (`dloco.chaos`, decided by the config's seed): a push drawn as lost is not sent. Blocking
algorithms (dp, elastic_dp, diloco, streaming) wait for the merge of each push; every
`chaos.resend_s` without its merge the learner asks the syncer whether it has the push (a few
bytes), and sends the payload again only if it has not (`resend_due`): lost on the wire, or
forgotten by a restarted syncer or a dropped round. Waiting for a straggler costs no payload.
Straggling and freezes are time, which the driver (`actors.learner` or `dloco.sim`) spends;
`step_factor` says how much.

A spare learner (`learners.spares`) runs `warm_up` before it has an identity; the service it then
builds from that blueprint neither tokenizes nor compiles again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

from dloco import build, chaos, events
from dloco.config import RunConfig
from dloco.data import Cursor
from dloco.learner import Delivery, LearnerCore, Push
from dloco.services.wire import Clock, PayloadLostError, StorePeer, SyncerPeer, Transport, Update


def warm_up(cfg: RunConfig, mesh, expect: dict | None = None, learner_id: int | None = None) -> build.Blueprint:
    """What a spare (`learner_id` None), or a learner before it first registers, prepares: the
    blueprint (the driver's tokenizer, the corpus checked against the driver's), the training split
    mapped, and the train step compiled by one step of a throwaway core on shard 0 with the
    learner's batch size (`inner.make_train_step` is cached, so the real core reuses it; a spare
    uses the first group's, and one that becomes a learner of another batch size compiles again)."""
    bp = build.blueprint(cfg, (expect or {}).get("tokenizer_json"))
    build.check_corpus(cfg, bp.corpus, expect, "a spare learner" if learner_id is None else f"learner {learner_id}")
    batch = build.learner_batch_size(cfg, learner_id or 0)
    stream = build.stream(cfg, bp.corpus.load_split("train"), 0, None, batch)
    versions = [0] * bp.plan.count
    LearnerCore(cfg, 0, 0, bp.model, mesh, bp.plan, list(bp.initial), versions, stream).step(step_time=0.0)
    return bp


class LearnerService:
    def __init__(
        self,
        cfg: RunConfig,
        learner_id: int,
        store: StorePeer,
        syncer: SyncerPeer,
        transport: Transport,
        clock: Clock,
        mesh,
        expect: dict | None = None,
        warm: build.Blueprint | None = None,
    ) -> None:
        self.cfg, self.learner_id = cfg, learner_id
        self.store, self.syncer, self.transport, self.clock = store, syncer, transport, clock
        bp = warm or build.blueprint(cfg, (expect or {}).get("tokenizer_json"))  # the driver's tokenizer
        if warm is None:  # (a spare's `warm_up` checked it)
            build.check_corpus(cfg, bp.corpus, expect, f"learner {learner_id}")  # before it registers
        reg = store.register(learner_id)
        versions, fragments = store.fragments(shadow=True, learner_id=learner_id)
        cursor = Cursor.from_dict(reg.cursor) if reg.cursor else None
        batch = build.learner_batch_size(cfg, learner_id)
        stream = build.stream(cfg, bp.corpus.load_split("train"), learner_id, cursor, batch)
        self.core = LearnerCore(
            cfg, learner_id, reg.incarnation, bp.model, mesh, bp.plan, fragments, versions, stream, reg.step
        )
        groups = cfg.learners.expand()
        self.group = groups[min(learner_id, len(groups) - 1)]
        self.straggler = learner_id in chaos.stragglers(cfg.chaos, cfg.learners.count)
        self.start_step = reg.step
        self.unacked: dict[int, tuple[float, Push]] = {}  # blocking: fragment → (sent or lost at, push)
        self.behind: dict[int, int] = {}  # fragment → version the syncer reported when it refused a push as out of date
        self.fetch: set[int] = set()  # of those, the fragments to fetch in full (not merely wait for)
        self._since: dict[int, float] = {}  # fragment → when (clock.now) it fell behind
        self.in_transit: Callable[[], Iterable[Update]] = tuple  # updates on the (emulated) wire: the driver's
        self.held = 0  # pushes not sent while this learner is known to be behind on their fragment
        self.events: list[dict] = []
        self.pushes = self.installs = self.bytes_out = self.bytes_in = 0

    @property
    def incarnation(self) -> int:
        return self.core.incarnation

    def step_factor(self) -> float:
        """How much longer than a plain step the step just taken lasts: group slowdown × chaos."""
        c = self.core
        return self.group.slowdown * chaos.step_factor(self.cfg.chaos, self.learner_id, c.step_count, self.straggler)

    def ready(self) -> bool:
        """Installs what is due; False while a blocking learner still waits for a merge."""
        self.core.apply_inbox()
        return not self.core.waiting_for()

    def step(self, step_time: float, cycle_time: float | None = None) -> dict[str, float]:
        """One inner step (the caller checked `ready`); sends the pushes that fell due."""
        metrics, pushes = self.core.step(step_time=step_time, cycle_time=cycle_time)
        self._take_decisions()
        for push in pushes:
            m = push.meta
            if self._behind(m.fragment_id):  # it would be refused again: hold it
                self.held += 1
                continue
            if self.core.blocking:
                self.unacked[m.fragment_id] = (self.clock.now(), push)
            if chaos.payload_lost(self.cfg.chaos, m.learner_id, m.incarnation, m.step, m.fragment_id):
                lost = events.PayloadLost(
                    time=self.clock.wall(), learner=m.learner_id, fragment=m.fragment_id, step=m.step, bytes=push.nbytes
                )
                self.events.append(lost.to_dict())
                continue
            self._send(push)
        return metrics

    def drain(self) -> int:
        """A preemption notice: sends `LearnerCore.flush`'s pushes (not those of a fragment it is
        behind on: they would be refused); returns how many it sent. `drained` says when they merged."""
        pushes = [push for push in self.core.flush() if not self._behind(push.meta.fragment_id)]
        for push in pushes:
            self._send(push)
        return len(pushes)

    def drained(self) -> bool:
        """All this learner trained is merged: no push waits for its merge (installed, queued or on
        the wire) and no fragment has progress no push carries."""
        in_flight = [Delivery(u.fragment_id, u.version, None, u.included_step) for u in self.in_transit()]
        return all(s is None for s in self.core.pending(in_flight)) and not any(self.core.c_steps)

    def _send(self, push: Push) -> None:
        ref = self.transport.put(push.payload)
        self.pushes += 1
        self.bytes_out += push.nbytes
        meta = dataclasses.replace(push.meta, sent_at=self.clock.wall())
        self.decided(meta, self.syncer.push(meta, ref))  # in process the decision comes back at once

    def _take_decisions(self) -> None:
        for meta, d in self.syncer.decisions():
            self.decided(meta, d)

    def decided(self, meta, d) -> None:
        """The syncer's decision on a push. Refused because the learner has not heard of merges the
        store has (its base is `stale`, or the push `overlap`s or replays a merged push of its own),
        it learns the fragment's version: it holds its pushes of that fragment until it holds that
        version. A stale learner fetches it in full at once; after an overlap the merge is usually
        in the mail already (a push crossed it on the wire, which latency makes common), so it
        fetches only if the mail has not brought it within `chaos.resend_s` (the time after which
        a blocking learner takes a merge for lost, too) (`catch_up_due`)."""
        if d is not None and d.accept and d.next_push is not None:
            self.core.retime(meta.fragment_id, meta.step, d.next_push)  # sync.dynamic
        if d is None or d.accept or d.version is None or self.core.blocking:
            return  # (blocking algorithms wait for every merge: they are never behind)
        stale = d.reason.startswith("stale")
        if (stale or d.reason.startswith("overlap") or "merged already" in d.reason) and d.version > meta.base_version:
            p = meta.fragment_id
            self.behind[p] = max(self.behind.get(p, -1), d.version)
            self._since.setdefault(p, self.clock.now())
            if stale:
                self.fetch.add(p)

    def _behind(self, p: int) -> bool:
        return p in self.behind and self.known()[p] < self.behind[p]

    def catch_up_due(self) -> list[int]:
        """Fragments to fetch in full before pushing them again: the syncer said the store has a
        newer version than this learner holds, queued or in transit (e.g. mail lost with a
        restarted store, or a learner frozen while the others merged)."""
        for p in [p for p in self.behind if not self._behind(p)]:
            del self.behind[p]  # caught up (by mail, or by a fetch)
            self._since.pop(p, None)
        now, wait = self.clock.now(), self.cfg.chaos.resend_s  # then the mail is lost, not on its way
        self.fetch |= {p for p, t in self._since.items() if now - t >= wait}
        self.fetch &= set(self.behind)
        return sorted(self.fetch)

    def catch_up(self) -> None:
        """Fetches, waiting for each, the fragments `catch_up_due` names (in process; the Ray
        learner fetches them without waiting and hands each to `install_full`)."""
        for p in self.catch_up_due():
            self._fetch_full(p)

    def install_full(self, p: int, fetched: tuple[int, dict, int | None]) -> None:
        """Queues fragment p as fetched in full from the store (`StorePeer.shadow`)."""
        version, values, included = fetched
        d = Delivery(p, version, values, included)
        self.core.receive(d)
        self.bytes_in += d.nbytes
        if version >= self.behind.get(p, version):
            self.behind.pop(p, None)
            self._since.pop(p, None)
            self.fetch.discard(p)

    def resend_due(self) -> float | None:
        """Blocking algorithms: for each push waited on for `chaos.resend_s` without its merge, asks
        the syncer whether it has it (`SyncerPeer.holds`) and sends it again only if not; returns
        when (on the service's clock) to look again (None: nothing waited on).

        Decision: ask, not resend blindly. A synchronous round waits for its slowest learner; a
        timer alone resent every waiting push each `resend_s` (76 payloads in 24 steps of
        `test_waiting_for_a_straggler_costs_no_payload`, 0 now), multiplying a blocking baseline's
        bytes on a WAN link."""
        waiting, now, resend = set(self.core.waiting_for()), self.clock.now(), self.cfg.chaos.resend_s
        for p in list(self.unacked):
            if p not in self.core.outstanding:
                del self.unacked[p]  # merged and installed
        nxt = None
        for p, (t, push) in self.unacked.items():
            if p not in waiting:
                continue
            if now >= t + resend:
                held = self.syncer.holds(push.meta)
                if held is None:  # asked; the answer comes on a later call
                    nxt = now + 0.05 if nxt is None else min(nxt, now + 0.05)
                    continue
                if held:  # on its way to a merge: look again in resend_s
                    self.unacked[p] = (now, push)
                    nxt = now + resend if nxt is None else min(nxt, now + resend)
                    continue
                again = events.PayloadResent(
                    time=self.clock.wall(), learner=self.learner_id, fragment=p, step=push.meta.step
                )
                self.events.append(again.to_dict())
                self.unacked[p] = (now, push)
                self._send(push)
                t = now
            nxt = t + resend if nxt is None else min(nxt, t + resend)
        return nxt

    def receive(self, updates: list[Update]) -> None:
        """Queues the store's updates for install (fetching Θ̂_p in full where needed)."""
        for u in updates:
            try:
                obj = self.transport.get(u.ref)
            except PayloadLostError:  # the publication went with a restarted store: fetch it directly
                self._fetch_full(u.fragment_id)
                continue
            if u.kind == "delta":
                d = Delivery(u.fragment_id, u.version, None, u.included_step, delta=obj, base_version=u.base_version)
            else:
                d = Delivery(u.fragment_id, u.version, obj, u.included_step)
            if self.core.receive(d):
                self.bytes_in += d.nbytes
            else:  # a delta on top of a version it missed
                self._fetch_full(u.fragment_id)
            self.installs += 1

    def _fetch_full(self, p: int) -> None:
        self.install_full(p, self.store.shadow(p, self.learner_id))

    def known(self, in_transit: Iterable[Update] = ()) -> list[int]:
        """Newest version of each fragment this learner has: installed, queued or `in_transit`."""
        known = list(self.core.versions)
        newer: list[Delivery | Update] = [*self.core.inbox.values(), *in_transit, *self.in_transit()]
        for d in newer:
            known[d.fragment_id] = max(known[d.fragment_id], d.version)
        return known

    def status(self) -> dict:
        c = self.core
        return {
            "learner": self.learner_id,
            "incarnation": c.incarnation,
            "step": c.step_count,
            "steps_this_incarnation": c.step_count - self.start_step,
            "tokens": c.step_count * c.tokens_per_step,
            "tokens_this_incarnation": (c.step_count - self.start_step) * c.tokens_per_step,
            "resyncs": c.resyncs,
            "skipped_pushes": c.skipped,
            "held_pushes": self.held,
            "pushes": self.pushes,
            "installs": self.installs,
            "bytes_out": self.bytes_out,
            "bytes_in": self.bytes_in,
            "versions": list(c.versions),
        }

    def drain_events(self) -> list[dict]:
        events, self.events = self.events, []
        return events
