"""`RunHandle`: the driver's side of a Ray run — spawn the actors, watch them, stop at the budget.

The store, the syncer and one learner per id are named actors in the run's namespace, each with
``max_restarts=-1`` and ``max_task_retries=-1`` (every method is safe to retry: commits are
compare-and-set, registration hands out a new incarnation, `run` resumes from the store). Learners
take their group's resources (``num_cpus``, ``num_gpus``, custom resources such as a region
label). A supervisor thread drains the actors' events into ``metrics.jsonl`` (and TensorBoard),
folds them into a `dloco.tally.Tally` (running accounts and a bounded ring of recent events, so
the driver's memory stays flat however long the run), evaluates the global model every
`metrics.eval_every_s` (`actors.evaluator`: on the driver, or an actor with its own resources)
and stops the run at its token, time or step budget (or `dloco stop`: `actors.observe`, which
also writes ``status.json`` and Ray metrics); ``summary.json`` (`dloco.tally.summarize`) is
written at the end. Faults: `actors.faults.FaultInjector`.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors import evaluator, health, isolation, shards, spares
from actors.faults import FaultInjector
from actors.observe import Observer
from actors.workers import CONTROL_PLANE_ENV, worker_env
from dloco import build, chaos, durable, events
from dloco.config import RunConfig
from dloco.result import Result
from dloco.services.shards import names
from dloco.tally import Tally, summarize
from dloco.tensorboard import TensorBoardSink


class RunHandle:
    """A running (or finished) run: watch it, change it, stop it. See `actors.launch.start`."""

    resumed = False  # set by `actors.launch.start`: this run continues the one in its run dir

    def __init__(
        self, cfg: RunConfig, run_dir: Path, owns_ray: bool, progress=None, launched: float | None = None
    ) -> None:
        self.cfg, self.run_dir, self.owns_ray, self.progress = cfg, run_dir, owns_ray, progress
        self.namespace = f"dloco-{uuid.uuid4().hex[:8]}"
        self.cfg_dict = cfg.to_dict()
        self.started = time.time()
        self.launched = self.started if launched is None else launched  # when `start` was called
        bp = build.blueprint(cfg)
        self.tally = Tally(bp.plan.count, cfg.metrics.stall_threshold_s, self.started)
        self.learners: dict[int, Any] = {}
        self.runs: dict[int, ray.ObjectRef] = {}
        self.status_by: dict[int, dict] = {}
        self.trained: dict[tuple[int, int], int] = {}  # (learner, incarnation) → tokens trained
        self._drains: dict[str, ray.ObjectRef | None] = {}
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._stop_requested = threading.Event()
        self._metrics_path = run_dir / "metrics.jsonl"
        # 0600, never through a planted link; closed in stop()
        self._metrics_file = os.fdopen(
            os.open(self._metrics_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600), "a"
        )
        self._tensorboard = TensorBoardSink(run_dir, bp.plan.count, config=self.cfg_dict)  # + W&B, MLflow if set
        self._bp, self.corpus = bp, build.corpus_identity(bp.corpus)
        self._on_driver = None if evaluator.placed(cfg) else evaluator.OnDriver(cfg, bp)
        self.summary: dict[str, Any] | None = None
        self.fatal: str | None = None  # why the run must end early (an unrecoverable error)
        self.auth_mode = health.auth_mode()
        self.faults = FaultInjector(cfg, self.started, self._actors, self._record)
        self.observer = Observer(run_dir.name)

        opts = {
            **{"namespace": self.namespace, "max_restarts": -1, "max_task_retries": -1, "num_cpus": 0},
            # On the driver's node (the head, under a job): a restarted store finds its snapshots in its run dir.
            "scheduling_strategy": NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False),
            "runtime_env": {"env_vars": worker_env(cfg, accelerator=False) | CONTROL_PLANE_ENV},  # store, syncer
        }
        self.evaluator: Any = None
        begun: list = []  # the store and syncer shards (`actors.shards`), as each is created
        try:
            # Every process starts at once: learners import JAX, map the corpus and compile their
            # train step (`actors.learner`) while the store restores and the syncer warms up; a
            # learner registers once both its step is compiled and the store answers.
            self.stores, self.syncers = shards.spawn(cfg, str(run_dir), opts, begun)
            self.store, self.syncer = self.stores[0], self.syncers[0]
            for m in range(cfg.learners.count):
                self._spawn(m)
            if self._on_driver is None:
                self.evaluator = evaluator.spawn(cfg, self.namespace, self.corpus, opts)
            shards.wait_started(cfg, self.stores, self.syncers)
            if self.evaluator is not None:
                health.started(self.evaluator, "evaluator")
            # the initial model (or on a resume the restored one): its fragments are read as soon
            # as the store answers, before a learner can have registered and trained `sync.every` steps
            self.eval_loss_start = self.evaluate()
        except BaseException:
            for a in (*begun, *self.learners.values(), self.evaluator):
                if a is not None:
                    ray.kill(a, no_restart=True)
            self._metrics_file.close()
            self._tensorboard.close()
            raise
        self._record(events.Eval(time=time.time(), loss=self.eval_loss_start, tokens=0).to_dict())
        self.spares = spares.SparePool(cfg, self.namespace, self.corpus, self._record) if cfg.learners.spares else None
        n, stragglers = len(self.faults.schedule), sorted(chaos.stragglers(cfg.chaos, cfg.learners.count))
        self._record(events.Chaos(time=time.time(), seed=cfg.chaos.seed, faults=n, stragglers=stragglers).to_dict())
        self._thread = threading.Thread(target=self._supervise, name="dloco-supervisor", daemon=True)
        self._thread.start()
        self.faults.start()

    def _actors(self) -> dict[str, Any]:
        """By name: ``store``/``syncer`` (shard 0's), and with several shards ``store-{s}``/``syncer-{s}``."""
        n = self.cfg.syncer.shards
        central = zip((*names("store", n), *names("syncer", n)), (*self.stores, *self.syncers), strict=True)
        return {"store": self.store, "syncer": self.syncer, **dict(central), "learners": dict(self.learners)}

    # ---- learners ----------------------------------------------------------------------------
    def _spawn(self, m: int) -> None:
        actor = spares.learner_actor(self.cfg, f"learner-{m}", m, self.namespace, self.corpus)
        self.learners[m] = actor
        self.runs[m] = actor.run.remote(self.cfg.budget.steps or None)

    def kill_learner(self, m: int) -> None:
        """Kills learner m's process (as a preemption would); Ray restarts it and it rejoins."""
        self.faults.fault(f"learner-{m}", "kill")

    def freeze_learner(self, m: int, seconds: float) -> None:
        """Learner m stays alive but silent (no steps, pushes or mail) for `seconds`."""
        self.faults.fault(f"learner-{m}", "freeze", seconds)

    def kill_store(self, shard: int = 0) -> None:  # as a preemption would: Ray restarts it, it restores from its dir
        self.faults.fault(names("store", self.cfg.syncer.shards)[shard], "kill")

    def kill_syncer(self, shard: int = 0) -> None:  # Ray restarts it; it rebuilds from its store
        self.faults.fault(names("syncer", self.cfg.syncer.shards)[shard], "kill")

    def add_learners(self, n: int) -> list[int]:
        """Starts `n` more learners with new ids (each reads its own data shard)."""
        first = max(self.learners) + 1 if self.learners else 0
        if first + n > self.cfg.data.shards:
            raise ValueError(f"data.shards={self.cfg.data.shards} allows learner ids below it; raise data.shards")
        for m in range(first, first + n):
            self._spawn(m)
        return list(range(first, first + n))

    # ---- watching ----------------------------------------------------------------------------
    def params(self, timeout: float | None = 120.0) -> dict:
        """The global model Θ now, the model's tree of float32 arrays (``GetTimeoutError`` if the store does not
        answer within `timeout`, e.g. while it restarts)."""
        return self._bp.plan.join(shards.fragments(self.stores, timeout)[1])

    def evaluate(self, timeout: float | None = 120.0) -> float:
        """Validation loss of the current global model (`actors.evaluator`)."""
        if self._on_driver is not None:
            return self._on_driver(shards.fragments(self.stores, timeout)[1])
        return float(ray.get(self.evaluator.evaluate.remote(), timeout=timeout)["loss"])

    def status(self) -> dict[str, Any]:
        """Counters and the newest evaluation, from the running tally (O(learners))."""
        with self._lock:
            learners = dict(self.status_by)
            merges, rejected = self.tally.counts["merge"], self.tally.counts["rejection"]
            last_eval = self.tally.last.get("eval")
        return {
            "elapsed_s": time.time() - self.started,
            "tokens_trained": self.tokens_trained(),
            "budget_tokens": self.cfg.budget.tokens,
            "merges": merges,
            "rejected": rejected,
            "eval_loss": last_eval["loss"] if last_eval else None,
            "learners": learners,
            "errors": self.tally.error_counts(),
            "last_error": None if self.tally.last_error is None else self.tally.last_error.get("error"),
            "error": self.fatal,
            "done": self._done.is_set(),
        }

    def recent(self, event: str | None = None) -> list[dict[str, Any]]:
        """The newest events the driver keeps in memory (a bounded ring), optionally of one kind."""
        with self._lock:
            return [dict(e) for e in self.tally.recent if event is None or e["event"] == event]

    def metrics(self, event: str | None = None) -> list[dict[str, Any]]:
        """Every event so far (or those of one kind: merge, eval, rejection, learner_restart, ...),
        read back from ``metrics.jsonl``: the driver itself keeps only `recent` ones."""
        with self._lock:
            if not self._metrics_file.closed:  # after stop() the file is complete on disk
                self._metrics_file.flush()
        with open(self._metrics_path) as fh:  # (the string test skips parsing most lines)
            rows = [json.loads(line) for line in fh if event is None or f'"event": "{event}"' in line]
        return [e for e in rows if event is None or e.get("event") == event]

    def tokens_trained(self) -> int:
        return sum(self.trained.values())

    def _record(self, e: dict[str, Any]) -> None:
        e = {**e, "t": (e.get("time") or time.time()) - self.started}
        try:
            events.parse(e)  # one schema per kind (`dloco.events`); a mismatch is a bug, reported
        except ValueError as err:
            print(f"dloco: event does not match its schema: {err}", file=sys.stderr)
        self.faults.observe(e)
        with self._lock:
            self.tally.add(e)
            self._metrics_file.write(json.dumps(e, default=str) + "\n")
            self._metrics_file.flush()
            self._tensorboard.write(e)

    def _poll_actors(self) -> None:
        # A drain call is kept until it answers (a restarting actor answers late): dropping it
        # would drop the events it returns.
        n = self.cfg.syncer.shards
        for name, actor in zip((*names("store", n), *names("syncer", n)), (*self.stores, *self.syncers), strict=True):
            ref = self._drains.get(name) or actor.drain_events.remote()
            ready, _ = ray.wait([ref], timeout=2.0)
            self._drains[name] = None if ready else ref
            if ready:
                try:
                    for e in ray.get(ref):
                        self._record(e)
                except ray.exceptions.ActorDiedError as err:  # dead for good: Ray will not restart it
                    self._failed(name, err)
                except ray.exceptions.RayError:
                    pass  # it died: its events since the last drain died with it
        refs = {m: (a.status.remote(), a.drain_events.remote()) for m, a in list(self.learners.items())}
        flat = [r for pair in refs.values() for r in pair]
        ready, _ = ray.wait(flat, num_returns=len(flat), timeout=2.0)
        for m, (ref, events_ref) in refs.items():
            if events_ref in ready:
                try:
                    for e in ray.get(events_ref):
                        self._record(e)
                except ray.exceptions.RayError:
                    pass  # it died: its events since the last drain died with it
            if ref in ready:
                try:
                    s = ray.get(ref)
                except ray.exceptions.RayError:
                    continue
                with self._lock:
                    self.status_by[m] = s
                    key = (m, s["incarnation"])
                    self.trained[key] = max(self.trained.get(key, 0), s["tokens_this_incarnation"])

    def _failed(self, target: str, err: BaseException) -> None:
        """An actor failed for good: recorded; the store or syncer failing (or every learner) ends the run."""
        msg = health.one_line(err)
        self._record(events.ActorError(time=time.time(), target=target, error=msg).to_dict())
        if not target.startswith("learner-"):
            self.fatal = self.fatal or f"the {target} failed and cannot restart: {msg}"

    def _check_health(self) -> None:
        """Learners whose `run` failed for good; every learner gone; commits failing for too long."""
        for m, err in health.failed_runs(self.runs):
            del self.runs[m]
            if self.spares is not None and m in self.tally.learner_time(0.0) and not self._stop_requested.is_set():
                self.learners[m] = self.spares.take_over(m)  # it ran, and its process died: a spare takes over
                self.runs[m] = self.learners[m].run.remote(self.cfg.budget.steps or None)
                continue
            self._failed(f"learner-{m}", err)
        self.fatal = self.fatal or health.fatal(self.tally, self.cfg, time.time(), learners_left=bool(self.runs))

    def _supervise(self) -> None:
        b, last_eval = self.cfg.budget, time.time()
        try:
            while not self._stop_requested.is_set():
                time.sleep(0.5)
                self._poll_actors()
                self._check_health()
                if self.fatal:
                    break
                if time.time() - last_eval >= self.cfg.metrics.eval_every_s:
                    last_eval = time.time()
                    try:
                        loss = self.evaluate(timeout=max(10.0, self.cfg.metrics.eval_every_s))
                    except ray.exceptions.ActorDiedError as e:  # the evaluator, or the store it reads
                        self._failed("store" if self.evaluator is None else "evaluator", e)
                        break
                    except ray.exceptions.RayError:
                        continue  # the store is restarting (or slow): evaluate at the next tick
                    self._record(events.Eval(time=time.time(), loss=loss, tokens=self.tokens_trained()).to_dict())
                    self._record_goodput(time.time())
                if self.progress:
                    self.progress(self.status())
                if self.observer.tick(self):  # status.json and Ray metrics, every 2 s; True: `dloco stop`
                    break
                # budget.seconds counts training: from the first learner's registration, so a short
                # budget is not spent on start-up (`startup_s` in the summary says what that took)
                first = self.tally.first_start
                elapsed = 0.0 if first is None else time.time() - first
                if (b.tokens and self.tokens_trained() >= b.tokens) or (b.seconds and elapsed >= b.seconds):
                    break
                if (
                    b.steps
                    and self.runs
                    and not ray.wait(list(self.runs.values()), num_returns=len(self.runs), timeout=0)[1]
                ):
                    break  # every learner reached budget.steps
        except Exception as e:  # a bug or an unexpected Ray error: end the run, never hang
            self.fatal = self.fatal or f"supervisor: {health.one_line(e)}"
        finally:
            self._finish()

    def _record_goodput(self, now: float) -> dict[str, Any]:
        """Goodput and uptime so far (ALGORITHM.md §8), recorded as a ``goodput`` event.

        Decision: uptime is measured from the first commit, when the model starts advancing, so
        the start-up (Ray, imports, the first compile) is no stall; goodput does count it.
        """
        with self._lock:
            e = events.Goodput(time=now, goodput=self.tally.goodput(now), uptime=self.tally.uptime(now)).to_dict()
        self._record(e)
        return e

    def _finish(self) -> None:
        """Stops learners, evaluates, writes ``summary.json``; whatever fails, `wait` returns."""
        try:
            self._wind_down()
        except Exception as e:
            self.fatal = self.fatal or f"ending the run: {health.one_line(e)}"
        finally:
            if self.summary is None:
                self.summary = {"error": self.fatal, "run_dir": str(self.run_dir), "config": self.cfg_dict}
            self._done.set()

    def _drain_rounds(self, quiet_s: float = 0.5, bound_s: float = 15.0) -> None:
        """Waits until no shard has a round that commits without another push (`SyncerCore.busy`) for
        `quiet_s`, at most `bound_s`: the learners' last pushes are merged before the end evaluation."""
        deadline, quiet_since = time.time() + bound_s, time.time()
        while time.time() < deadline and time.time() - quiet_since < quiet_s:
            try:
                if any(s["busy"] for s in ray.get([s.status.remote() for s in self.syncers], timeout=5.0)):
                    quiet_since = time.time()
            except ray.exceptions.RayError:
                return  # a syncer that does not answer is reported by `_poll_actors`
            time.sleep(0.05)

    def _wind_down(self) -> None:
        self._stop_requested.set()
        self.faults.stop()  # no scheduled fault after this point
        # The accounting window ends here, when the run is told to stop: waiting below for learners
        # to finish their step (or a restart to finish) is no provisioned training time.
        stop_at = time.time()
        for a in self.learners.values():
            a.stop.remote()
        ray.wait(list(self.runs.values()), num_returns=len(self.runs), timeout=60)
        self._check_health()  # a learner that failed as the run ended (e.g. refused its corpus) is reported too
        self._poll_actors()
        self._drain_rounds()
        self._poll_actors()
        end_loss: float | None = None
        try:
            end_loss = self.evaluate(timeout=60.0)
        except ray.exceptions.RayError as e:
            self._record(events.ActorError(time=time.time(), target="store", error=health.one_line(e)).to_dict())
        end = time.time()
        if end_loss is not None:
            self._record(events.Eval(time=end, loss=end_loss, tokens=self.tokens_trained()).to_dict())
        self._record_goodput(stop_at)
        try:
            store = shards.summary(self.stores, timeout=60.0)
        except ray.exceptions.RayError:
            store = {"versions": None}
        if self.fatal:
            self._record(events.RunFailed(time=time.time(), error=self.fatal).to_dict())
        with self._lock:
            self.summary = summarize(
                self.tally,
                config=self.cfg_dict,
                stop_at=stop_at,
                end=end,
                eval_loss_start=self.eval_loss_start,
                eval_loss_end=end_loss,
                tokens_trained=self.tokens_trained(),
                statuses=dict(self.status_by),
                store=store,
                learners=len(self.learners),
                run_dir=str(self.run_dir),
                error=self.fatal,
                auth_mode=self.auth_mode,
                launched=self.launched,
            )
        durable.replace_bytes(self.run_dir / "summary.json", json.dumps(self.summary, indent=2, default=str).encode())
        self._done.set()

    # ---- ending ------------------------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> Result | None:
        """Blocks until the run ends (at its budget, by `dloco stop` or an error) or `timeout` passes;
        returns its `dloco.result.Result` (the summary as ``metrics``, the run dir as ``path``, its
        newest checkpoint as ``checkpoint``, the failure as ``error``), or None if it is still running.
        The same as ``Result.from_path(run_dir)`` reads back; the summary itself stays in ``summary``."""
        if not self._done.wait(timeout) or self.summary is None:
            return None
        return Result.ended(self.run_dir, self.summary)

    def stop(self) -> dict[str, Any] | None:
        """Ends the run now: final evaluation, summary.json, actors removed, local Ray stopped."""
        self._stop_requested.set()
        self._thread.join()
        for a in [
            *self.learners.values(),
            *(self.spares.actors() if self.spares else ()),
            self.evaluator,
            *self.syncers,
            *self.stores,
        ]:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(a, no_restart=True)
        if self.cfg.learners.cpu_limit > 0:
            time.sleep(1.0)  # let the killed learner processes exit their cgroups
            isolation.release(f"{self.namespace}-")  # learners and spares
        self._metrics_file.close()
        self._tensorboard.close()
        if self.owns_ray:
            ray.shutdown()
        return self.summary

    def __enter__(self) -> RunHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        """``with start(cfg) as run:`` stops the run (actors, a local Ray) however the block ends."""
        self.stop()
