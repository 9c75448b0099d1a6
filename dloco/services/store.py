"""The fragment store's protocol (ALGORITHM.md §1, §7, §8) around `dloco.store.StoreCore`.

`StoreService` answers registrations, fetches and commits, and decides who receives each commit:
it keeps per learner a session (the newest version sent of each fragment and the merged step the
learner was last told of) and, when a commit is acknowledged, puts an `Update` into the mailbox
of every learner `dloco.publish.due` names. A learner takes its mail with `updates` (in Ray a long
poll that returns when mail arrives); nobody polls on a timer and nobody resends what it holds.

Forms (ALGORITHM.md §7): with `compression.publish: full` every update holds Θ̂_p, put once per
commit; with ``delta`` the syncer's q (valid on version v − 1) or, for a learner further behind,
Θ̂_p in full (put once per version); with ``delta`` and `learner.install: own`, a delta encoded for
that learner against the copy the store knows it holds (`dloco.publish.Copies`).

Sessions and copies are soft state: a restarted store rebuilds Θ, s, the ledger and the registry
from disk (`StoreCore`) and opens a learner's session again from the versions the learner says it
holds on its next `updates` call. Calls are serialized by one lock, so a transport may run them
on worker threads (the Ray actor does, to keep encoding and disk writes off its event loop).
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dloco import build, events, publish
from dloco.checkpoints import Checkpointer
from dloco.config import BLOCKING_ALGORITHMS, RunConfig
from dloco.mirror import Mirror
from dloco.services import shards
from dloco.services.wire import Clock, Transport, Update
from dloco.store import Commit, CommitResult, Registration, StoreCore


@dataclass
class _Session:
    incarnation: int
    sent: list[int]  # per fragment: the newest version sent (or given at registration)
    told: list[int | None]  # per fragment: the merged step the learner was last told of
    outbox: list[Update] = field(default_factory=list)


class StoreService:
    def __init__(
        self,
        cfg: RunConfig,
        run_dir: str | Path,
        transport: Transport,
        clock: Clock,
        lock_wait_s: float = 10.0,
        shard: int = 0,
        process_s: float | None = None,
    ) -> None:
        """Restores the store (shard `shard` of `syncer.shards`: `dloco.services.shards`) from its
        directory; `RunDirLocked` if another store has it open (after waiting `lock_wait_s` for it
        to go: a predecessor process may still be exiting), `ShardLayoutError` if the run dir's
        store was written with another shard count. `process_s`: how long the process ran before
        this (the actor's), reported in ``store_start`` with the time of each step here."""
        self.cfg, self.transport, self.clock = cfg, transport, clock
        t0 = clock.now()
        bp, n = build.blueprint(cfg), cfg.syncer.shards
        t1 = clock.now()
        if problem := shards.layout_problem(run_dir, n):
            raise shards.ShardLayoutError(problem)
        self.owned = shards.owned(bp.plan.count, n, shard)
        mine = [p in self.owned for p in range(bp.plan.count)]
        uri = cfg.store.mirror and (cfg.store.mirror if n == 1 else f"{cfg.store.mirror}/shard-{shard}-of-{n}")
        self.core = StoreCore(
            shards.store_root(run_dir, shard, n),
            [f if own else {} for f, own in zip(bp.initial, mine, strict=True)],
            [s if own else [] for s, own in zip(build.initial_outer(cfg, bp), mine, strict=True)],
            cfg.store.snapshot_every,
            cfg.store.keep,
            lock_wait_s,
            Mirror(uri, cfg.store.mirror_lease_s) if uri else None,
            self.owned,
            cfg.store.fresh_if_lost,
        )
        startup = {"model": t1 - t0, "restore": clock.now() - t1}
        if process_s is not None:
            startup = {"process": process_s, **startup}
        c = cfg.compression
        self.per_learner = cfg.learner.install == "own" and c.publish == "delta"
        self.copies = publish.Copies(c.publish_dtype, c.block, cfg.store.copies_mb << 20, c.entropy)
        self.sessions: dict[int, _Session] = {}
        self._deltas: dict[int, tuple[int, Any]] = {}  # p → (version, ref of the syncer's q), put once
        self._full: dict[int, tuple[int, Any]] = {}  # p → (version, ref of Θ̂_p): for learners behind a delta
        self.lock = threading.RLock()
        self.checkpoints = Checkpointer(cfg, run_dir, clock.now, self._error) if cfg.export.enabled else None
        start = events.StoreStart(
            time=clock.wall(),
            versions=self.core.versions,
            restored_from=self.core.restored_from,
            quarantined=list(self.core.quarantined),
            startup_s={k: round(v, 3) for k, v in startup.items()},
        )
        self.events: list[dict] = [start.to_dict()]

    def close(self) -> None:
        """Releases the run directory (idempotent), so that another store may open it; a checkpoint
        being written is finished first."""
        if self.checkpoints is not None:
            self.checkpoints.wait()
        with self.lock:
            self.core.close()

    def _error(self, text: str) -> None:
        """A failure beside the commits (a checkpoint), reported as a ``store_error`` event."""
        with self.lock:
            self.events.append(events.StoreError(time=self.clock.wall(), error=text).to_dict())

    @property
    def count(self) -> int:
        return len(self.core.versions)

    def _merged(self, p: int, learner_id: int) -> int | None:
        e = self.core.last_merged(p).get(learner_id)
        return None if e is None else int(e["step"])

    # ---- learners ----------------------------------------------------------------------------
    def register(self, learner_id: int, incarnation: int | None = None, announce: bool = True) -> Registration:
        """A learner (re)starts: new incarnation (or `incarnation`, which the shards agreed on:
        `shards.ShardedStore`), logged as an event if `announce`; its session starts from the
        current versions.

        A learner of a blocking algorithm with several fragments (streaming) resumes its step
        counter at the newest round any fragment completed, not at its own oldest merged push:
        the others wait, in lock step, for its push of the next fragment due after that round, and
        from an older step it would first wait for a round of another fragment that they
        completed already (a deadlock, found by tests/test_faults_sim.py). Its data cursor stays
        its own merged cursor.
        """
        with self.lock:
            try:
                reg = self.core.register(learner_id, incarnation)
            except OSError as oserr:  # the registry cannot be written: reported, and the learner retries
                err = events.StoreError(time=self.clock.wall(), error=f"registering learner {learner_id}: {oserr!r}")
                self.events.append(err.to_dict())
                raise
            if self.cfg.algorithm in BLOCKING_ALGORITHMS and self.count > 1:
                newest = [int(e["step"]) for p in range(self.count) for e in self.core.last_merged(p).values()]
                reg = dataclasses.replace(reg, step=max(newest, default=0))
            self.copies.forget(learner_id)
            self.sessions[learner_id] = _Session(
                reg.incarnation,
                list(self.core.versions),
                [self._merged(p, learner_id) for p in range(self.count)],
            )
            if not announce:
                return reg
            kind = events.LearnerStart if reg.incarnation == 1 else events.LearnerRestart
            e = kind(
                time=self.clock.wall(),
                learner=learner_id,
                incarnation=reg.incarnation,
                cursor=reg.cursor,
                step=reg.step,
            )
            self.events.append(e.to_dict())
            return reg

    def retire(self, learner_id: int) -> None:
        with self.lock:
            self.core.retire(learner_id)
            self.sessions.pop(learner_id, None)
            self.copies.forget(learner_id)
            self.events.append(events.LearnerStop(time=self.clock.wall(), learner=learner_id).to_dict())

    def registry(self) -> dict[int, int]:
        with self.lock:
            return self.core.live_registry()

    def fragments(self, shadow: bool = False, learner_id: int | None = None) -> tuple[list[int], list[dict]]:
        """All fragments (versions, values): Θ_p for evaluation, or with `shadow` the shadows Θ̂_p, what a
        (re)starting learner installs (`learner_id`: recorded as what it holds)."""
        with self.lock:
            get = self.core.shadow if shadow else self.core.fragment
            frs = [get(p) for p in range(self.count)]
            s = self.sessions.get(learner_id) if shadow and learner_id is not None else None
            for p, (v, values) in enumerate(frs):
                if p not in self.owned:
                    continue
                if s is not None:
                    s.sent[p] = max(s.sent[p], v)
                if shadow and learner_id is not None and self.per_learner:
                    self.copies.set(learner_id, p, v, values)
            return [v for v, _ in frs], [values for _, values in frs]

    def shadow(self, p: int, learner_id: int | None = None) -> tuple[int, dict, int | None]:
        """(v_p, Θ̂_p, step of the learner's last push merged into p): one fragment in full, for a
        learner that could not apply a delta (it missed a version) or lost a payload."""
        with self.lock:
            v, values = self.core.shadow(p)
            merged = None if learner_id is None else self._merged(p, learner_id)
            s = self.sessions.get(learner_id) if learner_id is not None else None
            if s is not None:
                s.sent[p], s.told[p] = max(s.sent[p], v), merged
            if learner_id is not None and self.per_learner:
                self.copies.set(learner_id, p, v, values)
            return v, values, merged

    def updates(self, learner_id: int, incarnation: int, known: list[int]) -> list[Update]:
        """The learner's mail, emptied. A learner this store has no session for (the store
        restarted) opens one from the versions it `known`s; what it is due for is sent at once."""
        with self.lock:
            if self.core.live_registry().get(learner_id) != incarnation:
                return []  # an old incarnation, or retired: nothing for it
            s = self.sessions.get(learner_id)
            if s is None or s.incarnation != incarnation:
                s = self.sessions[learner_id] = _Session(incarnation, list(known), [None] * self.count)
                self.copies.forget(learner_id)
                for p in self.owned:
                    self._offer(learner_id, s, p, None)
            out, s.outbox = s.outbox, []
            return out

    def has_mail(self, learner_id: int) -> bool:
        s = self.sessions.get(learner_id)
        return s is not None and bool(s.outbox)

    # ---- the syncer --------------------------------------------------------------------------
    def syncer_state(
        self,
    ) -> tuple[list[tuple[int, dict, list]], dict[int, int], list[dict], list[dict[int, tuple]], list[list[float]]]:
        """What a (re)starting syncer needs: (v_p, Θ_p, s_p) per fragment, the registry, Θ̂_p, per
        fragment the (incarnation, step) of each learner's last merged push, and per fragment the
        norm history of its outlier check as of the last commit (empty in an old run directory)."""
        with self.lock:
            n = self.count
            frs = [(*self.core.fragment(p), self.core.outer_state(p)) for p in range(n)]
            merged = [
                {m: (int(e["incarnation"]), int(e["step"])) for m, e in self.core.last_merged(p).items()}
                for p in range(n)
            ]
            norms = [list(f.norms) for f in self.core.fragments]
            return frs, self.core.live_registry(), [self.core.shadow(p)[1] for p in range(n)], merged, norms

    def commit(self, c: Commit) -> CommitResult:
        """Logs and applies the commit (compare-and-set), then mails it to the learners due for it."""
        with self.lock:
            failed = self.core.error_count
            result = self.core.commit(c)
            new = self.core.errors[len(self.core.errors) - (self.core.error_count - failed) :]
            for e in new:  # e.g. the snapshot after it failed (the commit itself stands)
                err = events.StoreError(time=self.clock.wall(), error=f"{e['op']}: {e['error']}")
                self.events.append(err.to_dict())
            if result.accepted and result.reason == "committed":
                p = c.fragment_id
                self._deltas.pop(p, None)
                if c.delta is not None:
                    self._deltas[p] = (result.version, self.transport.put(c.delta))
                live = self.core.live_registry()
                for m, s in self.sessions.items():
                    if live.get(m) == s.incarnation:
                        self._offer(m, s, p, c)
                if self.checkpoints is not None and self.checkpoints.due(self.core.commits):
                    n = len(self.core.versions)
                    self.checkpoints.take(
                        self.core.commits, self.core.versions, [self.core.fragment(q)[1] for q in range(n)]
                    )
            return result

    def _offer(self, m: int, s: _Session, p: int, c: Commit | None) -> None:
        """Mails fragment p's current version to learner m if it is due (`dloco.publish.due`)."""
        v = self.core.versions[p]
        merged = self._merged(p, m)
        if not publish.due(self.cfg.learner.install, v, s.sent[p], s.told[p], merged, self.cfg.syncer.max_staleness):
            return
        if self.per_learner:
            target, full = self.core.fragment(p)[1], self.core.shadow(p)[1]
            kind, obj, base = self.copies.prepare(m, p, v, s.sent[p], target, full)
            ref = self.transport.put(obj)
        else:
            delta = self._deltas.get(p)
            if delta is not None and delta[0] == v and s.sent[p] == v - 1:
                kind, ref, base = "delta", delta[1], v - 1
            else:
                kind, ref, base = "full", self._full_ref(p, v), v
        if kind == "full":  # supersedes whatever older mail of p is still waiting
            s.outbox = [u for u in s.outbox if u.fragment_id != p]
        s.outbox.append(Update(p, v, ref, merged, kind, base))
        s.sent[p], s.told[p] = v, merged

    def _full_ref(self, p: int, v: int) -> Any:
        full = self._full.get(p)
        if full is None or full[0] != v:  # put once per version, however many learners need it
            full = self._full[p] = (v, self.transport.put(self.core.shadow(p)[1]))
        return full[1]

    def summary(self) -> dict:
        with self.lock:
            return {**self.core.summary(), "copies": self.copies.stats()}

    def drain_events(self) -> list[dict]:
        with self.lock:
            events, self.events = self.events, []
            return events
