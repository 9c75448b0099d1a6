"""`Learner`: the Ray actor around `dloco.learner.LearnerCore` (ALGORITHM.md §4).

A plain class; `actors.launch` wraps it with ``ray.remote(max_restarts=-1, max_task_retries=-1,
max_concurrency=4)`` so that `status` and `stop` run beside the long `run` loop. It owns every
device the actor was given and never waits for anyone (decoupled mode): each step it checks,
without blocking, whether merged fragments have arrived, installs them, trains one batch, and
sends the pushes that fell due as compressed payloads put into the object store.

On (re)start it registers with the store (new incarnation), installs the latest fragments and
resumes its data stream from its merged cursor; the retried `run` call then continues the loop.

Chaos (`dloco.chaos`, decided by the config's seed, carried out here because only the learner
can do it): a straggler's step and every step's jitter are slept out after the step; a push drawn
as lost is never sent (blocking algorithms resend it after `chaos.resend_s`, as a transport
would); `freeze(seconds)` keeps the learner alive but silent. Each of these is logged as an event.

Emulated WAN latency (`learners.groups[].latency_s`): a push is put into the object store at once
and announced to the syncer that many seconds later (a timer thread); a merged fragment is fetched
when the store announces it and handed to the learner that many seconds after it arrived.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque

import ray
from ray.exceptions import RayError

from actors.isolation import limit_cpu
from dloco import build, chaos, inner
from dloco.config import from_dict
from dloco.data import Cursor
from dloco.learner import Delivery, LearnerCore
from dloco.metrics import typical_cycle
from dloco.policy import Ema

# A non-blocking poll of the store is a Ray call per step; on an H200 the tiny model's step took
# 3.6 ms bare and 4.8 ms in the actor that polled every step (benchmarks/learner_overhead.py --gpu).
# Polling at most this often keeps the call off most steps and delays a merged fragment's arrival
# by at most this much.
POLL_INTERVAL_S = 0.02


class Learner:
    def __init__(self, cfg: dict, learner_id: int, store_name: str, syncer_name: str, namespace: str | None = None):
        self.cfg = from_dict(cfg)
        self.learner_id = learner_id
        if self.cfg.learners.cpu_limit > 0:  # first, so that the (re)start itself runs on its share
            limit_cpu(f"{namespace or 'default'}-learner-{learner_id}", self.cfg.learners.cpu_limit)
        self.store = ray.get_actor(store_name, namespace=namespace)
        self.syncer = ray.get_actor(syncer_name, namespace=namespace)
        bp = build.blueprint(self.cfg)
        reg = ray.get(self.store.register.remote(learner_id))
        versions, fragments = ray.get(self.store.fragments.remote(held=True, learner_id=learner_id))
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
        group = groups[min(learner_id, len(groups) - 1)]
        self.slowdown, self.latency = group.slowdown, group.latency_s
        self._arriving: deque[tuple[float, Delivery, int]] = deque()  # (hand over at, delivery, bytes)
        self.straggler = learner_id in chaos.stragglers(self.cfg.chaos, self.cfg.learners.count)
        self.busy: deque[float] = deque(maxlen=64)  # per step: seconds of work (step, polls, pushes)
        self.waits: deque[float] = deque(maxlen=64)  # per step: seconds blocked waiting for merges
        self.computes: deque[float] = deque(maxlen=64)  # per step: seconds of the step itself (within busy)
        self._events: list[dict] = []
        self._lost: list[tuple[float, object]] = []  # blocking algorithms: (lost at, push) to resend
        self._frozen_until = 0.0
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
        self._polled_at = 0.0  # when the last poll was sent (monotonic)

    def run(self, max_steps: int | None = None) -> dict:
        """Trains until `stop()` (or `max_steps` local steps); returns the final status."""
        core, last = self.core, None
        while not self._stop.is_set() and (max_steps is None or core.step_count < max_steps):
            frozen = self._wait_while_frozen()
            self._receive(block=False)
            self._hand_over()
            core.apply_inbox()
            w0 = time.perf_counter()
            while core.waiting_for() and not self._stop.is_set():  # blocking algorithms only
                self._resend_lost()
                if self._arriving:  # arrived, still on the (emulated) wire
                    time.sleep(min(max(0.0, self._arriving[0][0] - time.monotonic()), self.cfg.chaos.resend_s))
                    self._hand_over()
                else:
                    self._receive(block=True, timeout=self.cfg.chaos.resend_s)
                core.apply_inbox()
            t0 = time.perf_counter()
            cycle = typical_cycle(self.busy, self.waits)
            metrics, pushes = core.step(step_time=self.step_time.value or 0.0, cycle_time=cycle)
            factor = self.slowdown * chaos.step_factor(self.cfg.chaos, self.learner_id, core.step_count, self.straggler)
            if factor > 1:
                time.sleep((factor - 1) * (time.perf_counter() - t0))
            t1 = time.perf_counter()
            if last is not None and core.step_count > self.start_step + 1:  # the first step compiles
                self.step_time.update(t1 - t0)
                # a step's cycle, end to end, less the freeze: time blocked on merges, and the rest
                self.waits.append(t0 - w0)
                self.busy.append(t1 - last - frozen - (t0 - w0))
                self.computes.append(t1 - t0)
            last = t1
            self.loss.update(metrics["loss"])
            for push in pushes:
                m = push.meta
                if chaos.payload_lost(self.cfg.chaos, m.learner_id, m.incarnation, m.step, m.fragment_id):
                    self._events.append(
                        {
                            "event": "payload_lost",
                            "time": time.time(),
                            "learner": m.learner_id,
                            "fragment": m.fragment_id,
                            "step": m.step,
                            "bytes": push.nbytes,
                        }
                    )
                    if core.blocking:
                        self._lost.append((time.monotonic(), push))
                    continue
                self._send(push)
        return self.status()

    def _send(self, push) -> None:
        ref = ray.put(push.payload)
        self.pushes += 1
        self.bytes_out += push.nbytes
        meta = dataclasses.replace(push.meta, sent_at=time.time())  # push ages include the latency
        if self.latency > 0:
            threading.Timer(self.latency, self._announce, (meta, ref)).start()
        else:
            self._announce(meta, ref)

    def _announce(self, meta, ref) -> None:
        self.syncer.push.remote(meta, [ref])

    def _resend_lost(self) -> None:
        """Blocking algorithms: a lost push is sent again `chaos.resend_s` after it was lost."""
        now, keep = time.monotonic(), []
        for lost_at, push in self._lost:
            if now - lost_at < self.cfg.chaos.resend_s:
                keep.append((lost_at, push))
                continue
            self._events.append(
                {
                    "event": "payload_resent",
                    "time": time.time(),
                    "learner": self.learner_id,
                    "fragment": push.meta.fragment_id,
                    "step": push.meta.step,
                }
            )
            self._send(push)
        self._lost = keep

    def _wait_while_frozen(self) -> float:
        """Sleeps out a freeze; returns how long it slept."""
        t0 = time.perf_counter()
        while time.time() < self._frozen_until and not self._stop.is_set():
            time.sleep(0.02)
        return time.perf_counter() - t0

    def freeze(self, seconds: float) -> None:
        """Chaos: alive but silent (no steps, pushes or polls) for `seconds` from now."""
        self._frozen_until = max(self._frozen_until, time.time() + seconds)

    def _receive(self, block: bool, timeout: float = 1.0) -> None:
        """Installs merged fragments that have arrived; with `block`, waits until some arrive
        (or `timeout` seconds have passed) in a long poll of the store."""
        deadline = time.monotonic() + timeout
        while True:
            if self._poll is None:
                if not block and time.monotonic() - self._polled_at < POLL_INTERVAL_S:
                    return
                self._polled_at = time.monotonic()
                wait_s = max(0.0, deadline - time.monotonic()) if block else 0.0
                self._poll = self.store.updates.remote(
                    self._known(), wait_s, self.learner_id, self.core.pending(d for _, d, _ in self._arriving)
                )
            ready, _ = ray.wait([self._poll], timeout=None if block else 0)
            if not ready:
                return
            try:
                updates = ray.get(self._poll)
            except RayError:  # the store is restarting; ask again next time
                updates = []
                time.sleep(0.05)
            self._poll = None
            for p, version, ref, included, kind, base in updates:
                try:
                    obj = ray.get(ref[0])
                except RayError:  # published object lost with a restarted store: fetch directly
                    version, obj, included = ray.get(self.store.held.remote(p, self.learner_id))
                    kind = "full"
                mine = included.get(self.learner_id)
                if kind == "delta":
                    d = Delivery(p, version, None, mine, delta=obj, base_version=base)
                else:
                    d = Delivery(p, version, obj, mine)
                self._arriving.append((time.monotonic() + self.latency, d, d.nbytes))
            self._hand_over()
            if updates or not block or time.monotonic() >= deadline:
                return

    def _known(self) -> list[int]:
        """Newest version of each fragment this learner has: installed, queued or still in transit
        (so that the store neither sends a version again nor a full fragment instead of a delta)."""
        known = list(self.core.version)
        for d in [*self.core.inbox.values(), *(d for _, d, _ in self._arriving)]:
            known[d.fragment_id] = max(known[d.fragment_id], d.version)
        return known

    def _hand_over(self) -> None:
        """Gives the learner the merged fragments whose (emulated) transfer is over."""
        now = time.monotonic()
        while self._arriving and self._arriving[0][0] <= now:
            _, d, nbytes = self._arriving.popleft()
            if not self.core.receive(d):  # a delta on top of a version it missed: fetch Θ̂_p in full
                version, values, included = ray.get(self.store.held.remote(d.fragment_id, self.learner_id))
                self.core.receive(Delivery(d.fragment_id, version, values, included.get(self.learner_id)))
                nbytes += sum(v.nbytes for v in values.values())
            self.installs += 1
            self.bytes_in += nbytes

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
            "cycle_time": typical_cycle(self.busy, self.waits),
            # the mean step over the same steps as cycle_time's work (≤ it, step by step)
            "compute_time": sum(self.computes) / len(self.computes) if self.computes else None,
            "frozen": time.time() < self._frozen_until,
            "resyncs": c.resyncs,
            "pushes": self.pushes,
            "installs": self.installs,
            "bytes_out": self.bytes_out,
            "bytes_in": self.bytes_in,
            "versions": list(c.version),
            "created_at": self.created_at,
            "node": self.node,
        }

    def drain_events(self) -> list[dict]:
        events, self._events = self._events, []
        return events

    def stop(self) -> None:
        self._stop.set()

    def ping(self) -> bool:
        return True
