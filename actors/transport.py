"""The Ray transport for `dloco.services`: payloads in the object store, peers as named actors.

`RayTransport` puts a payload into the object store (owned by the putting process, so it dies
with it: `PayloadLostError`); `WallClock` is the machine's clock; `StoreHandle` turns a service's
calls on the store into Ray calls it waits for (a restarting store answers once it is back:
every store method is safe to retry); `SyncerHandle` announces a push without waiting, after the
learner group's emulated latency (`learners.groups[].latency_s`) when it has one.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from concurrent.futures import CancelledError, Future
from typing import Any

import ray
from ray.exceptions import RayError

from dloco.services.wire import PayloadLostError


class RayTransport:
    def put(self, obj: Any) -> ray.ObjectRef:
        return ray.put(obj)

    def get(self, ref: ray.ObjectRef) -> Any:
        try:
            return ray.get(ref)
        except RayError as e:  # OwnerDiedError / ObjectLostError: its owner died with it
            raise PayloadLostError(type(e).__name__) from None


class WallClock:
    def now(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()


class StoreHandle:
    """Blocking calls on the store actor (`actors.store.FragmentStore`)."""

    def __init__(self, actor) -> None:
        self.actor = actor

    def __getattr__(self, name: str):
        method = getattr(self.actor, name)
        return lambda *args, **kwargs: ray.get(method.remote(*args, **kwargs))


class SyncerHandle:
    """Pushes to the syncer actor, `latency` seconds late (an emulated WAN link), without waiting
    for the decision: `decisions` hands over those that have come back since it was last called."""

    def __init__(self, actor, latency: float = 0.0) -> None:
        self.actor, self.latency = actor, latency
        self._pending: deque[tuple[Any, Future]] = deque()  # (meta, future of its Decision)
        self._probes: dict[tuple, Future] = {}  # (learner, incarnation, fragment, step) → `holds` asked
        self._lock = threading.Lock()  # pushes are announced from timer threads under latency

    def push(self, meta, ref) -> None:
        if self.latency > 0:
            threading.Timer(self.latency, self._announce, (meta, ref)).start()
        else:
            self._announce(meta, ref)

    def _announce(self, meta, ref) -> None:
        # in a list: the syncer gets the ref, not the payload
        decision = self.actor.push.remote(meta, [ref]).future()  # done: set by Ray, read without a call
        with self._lock:
            self._pending.append((meta, decision))

    def holds(self, meta) -> bool | None:
        """Asks the syncer without waiting: None until its answer has come (ask again), then the
        answer; False if the syncer died meanwhile (a restarted one holds nothing of the old one's)."""
        key = (meta.learner_id, meta.incarnation, meta.fragment_id, meta.step)
        with self._lock:
            for old in [k for k in self._probes if k[:3] == key[:3] and k[3] < key[3]]:
                del self._probes[old]  # asked about an older push, merged meanwhile: never asked again
            fut = self._probes.get(key)
            if fut is None:
                self._probes[key] = self.actor.holds.remote(meta).future()
                return None
            if not fut.done():
                return None
            del self._probes[key]
        try:
            return bool(fut.result())
        except (RayError, CancelledError):
            return False

    def decisions(self) -> list[tuple[Any, Any]]:
        with self._lock:
            done = [x for x in self._pending if x[1].done()]
            if done:
                taken = {id(x) for x in done}
                self._pending = deque(x for x in self._pending if id(x) not in taken)
        out = []
        for meta, fut in done:
            with contextlib.suppress(RayError, CancelledError):  # the syncer restarted meanwhile: as if lost
                out.append((meta, fut.result()))
        return out
