"""Learner processes: how the driver starts one, and warm spares (`learners.spares`) that take a
dead learner's identity in place of a new process.

A spare is a `actors.learner.Learner` built without an id: it loads JAX, maps the corpus and
compiles the train step (`dloco.services.learner.warm_up`), then waits, holding no identity. When
a learner's `run` fails because its process died (killed, preempted, drained after SIGTERM), the
driver has the oldest warm spare `become` that learner: it registers as the next incarnation and
resumes at the learner's merged cursor, so no token is trained twice or skipped. A new spare is
started in its place. With no warm spare, a new process takes the identity, as Ray's restart would
(``spare_takeover`` with ``cold``). In a run with spares, Ray does not restart learners
(``max_restarts=0``): the pool does. Without spares, Ray restarts them as before.

Accounting: a spare's time from its start to its takeover is provisioned learner time (an idle
spare is a provisioned host): ``spare_start`` and ``spare_takeover`` events, `dloco.tally`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import RayError

from actors.learner import Learner
from actors.workers import worker_env
from dloco import events
from dloco.config import RunConfig


def learner_actor(cfg: RunConfig, name: str, learner_id: int | None, namespace: str, corpus: dict) -> Any:
    """Starts a learner process (`learner_id` None: a spare, with the first group's resources).
    Ray restarts it unless the run has spares (then the pool replaces a dead one)."""
    groups = cfg.learners.expand()
    g = groups[0 if learner_id is None else min(learner_id, len(groups) - 1)]
    accelerator = g.num_gpus > 0 or "TPU" in g.resources
    restarts = 0 if cfg.learners.spares else -1
    return (
        ray.remote(Learner)
        .options(
            name=name,
            namespace=namespace,
            max_restarts=restarts,
            max_task_retries=restarts,
            max_concurrency=4,
            num_cpus=g.num_cpus,
            num_gpus=g.num_gpus,
            resources=dict(g.resources) or None,
            # a GPU or TPU learner lets JAX find its accelerator; others stay on the CPU
            runtime_env={"env_vars": worker_env(cfg, accelerator, shared_gpu=0 < g.num_gpus < 1)},
        )
        .remote(cfg.to_dict(), learner_id, "store", "syncer", namespace, corpus)
    )


class SparePool:
    """`count` warm spares, each replaced as soon as it takes over (see the module docstring)."""

    def __init__(self, cfg: RunConfig, namespace: str, corpus: dict, record: Callable[[dict], None]) -> None:
        self.cfg, self.namespace, self.corpus, self.record = cfg, namespace, corpus, record
        self.waiting: list[tuple[int, Any, Any]] = []  # (spare id, actor, its ping: done when warm), oldest first
        self.started = self.cold = 0
        for _ in range(cfg.learners.spares):
            self._start()

    def _start(self) -> None:
        j, self.started = self.started, self.started + 1
        actor = learner_actor(self.cfg, f"spare-{j}", None, self.namespace, self.corpus)
        self.waiting.append((j, actor, actor.ping.remote()))
        self.record(events.SpareStart(time=time.time(), spare=j).to_dict())

    def take_over(self, m: int) -> Any:
        """Learner m's new process: the oldest warm spare, told to `become` m (a new spare is
        started in its place), else a new process; its `run` waits until it holds the identity."""
        for i, (j, actor, warm) in enumerate(self.waiting):
            if not ray.wait([warm], timeout=0)[0]:
                continue
            del self.waiting[i]
            self._start()
            try:
                ray.get(warm)
            except RayError:  # it died warming up (its node went): the next one
                return self.take_over(m)
            actor.become.remote(m)
            self.record(events.SpareTakeover(time=time.time(), spare=j, learner=m).to_dict())
            return actor
        self.record(events.SpareTakeover(time=time.time(), spare=-1, learner=m, cold=True).to_dict())
        self.cold += 1  # a name of its own: the dead process's may not be released yet
        return learner_actor(self.cfg, f"learner-{m}-{self.cold}", m, self.namespace, self.corpus)

    def actors(self) -> list[Any]:
        return [a for _, a, _ in self.waiting]
