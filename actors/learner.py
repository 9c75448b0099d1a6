"""`Learner`: the Ray actor around `dloco.services.learner.LearnerService` (ALGORITHM.md §4).

A plain class; `actors.launch` wraps it with ``ray.remote(max_restarts=-1, max_task_retries=-1,
max_concurrency=4)`` so that `status` and `stop` run beside the long `run` loop. It owns every
device the actor was given and never waits for anyone (decoupled mode): each step it looks,
without blocking, whether its long poll of the store has returned mail (`FragmentStore.updates`,
one call outstanding at a time, answered when a commit names this learner), installs what
arrived, trains one batch and sends the pushes that fell due. Blocking algorithms wait on that
same poll for their merge, resending a push not merged after `chaos.resend_s`.

On (re)start the service registers with the store (new incarnation), installs the latest
fragments and resumes its data stream from its merged cursor; the retried `run` call continues.

What only a process can do is done here: a straggler's step and every step's jitter are slept out
after the step; `freeze(seconds)` keeps the learner alive but silent; emulated WAN latency
(`learners.groups[].latency_s`) delays each push's announcement and hands each update over that
many seconds after it arrived.

Preemption notice: SIGTERM (an OS shutdown's or Kubernetes' notice before a node goes) makes `run` push
the learner's unmerged progress at once (`LearnerService.drain`), wait up to `learners.drain_s`
for those pushes to merge, record a ``learner_drain`` event and then end the process as the signal
asked; Ray restarts the actor (on another node if this one goes) and it resumes from its merged
cursor, so the drained steps are not trained twice.

Spares (`learners.spares`): a `Learner` built without an id warms up and waits; when a learner's
process dies the driver has a spare `become` it (`actors.spares`), which takes seconds less than
a new process: no JAX import, no tokenizing, no compile.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections import deque
from concurrent.futures import CancelledError, Future
from typing import NoReturn

import ray
from ray.exceptions import RayError

from actors import shards
from actors.isolation import limit_cpu
from actors.transport import RayTransport, WallClock
from dloco import events, inner
from dloco.build import Blueprint
from dloco.config import from_dict
from dloco.metrics import typical_cycle
from dloco.policy import Ema
from dloco.services.learner import LearnerService, warm_up
from dloco.services.shards import owner as fragment_owner
from dloco.services.wire import Update


class Learner:
    """Learner `learner_id`; with None, a spare (`learners.spares`): it warms up (`warm_up`: JAX
    loaded, corpus mapped, train step compiled) and waits, holding no identity, until the driver
    has it `become` a learner whose process died."""

    def __init__(
        self,
        cfg: dict,
        learner_id: int | None,
        store_name: str,
        syncer_name: str,
        namespace: str | None = None,
        expect=None,
    ):
        self.cfg, self.learner_id = from_dict(cfg), -1
        self._where = (syncer_name, namespace, expect)
        self.stores = shards.actors(self.cfg, store_name, namespace)  # one per shard (`syncer.shards`)
        self.mesh = inner.make_mesh()
        self.warm: Blueprint | None = None  # a spare's, until it becomes a learner
        self.busy: deque[float] = deque(maxlen=64)  # per step: seconds of work (step, installs, pushes)
        self.waits: deque[float] = deque(maxlen=64)  # per step: seconds blocked waiting for merges
        self.computes: deque[float] = deque(maxlen=64)  # per step: seconds of the step itself (within busy)
        self._frozen_until = 0.0
        self.step_time = Ema(0.9)
        self.loss = Ema(0.9)
        ctx = ray.get_runtime_context()
        self.node = {
            "node_id": ctx.get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "resources": {k: v for k, v in ctx.get_assigned_resources().items()},
        }
        self._stop = threading.Event()
        self._ready = threading.Event()  # set once it holds an identity (at once, unless a spare)
        self._polls: dict[int, tuple[ray.ObjectRef, Future]] = {}  # shard → its store's long poll
        self._fetching: dict[int, ray.ObjectRef] = {}  # fragment → a catch-up fetch in flight
        self._notice: float | None = None  # when SIGTERM came (monotonic)
        self._running = False
        if threading.current_thread() is threading.main_thread():  # where Ray runs a constructor
            signal.signal(signal.SIGTERM, self._sigterm)
        if learner_id is not None and ctx.was_current_actor_reconstructed:
            self._become(learner_id)  # the store is up: register at once, compile (from the cache) on the first step
            return
        if self.cfg.learners.cpu_limit > 0:  # first, so that the warm-up runs on its share
            who = f"spare-{os.getpid()}" if learner_id is None else f"learner-{learner_id}"
            limit_cpu(f"{namespace or 'default'}-{who}", self.cfg.learners.cpu_limit)
        # a spare, or a learner at the run's start: compile while the store and syncer start
        self.warm = warm_up(self.cfg, self.mesh, expect, learner_id)
        if learner_id is not None:
            self._become(learner_id)

    def become(self, learner_id: int) -> int:
        """This spare takes learner `learner_id`'s identity: it registers (a new incarnation) and
        resumes at that learner's merged cursor, so no token is trained twice or skipped; returns
        the incarnation. The driver then calls `run`."""
        self._become(learner_id)
        return self.service.incarnation

    def _become(self, learner_id: int) -> None:
        syncer_name, namespace, expect = self._where
        self.learner_id = learner_id
        if self.cfg.learners.cpu_limit > 0:  # first, so that the (re)start itself runs on its share
            limit_cpu(f"{namespace or 'default'}-learner-{learner_id}", self.cfg.learners.cpu_limit)
        groups = self.cfg.learners.expand()
        self.latency = groups[min(learner_id, len(groups) - 1)].latency_s
        store, syncer = shards.handles(
            self.cfg, self.stores, shards.actors(self.cfg, syncer_name, namespace), self.latency
        )
        while True:
            try:
                self.service = LearnerService(
                    self.cfg, learner_id, store, syncer, RayTransport(), WallClock(), self.mesh, expect, self.warm
                )
                break
            except OSError:  # the store cannot record the registration (disk full, read-only): the
                time.sleep(2.0)  # driver sees its store_error; waiting here beats dying for good
        self._arriving: deque[tuple[float, Update]] = deque()  # (hand over at, update)
        self.service.in_transit = lambda: [u for _, u in self._arriving]  # held, not yet handed over
        self.created_at = time.time()
        self._ready.set()

    def _sigterm(self, signum, frame) -> None:
        """SIGTERM: `run` drains, then ends the process; it ends at once if no `run` is going, on a
        second SIGTERM, or `learners.drain_s` + 5 s after the first, whatever else happens."""
        if self._notice is None and self._running:
            self._notice = time.monotonic()
            threading.Timer(self.cfg.learners.drain_s + 5.0, self._exit).start()
            return
        self._exit()

    @staticmethod
    def _exit() -> NoReturn:
        """Ends the process as a preemption would: Ray sees the worker die, restarts the actor and
        retries its `run`. (Ray's own SIGTERM handler raises SystemExit in the main thread, which
        does not end a threaded actor's process: measured with Ray 2.60.)"""
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(1)

    def _drain(self) -> None:
        """Pushes the unmerged progress, waits (taking mail) until it merged or `drain_s` passed,
        records it, deregisters (`FragmentStore.retire`) and ends the process (`_exit`); never
        returns, so the `run` call fails with the process and the restarted actor retries it."""
        assert self._notice is not None
        svc, deadline, pushed = self.service, self._notice + self.cfg.learners.drain_s, 0
        while time.monotonic() < deadline:
            svc.ready()  # installs the merges that arrived: a fragment merged up to an earlier push ...
            pushed += svc.drain()  # ... pushes the rest now
            if svc.drained():
                break
            self._check_mail(block=True, timeout=min(0.5, max(0.01, deadline - time.monotonic())))
        svc.events.append(
            events.LearnerDrain(
                time=time.time(),
                learner=self.learner_id,
                incarnation=svc.incarnation,
                step=svc.core.step_count,
                pushed=pushed,
                merged=svc.drained(),
                seconds=time.monotonic() - self._notice,
            ).to_dict()
        )
        with contextlib.suppress(RayError):  # deregistered: no mail, no share of the merges (until it registers again)
            ray.get([a.retire.remote(self.learner_id) for a in self.stores], timeout=5.0)
        t = time.monotonic()
        while svc.events and time.monotonic() - t < 5.0:  # the driver takes them (`drain_events`) before the end
            time.sleep(0.05)
        self._exit()

    def run(self, max_steps: int | None = None) -> dict:
        """Trains until `stop()` (or `max_steps` local steps); returns the final status. A spare's
        `run` sent with its `become` waits for the identity (Ray may run the two calls side by side)."""
        self._ready.wait()
        svc, last = self.service, None
        core = svc.core
        self._running = True
        while not self._stop.is_set() and (max_steps is None or core.step_count < max_steps):
            if self._notice is not None:
                self._drain()
            frozen = self._wait_while_frozen()
            self._check_mail(block=False)
            self._catch_up()
            w0 = time.perf_counter()
            while not svc.ready() and not self._stop.is_set():  # blocking algorithms only
                nxt = svc.resend_due()
                timeout = self.cfg.chaos.resend_s if nxt is None else max(0.01, nxt - time.monotonic())
                if self._arriving:  # arrived, still on the (emulated) wire
                    time.sleep(min(max(0.0, self._arriving[0][0] - time.monotonic()), timeout))
                    self._hand_over()
                else:
                    self._check_mail(block=True, timeout=timeout)
            t0 = time.perf_counter()
            metrics = svc.step(step_time=self.step_time.value or 0.0, cycle_time=typical_cycle(self.busy, self.waits))
            factor = svc.step_factor()
            if factor > 1:
                time.sleep((factor - 1) * (time.perf_counter() - t0))
            t1 = time.perf_counter()
            if last is not None and core.step_count > svc.start_step + 1:  # the first step compiles
                self.step_time.update(t1 - t0)
                # a step's cycle, end to end, less the freeze: time blocked on merges, and the rest
                self.waits.append(t0 - w0)
                self.busy.append(t1 - last - frozen - (t0 - w0))
                self.computes.append(t1 - t0)
            last = t1
            self.loss.update(metrics["loss"])
        return self.status()

    def _check_mail(self, block: bool, timeout: float = 1.0) -> None:
        """Takes the long polls' answers that have come (with `block`, waits up to `timeout` for
        one) and sends the next polls; hands over the updates whose emulated transfer is over.
        Whether a poll has answered is its future's flag, which Ray sets: no Ray call per step."""
        polls = {s: self._polls.get(s) or self._send_poll(s) for s in range(len(self.stores))}
        if block and not any(f.done() for _, f in polls.values()):
            ray.wait([r for r, _ in polls.values()], timeout=timeout)
        for s, (_, fut) in polls.items():
            if not fut.done():
                continue
            try:
                updates = fut.result()
                del self._polls[s]
            except (RayError, CancelledError):  # the store restarted: ask the new one at once (a session from `known`)
                updates = []
                self._send_poll(s)
            now = time.monotonic()
            self._arriving.extend((now + self.latency, u) for u in updates)
        self._hand_over()

    def _send_poll(self, s: int) -> tuple[ray.ObjectRef, Future]:
        known = self.service.known()  # (with what arrived and waits out its emulated latency)
        ref = self.stores[s].updates.remote(self.learner_id, self.service.incarnation, known)
        self._polls[s] = (ref, ref.future())
        return self._polls[s]

    def _catch_up(self) -> None:
        """Fetches, without waiting, each fragment the syncer said this learner is too far behind
        on (`LearnerService.catch_up_due`); its pushes of it are held until the fetch arrives."""
        due = self.service.catch_up_due() if self.service.behind else []
        for p in due:
            if p not in self._fetching:
                owner = self.stores[fragment_owner(p, len(self.stores))]
                self._fetching[p] = owner.shadow.remote(p, self.learner_id)
        for p, ref in list(self._fetching.items()):
            if ray.wait([ref], timeout=0)[0]:
                del self._fetching[p]
                with contextlib.suppress(RayError):  # the store restarted: asked again next step if still due
                    self.service.install_full(p, ray.get(ref))

    def _hand_over(self) -> None:
        now, due = time.monotonic(), []
        while self._arriving and self._arriving[0][0] <= now:
            due.append(self._arriving.popleft()[1])
        if due:
            self.service.receive(due)

    def _wait_while_frozen(self) -> float:
        """Sleeps out a freeze; returns how long it slept."""
        t0 = time.perf_counter()
        while time.time() < self._frozen_until and not self._stop.is_set():
            time.sleep(0.02)
        return time.perf_counter() - t0

    def freeze(self, seconds: float) -> None:
        """Chaos: alive but silent (no steps, pushes or mail) for `seconds` from now."""
        self._frozen_until = max(self._frozen_until, time.time() + seconds)

    def status(self) -> dict:
        return {
            **self.service.status(),
            "loss": self.loss.value,
            "step_time": self.step_time.value,
            "cycle_time": typical_cycle(self.busy, self.waits),
            # the mean step over the same steps as cycle_time's work (≤ it, step by step)
            "compute_time": sum(self.computes) / len(self.computes) if self.computes else None,
            "frozen": time.time() < self._frozen_until,
            "created_at": self.created_at,
            "node": self.node,
        }

    def drain_events(self) -> list[dict]:
        return self.service.drain_events() if self._ready.is_set() else []

    def stop(self) -> None:
        self._stop.set()

    def ping(self) -> bool:
        return True
