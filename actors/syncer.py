"""`Syncer`: the async Ray actor around `dloco.syncer.SyncerCore` (ALGORITHM.md §5).

Pushes arrive as ``push(meta, [payload_ref])``: the payload stays in the object store, owned by
the learner that put it, until the round closes. One background task closes rounds when
`SyncerCore.ready` says so: fetch the payloads (a payload lost with its dead owner counts as a
missing contribution), merge in a worker thread (the event loop keeps accepting pushes), commit
to the store, and record the events. On restart it rebuilds Θ_p, s_p, v_p and the registry from
the store; pending pushes are soft state that the learners' next pushes replace.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import traceback

import ray
from ray.exceptions import RayError

from dloco import build
from dloco.config import from_dict
from dloco.policy import ContributionMeta
from dloco.syncer import SyncerCore


class Syncer:
    def __init__(self, cfg: dict, store_name: str, namespace: str | None = None) -> None:
        self.cfg = from_dict(cfg)
        self.store = ray.get_actor(store_name, namespace=namespace)
        bp = build.blueprint(self.cfg)
        frs, registry, held = ray.get(self.store.syncer_state.remote())
        self.core = SyncerCore(self.cfg, bp.plan, bp.embedding, frs, registry, held)
        self._events: list[dict] = [{"event": "syncer_start", "time": time.time(), "versions": list(self.core.version)}]
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    async def push(self, meta: ContributionMeta, payload: list) -> tuple[bool, str]:
        """Accepts or rejects one contribution; `payload` is ``[ObjectRef]`` (not fetched here)."""
        self._ensure_loop()
        if self.core.registry.get(meta.learner_id) != meta.incarnation:
            self.core.update_registry(await self.store.registry.remote())  # a (re)started learner
        d = self.core.push(meta, payload[0], time.monotonic())
        if not d.accept:
            self._events.append(
                {
                    "event": "rejection",
                    "time": time.time(),
                    "fragment": meta.fragment_id,
                    "learner": meta.learner_id,
                    "incarnation": meta.incarnation,
                    "step": meta.step,
                    "base_version": meta.base_version,
                    "reason": d.reason,
                }
            )
        self._wake.set()
        return d.accept, d.reason

    def _ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            try:
                due, wait = self.core.ready(time.monotonic(), live_learners=len(self.core.registry))
                for p in due:
                    await self._close(p)
            except Exception as e:  # a failed round is reported and its fragment retried next time
                self._events.append(
                    {
                        "event": "syncer_error",
                        "time": time.time(),
                        "error": repr(e),
                        "trace": traceback.format_exc(limit=5),
                    }
                )
                due, wait = [], 0.1
            if due:
                continue
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=wait if wait is not None else 1.0)

    async def _close(self, p: int) -> None:
        t0 = time.monotonic()
        items, grace_used = self.core.take(p, t0)
        pairs, lost = [], {}
        for meta, ref in items:
            try:
                pairs.append((meta, await ref))
            except RayError as e:  # OwnerDiedError / ObjectLostError: the learner died
                pairs.append((meta, None))
                lost[(meta.learner_id, meta.step)] = f"payload lost: {type(e).__name__}"
        outcome = await asyncio.to_thread(
            self.core.merge, p, pairs, grace_used=grace_used, lost=lambda m: lost[(m.learner_id, m.step)]
        )
        now = time.time()
        self._events.extend({**r, "time": now} for r in outcome.rejections)
        if outcome.commit is None:
            return
        result = await self.store.commit.remote(outcome.commit)
        if result.accepted:
            self.core.committed(outcome, time.monotonic() - t0)
            ages = [round(now - m.sent_at, 3) for m, _ in items if m.learner_id in outcome.event["contributors"]]
            self._events.append(
                {**outcome.event, "time": time.time(), "sync_s": time.monotonic() - t0, "push_age_s": ages}
            )
        else:  # the store moved on (e.g. restored): adopt its state, the round's work is dropped
            frs, _, held = await self.store.syncer_state.remote()
            version, values, state = frs[p]
            self.core.reload(p, version, values, state, held[p])
            self._events.append({"event": "commit_rejected", "time": now, "fragment": p, "reason": result.reason})

    async def status(self) -> dict:
        return {
            "versions": list(self.core.version),
            "pending": [len(r.pending) for r in self.core.rounds],
            "grace_s": self.core.grace(),
            "slack_s": self.core.slack(),
        }

    async def drain_events(self) -> list[dict]:
        events, self._events = self._events, []
        return events

    async def ping(self) -> bool:
        self._ensure_loop()
        return True
