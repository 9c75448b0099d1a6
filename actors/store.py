"""`FragmentStore`: the Ray actor around `dloco.store.StoreCore` (ALGORITHM.md §1, §8).

A plain class; `actors.launch` wraps it with ``ray.remote(max_restarts=-1, max_task_retries=-1)``.
Its methods are coroutines that never yield but in `updates`, so Ray runs it as an async actor
whose calls execute one at a time on its event loop (no locks needed) while `updates` can
long-poll: a blocked learner waits there until a newer version is committed, instead of polling.
On (re)start it rebuilds itself from its constructor arguments and its run directory: the newest
snapshot plus the commit log. Published fragments are put into Ray's object store by this actor,
so they outlive any learner or syncer; after a store restart they are put again on demand. With
`compression.publish: delta` a commit is published as its quantized delta q ("delta"); a learner
that missed a version, and every learner after a store restart, gets Θ̂_p in full ("full").
With `learner.install: own` (`dloco.publish`) a learner is sent a fragment only when it is due
for it (its own push merged, or too far behind), and with `publish: delta` as a delta encoded
for that learner against the copy this actor knows it holds (put once per delivery).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import ray

from dloco import build, publish
from dloco.config import RunConfig, from_dict
from dloco.store import Commit, CommitResult, Registration, StoreCore


class FragmentStore:
    def __init__(self, cfg: dict, run_dir: str) -> None:
        self.cfg: RunConfig = from_dict(cfg)
        bp = build.blueprint(self.cfg)
        self.core = StoreCore(
            Path(run_dir) / "store",
            list(bp.initial),
            build.initial_outer(self.cfg, bp),
            self.cfg.store.snapshot_every,
            self.cfg.store.keep,
        )
        self._published: dict[int, tuple[int, ray.ObjectRef, dict[int, int], str]] = {}
        c = self.cfg.compression
        self._per_learner = self.cfg.learner.install == "own" and c.publish == "delta"
        self._copies = publish.Copies(c.publish_dtype, c.block)  # learner → what it holds (per-learner delta)
        self._committed: asyncio.Event | None = None  # set (and replaced) at every commit
        self._full: dict[int, tuple[int, ray.ObjectRef]] = {}  # p → (v, Θ̂_p), for learners behind a delta
        self._events: list[dict] = [
            {
                "event": "store_start",
                "time": time.time(),
                "versions": self.core.versions,
                "restored_from": self.core.restored_from,
            }
        ]

    async def register(self, learner_id: int) -> Registration:
        reg = self.core.register(learner_id)
        self._copies.forget(learner_id)
        kind = "learner_start" if reg.incarnation == 1 else "learner_restart"
        self._events.append(
            {
                "event": kind,
                "time": time.time(),
                "learner": learner_id,
                "incarnation": reg.incarnation,
                "cursor": reg.cursor,
                "step": reg.step,
            }
        )
        return reg

    async def retire(self, learner_id: int) -> None:
        self.core.retire(learner_id)
        self._events.append({"event": "learner_stop", "time": time.time(), "learner": learner_id})

    async def registry(self) -> dict[int, int]:
        return self.core.live_registry()

    async def fragments(self, held: bool = False, learner_id: int | None = None) -> tuple[list[int], list[dict]]:
        """All current fragments (versions, values): Θ_p for evaluation, or with `held` Θ̂_p, what a
        (re)starting learner installs (`learner_id`: recorded as what it holds)."""
        get = self.core.held if held else self.core.fragment
        frs = [get(p) for p in range(len(self.core.versions))]
        if held and learner_id is not None and self._per_learner:
            for p, (v, values) in enumerate(frs):
                self._copies.set(learner_id, p, v, values)
        return [v for v, _ in frs], [values for _, values in frs]

    async def held(self, p: int, learner_id: int | None = None) -> tuple[int, dict, dict[int, int]]:
        """(v_p, Θ̂_p, last merged step per learner): a learner's full fetch of one fragment."""
        v, values = self.core.held(p)
        if learner_id is not None and self._per_learner:
            self._copies.set(learner_id, p, v, values)
        return v, values, self._merged_steps(p)

    async def syncer_state(self) -> tuple[list[tuple[int, dict, list]], dict[int, int], list[dict]]:
        """What a (re)starting syncer needs: (v_p, Θ_p, s_p) per fragment, the registry, and Θ̂_p."""
        n = len(self.core.versions)
        frs = [(*self.core.fragment(p), self.core.outer_state(p)) for p in range(n)]
        return frs, self.core.live_registry(), [self.core.held(p)[1] for p in range(n)]

    async def commit(self, c: Commit) -> CommitResult:
        result = self.core.commit(c)
        if result.accepted:
            if not self._per_learner:  # per-learner deltas are encoded when a learner is due (`_newer`)
                kind, obj = ("full", self.core.held(c.fragment_id)[1]) if c.delta is None else ("delta", c.delta)
                p = c.fragment_id
                self._published[p] = (result.version, ray.put(obj), self._merged_steps(p), kind)
            if self._committed is not None:
                self._committed.set()
                self._committed = None
        return result

    def _merged_steps(self, p: int) -> dict[int, int]:
        """learner → step of its last push merged into fragment p (from the ledger).

        A learner that polls less often than versions advance still learns which of its pushes
        reached the fragment, even when the newest commit did not include it.
        """
        return {m: e["step"] for m, e in self.core.last_merged(p).items()}

    async def updates(
        self,
        known: list[int],
        wait_s: float = 0.0,
        learner_id: int | None = None,
        pending: list[int | None] | None = None,
    ) -> list[tuple[int, int, list[ray.ObjectRef], dict[int, int], str, int]]:
        """Fragments newer than `known` versions that the learner is due for (`dloco.publish.due`,
        from its `pending` push steps): (p, version, [ref], last merged step per learner, kind,
        base version).

        kind "full": the ref holds Θ̂_p; "delta": the quantized difference to the base version,
        which only a learner at exactly that version can apply (the others get the full Θ̂_p).
        With `wait_s` > 0 and nothing due yet, waits up to that long for the next commits.
        """
        deadline = time.monotonic() + wait_s
        while True:
            out = self._newer(known, learner_id, pending)
            left = deadline - time.monotonic()
            if out or left <= 0:
                return out
            if self._committed is None:
                self._committed = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._committed.wait(), left)

    def _newer(
        self, known: list[int], learner_id: int | None, pending: list[int | None] | None
    ) -> list[tuple[int, int, list[ray.ObjectRef], dict[int, int], str, int]]:
        out = []
        install = self.cfg.learner.install if learner_id is not None else "every"
        for p, v in enumerate(self.core.versions):
            if v <= known[p]:
                continue
            merged = self._merged_steps(p)
            mine, waiting = merged.get(learner_id), None if pending is None else pending[p]
            if not publish.due(install, v, known[p], waiting, mine, self.cfg.syncer.max_staleness):
                continue
            if self._per_learner and learner_id is not None:
                target, full = self.core.fragment(p)[1], self.core.held(p)[1]
                kind, obj, base = self._copies.prepare(learner_id, p, v, known[p], target, full)
                out.append((p, v, [ray.put(obj)], merged, kind, base))
                continue
            pub = self._published.get(p)
            if pub is None or pub[0] != v:  # restarted store: publish the restored fragment again
                pub = (v, ray.put(self.core.held(p)[1]), merged, "full")
                self._published[p] = pub
            if pub[3] == "delta" and known[p] != v - 1:  # too far behind for the delta
                full = self._full.get(p)
                if full is None or full[0] != v:  # put once per version, not once per poll
                    full = self._full[p] = (v, ray.put(self.core.held(p)[1]))
                pub = (v, full[1], pub[2], "full")
            out.append((p, pub[0], [pub[1]], pub[2], pub[3], pub[0] - 1))
        return out

    async def summary(self) -> dict:
        return self.core.summary()

    async def drain_events(self) -> list[dict]:
        events, self._events = self._events, []
        return events

    async def ping(self) -> bool:
        return True
