"""`Learner`: the Ray actor around `dloco.learner.LearnerCore` (ALGORITHM.md §4).

A plain class; `actors.launch` wraps it with ``ray.remote(max_restarts=-1, max_task_retries=-1,
max_concurrency=4)`` so that `status` and `stop` run beside the long `run` loop. It owns every
device the actor was given and never waits for anyone (decoupled mode): each step it checks,
without blocking, whether merged fragments have arrived, installs them, trains one batch, and
sends the pushes that fell due as compressed payloads put into the object store.

On (re)start it registers with the store (new incarnation), installs the latest fragments and
resumes its data stream from its merged cursor; the retried `run` call then continues the loop.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import ray
from ray.exceptions import RayError

from dloco import build, inner
from dloco.config import from_dict
from dloco.data import Cursor
from dloco.learner import Delivery, LearnerCore
from dloco.policy import Ema


class Learner:
    def __init__(self, cfg: dict, learner_id: int, store_name: str, syncer_name: str, namespace: str | None = None):
        self.cfg = from_dict(cfg)
        self.learner_id = learner_id
        self.store = ray.get_actor(store_name, namespace=namespace)
        self.syncer = ray.get_actor(syncer_name, namespace=namespace)
        bp = build.blueprint(self.cfg)
        reg = ray.get(self.store.register.remote(learner_id))
        versions, fragments = ray.get(self.store.fragments.remote())
        cursor = Cursor.from_dict(reg.cursor) if reg.cursor else None
        batch = build.learner_batch_size(self.cfg, learner_id)
        stream = build.stream(self.cfg, bp.corpus.load_split("train"), learner_id, cursor, batch)
        self.core = LearnerCore(
            self.cfg,
            learner_id,
            reg.incarnation,
            bp.model,
            inner.make_mesh(),
            bp.plan,
            fragments,
            versions,
            stream,
            reg.step,
        )
        groups = self.cfg.learners.expand()
        self.slowdown = groups[min(learner_id, len(groups) - 1)].slowdown
        self.start_step = reg.step
        self.step_time = Ema(0.9)
        self.loss = Ema(0.9)
        self.pushes = self.installs = self.bytes_out = self.bytes_in = 0
        self.created_at = time.time()
        ctx = ray.get_runtime_context()
        self.node = {
            "node_id": ctx.get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "resources": {k: v for k, v in ctx.get_assigned_resources().items()},
        }
        self._stop = threading.Event()
        self._poll: ray.ObjectRef | None = None

    def run(self, max_steps: int | None = None) -> dict:
        """Trains until `stop()` (or `max_steps` local steps); returns the final status."""
        core = self.core
        while not self._stop.is_set() and (max_steps is None or core.step_count < max_steps):
            self._receive(block=False)
            core.apply_inbox()
            while core.waiting_for() and not self._stop.is_set():  # blocking baselines only
                self._receive(block=True)
                core.apply_inbox()
            t0 = time.perf_counter()
            metrics, pushes = core.step(step_time=self.step_time.value or 0.0)
            if self.slowdown > 1:
                time.sleep((self.slowdown - 1) * (time.perf_counter() - t0))
            if core.step_count > self.start_step + 1:  # the first step of an incarnation compiles
                self.step_time.update(time.perf_counter() - t0)
            self.loss.update(metrics["loss"])
            for push in pushes:
                meta = dataclasses.replace(push.meta, sent_at=time.time())
                self.syncer.push.remote(meta, [ray.put(push.payload)])
                self.pushes += 1
                self.bytes_out += push.nbytes
        return self.status()

    def _receive(self, block: bool) -> None:
        """Installs merged fragments that have arrived; with `block`, waits until some arrive."""
        while True:
            if self._poll is None:
                self._poll = self.store.updates.remote(list(self.core.version))
            ready, _ = ray.wait([self._poll], timeout=None if block else 0)
            if not ready:
                return
            try:
                updates = ray.get(self._poll)
            except RayError:  # the store is restarting; ask again next time
                updates = []
            self._poll = None
            for p, version, ref, included in updates:
                try:
                    values = ray.get(ref[0])
                except RayError:  # published object lost with a restarted store: fetch directly
                    version, values = ray.get(self.store.fragment.remote(p))
                self.core.receive(Delivery(p, version, values, included.get(self.learner_id)))
                self.installs += 1
                self.bytes_in += sum(v.nbytes for v in values.values())
            if updates or not block:
                return
            time.sleep(0.005)

    def status(self) -> dict:
        c = self.core
        return {
            "learner": self.learner_id,
            "incarnation": c.incarnation,
            "step": c.step_count,
            "steps_this_incarnation": c.step_count - self.start_step,
            "tokens": c.step_count * c.tokens_per_step,
            "tokens_this_incarnation": (c.step_count - self.start_step) * c.tokens_per_step,
            "loss": self.loss.value,
            "step_time": self.step_time.value,
            "pushes": self.pushes,
            "installs": self.installs,
            "bytes_out": self.bytes_out,
            "bytes_in": self.bytes_in,
            "versions": list(c.version),
            "created_at": self.created_at,
            "node": self.node,
        }

    def stop(self) -> None:
        self._stop.set()

    def ping(self) -> bool:
        return True
