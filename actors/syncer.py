"""`Syncer`: the Ray actor around `dloco.services.syncer.SyncerService` (ALGORITHM.md §5).

A threaded actor (`actors.launch` gives it ``max_concurrency``): `push` calls run on Ray's threads
and return at once (the payload stays in the object store, owned by the learner that put it);
one background thread closes the rounds that are due, waking when a push arrives or the next
grace deadline passes. On restart it is rebuilt from the store; pending pushes are soft state.
"""

from __future__ import annotations

import threading

import ray

from actors import health
from actors.transport import RayTransport, StoreHandle, WallClock
from dloco.config import from_dict
from dloco.policy import ContributionMeta, Decision
from dloco.services.syncer import SyncerService


class Syncer:
    def __init__(self, cfg: dict, store_name: str, namespace: str | None = None, shard: int = 0) -> None:
        """The syncer of shard `shard`; `store_name` names that shard's store actor."""
        store = StoreHandle(ray.get_actor(store_name, namespace=namespace))
        self.service = SyncerService(
            from_dict(cfg), store, RayTransport(), WallClock(), shard, process_s=health.process_age()
        )
        self._wake = threading.Event()
        threading.Thread(target=self._loop, name="dloco-syncer-rounds", daemon=True).start()

    def push(self, meta: ContributionMeta, payload: list) -> Decision:
        """Accepts or rejects one contribution; `payload` is ``[ObjectRef]`` (not fetched here)."""
        d = self.service.push(meta, payload[0])
        self._wake.set()
        return d

    def _loop(self) -> None:
        # The merge path compiles beside the rounds, not before them: at a run's start the learners
        # take longer to start than this (their first round then merges at once), but a restarted
        # syncer finds pushes waiting, and warming every fragment first held its first commit back
        # (8.5 s after it was serving, measured in `benchmarks/soak.py --quick`); a round that
        # closes before the warm-up reached its fragment compiles what it needs itself.
        threading.Thread(target=self.service.warm, name="dloco-syncer-warm", daemon=True).start()
        while True:
            self._wake.clear()
            wait = self.service.run_due()
            self._wake.wait(1.0 if wait is None else wait)

    def holds(self, meta: ContributionMeta) -> bool:
        return self.service.holds(meta)

    def status(self) -> dict:
        return self.service.status()

    def drain_events(self) -> list[dict]:
        return self.service.drain_events()

    def ping(self) -> bool:
        return True

    def memory(self) -> dict[str, int]:
        return health.process_memory()
