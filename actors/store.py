"""`FragmentStore`: the Ray actor around `dloco.services.store.StoreService` (ALGORITHM.md §1, §8).

A plain class; `actors.launch` wraps it with ``ray.remote(max_restarts=-1, max_task_retries=-1)``.
Its methods are coroutines, so Ray runs it as an async actor: each call's work (disk writes,
per-learner encoding) runs on a worker thread under the service's lock, and the event loop stays
free for the learners' long polls (`updates`), which wait until a commit mails them something.
On (re)start it rebuilds itself from its run directory (the newest snapshot plus the commit log);
publications are put into Ray's object store by this actor, so they outlive learners and syncer.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from actors import health
from actors.transport import RayTransport, WallClock
from dloco.config import from_dict
from dloco.services.store import StoreService
from dloco.services.wire import Update
from dloco.store import Commit, CommitResult, Registration


class FragmentStore:
    def __init__(self, cfg: dict, run_dir: str, shard: int = 0) -> None:
        self.service = StoreService(
            from_dict(cfg), run_dir, RayTransport(), WallClock(), shard=shard, process_s=health.process_age()
        )
        self.long_poll_s = self.service.cfg.store.long_poll_s
        self._mail: dict[int, asyncio.Event] = {}  # learner → set (and replaced) when mail arrives

    async def register(self, learner_id: int, incarnation: int | None = None, announce: bool = True) -> Registration:
        return await asyncio.to_thread(self.service.register, learner_id, incarnation, announce)

    async def retire(self, learner_id: int) -> None:
        await asyncio.to_thread(self.service.retire, learner_id)

    async def registry(self) -> dict[int, int]:
        return await asyncio.to_thread(self.service.registry)

    async def fragments(self, shadow: bool = False, learner_id: int | None = None) -> tuple[list[int], list[dict]]:
        return await asyncio.to_thread(self.service.fragments, shadow, learner_id)

    async def shadow(self, p: int, learner_id: int | None = None) -> tuple[int, dict, int | None]:
        return await asyncio.to_thread(self.service.shadow, p, learner_id)

    async def syncer_state(self):
        return await asyncio.to_thread(self.service.syncer_state)

    async def commit(self, c: Commit) -> CommitResult:
        result = await asyncio.to_thread(self.service.commit, c)
        for m in list(self._mail):
            if self.service.has_mail(m):
                self._mail.pop(m).set()
        return result

    async def updates(
        self, learner_id: int, incarnation: int, known: list[int], wait_s: float | None = None
    ) -> list[Update]:
        """The learner's mail; with none, waits up to `wait_s` (`store.long_poll_s`) for a commit that brings some."""
        deadline = time.monotonic() + (self.long_poll_s if wait_s is None else wait_s)
        while True:
            out = await asyncio.to_thread(self.service.updates, learner_id, incarnation, known)
            left = deadline - time.monotonic()
            if out or left <= 0:
                return out
            event = self._mail.setdefault(learner_id, asyncio.Event())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), left)

    async def summary(self) -> dict:
        return await asyncio.to_thread(self.service.summary)

    async def drain_events(self) -> list[dict]:
        return await asyncio.to_thread(self.service.drain_events)

    async def ping(self) -> bool:
        return True

    async def memory(self) -> dict[str, int]:
        return health.process_memory()
