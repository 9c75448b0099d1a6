"""Builds a run from one `RunConfig` on a Ray cluster and supervises it: `start(config) -> RunHandle`.

The store, the syncer and one learner per id are named actors in the run's namespace, each with
``max_restarts=-1`` and ``max_task_retries=-1`` (every method is safe to retry: commits are
compare-and-set, registration hands out a new incarnation, `run` resumes from the store). Learners
take their group's resources (``num_cpus``, ``num_gpus``, custom resources such as a region
label). A supervisor thread in the driver drains the actors' events into ``metrics.jsonl``,
evaluates the global model every `metrics.eval_every_s`, and stops the run at its token or time
budget; ``summary.json`` is written at the end.

Chaos (ALGORITHM.md §10): an injector thread in the driver carries out the seeded schedule of
`dloco.chaos.schedule` on the run's wall clock — real kills of learner, syncer and store processes
(Ray restarts them; the downtime is what a restart really costs) and freezes — and logs every
fault as a ``fault`` event with its time, whether it was carried out or skipped and why. Manual
faults (`kill_learner`, `freeze_learner`, ...) are logged the same way with ``source: manual``.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

import ray

from actors import isolation
from actors.learner import Learner
from actors.store import FragmentStore
from actors.syncer import Syncer
from dloco import build, chaos, inner, metrics
from dloco.config import RunConfig
from dloco.tensorboard import TensorBoardSink


def _worker_env(cfg: RunConfig, accelerator: bool, shared_gpu: bool = False) -> dict[str, str]:
    """Environment of an actor's worker process; `accelerator` False pins JAX to the CPU.

    `shared_gpu` (a fractional ``num_gpus``): JAX allocates as it goes instead of taking 75 % of
    the device at start, so that the processes sharing the GPU fit beside each other.
    """
    n = cfg.learners.xla_threads
    env = {
        # XLA's CPU client has no thread-count flag; single-threaded Eigen is the one switch it reads.
        "XLA_FLAGS": f"--xla_cpu_multi_thread_eigen={'true' if n > 1 else 'false'}",
        "OMP_NUM_THREADS": str(n),
        "TF_CPP_MIN_LOG_LEVEL": "3",
        # JAX's persistent compilation cache: a restarted learner recompiles from disk, not scratch.
        "JAX_COMPILATION_CACHE_DIR": str(Path("~/.cache/dloco/jax").expanduser()),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
    if not accelerator:
        env["JAX_PLATFORMS"] = "cpu"
    elif shared_gpu:
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    return env


def _check_reachable(address: str, timeout: float = 5.0) -> None:
    """Fails fast with one line if a ``host:port`` GCS address does not answer (Ray would retry for minutes)."""
    if address == "auto" or "://" in address or ":" not in address:
        return
    host, _, port = address.rpartition(":")
    if host in ("127.0.0.1", "localhost"):
        # a single-machine cluster: keep Ray from rewriting loopback to the host's interface address
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except (OSError, ValueError) as e:
        raise ConnectionError(f"cannot reach the Ray cluster at {address}: {e}") from None


def connect(address: str | None, num_cpus: int | None = None) -> bool:
    """Connects to Ray; returns True if this call started a local cluster (which `stop` shuts down).

    `address` None: a cluster named by RAY_ADDRESS (e.g. inside ``ray job submit``), else a new
    local one listening on 127.0.0.1 only.
    """
    if ray.is_initialized():
        return False
    quiet = {"log_to_driver": False, "logging_level": "ERROR"}
    if address or os.environ.get("RAY_ADDRESS"):
        target = address or os.environ["RAY_ADDRESS"]
        _check_reachable(target)
        try:
            ray.init(address=address or None, **quiet)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise ConnectionError(
                f"cannot reach the Ray cluster at {address or os.environ['RAY_ADDRESS']}: {e}"
            ) from None
        return False
    # Ray binds its servers to all interfaces unless told it is a single-machine cluster: this keeps
    # every server of the local cluster on 127.0.0.1 (checked with `ss -ltn`).
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        object_store_memory=512 * 1024**2,
        _node_ip_address="127.0.0.1",
        **quiet,
    )
    return True


class RunHandle:
    """A running (or finished) run: watch it, change it, stop it. See `start`."""

    def __init__(self, cfg: RunConfig, run_dir: Path, owns_ray: bool, progress=None) -> None:
        self.cfg, self.run_dir, self.owns_ray, self.progress = cfg, run_dir, owns_ray, progress
        self.namespace = f"dloco-{uuid.uuid4().hex[:8]}"
        self.names = {"store": "store", "syncer": "syncer"}
        self.cfg_dict = cfg.to_dict()
        self.started = time.time()
        self.events: list[dict[str, Any]] = []
        self.learners: dict[int, Any] = {}
        self.runs: dict[int, ray.ObjectRef] = {}
        self.status_by: dict[int, dict] = {}
        self.trained: dict[tuple[int, int], int] = {}  # (learner, incarnation) → tokens trained
        self._drains: dict[str, ray.ObjectRef | None] = {}
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._stop_requested = threading.Event()
        self._metrics_file = open(run_dir / "metrics.jsonl", "a")  # noqa: SIM115 - closed in stop()
        bp = build.blueprint(cfg)
        self._tensorboard = TensorBoardSink(run_dir, fragments=bp.plan.count)  # beside metrics.jsonl
        self._bp, self._mesh = bp, inner.make_mesh()
        self._eval = inner.make_eval_step(bp.model, self._mesh)
        self._eval_set = build.eval_set(cfg, bp.corpus)
        self.summary: dict[str, Any] | None = None
        self._down: dict[int, float] = {}  # learner → time of the kill it has not yet come back from
        self.schedule = chaos.schedule(cfg.chaos, cfg.learners.count)

        opts = {
            "namespace": self.namespace,
            "max_restarts": -1,
            "max_task_retries": -1,
            "num_cpus": 0,
            # On the head node, with the driver: the run directory (metrics, store snapshots) is
            # the head's, so a restarted store finds its snapshots without a shared filesystem.
            "resources": {"node:__internal_head__": 0.001},
            "runtime_env": {"env_vars": _worker_env(cfg, accelerator=False)},
        }
        self.store = ray.remote(FragmentStore).options(name="store", **opts).remote(self.cfg_dict, str(run_dir))
        ray.get(self.store.ping.remote())
        # threaded: pushes are accepted on Ray's threads while one thread closes rounds
        self.syncer = (
            ray.remote(Syncer)
            .options(name="syncer", max_concurrency=8, **opts)
            .remote(self.cfg_dict, "store", self.namespace)
        )
        ray.get(self.syncer.ping.remote())
        self.eval_loss_start = self.evaluate()
        self._record({"event": "eval", "time": time.time(), "loss": self.eval_loss_start, "tokens": 0})
        for m in range(cfg.learners.count):
            self._spawn(m)
        self._record(
            {
                "event": "chaos",
                "time": time.time(),
                "seed": cfg.chaos.seed,
                "faults": len(self.schedule),
                "stragglers": sorted(chaos.stragglers(cfg.chaos, cfg.learners.count)),
            }
        )
        self._thread = threading.Thread(target=self._supervise, name="dloco-supervisor", daemon=True)
        self._thread.start()
        self._injector = threading.Thread(target=self._inject, name="dloco-chaos", daemon=True)
        self._injector.start()

    # ---- learners ----------------------------------------------------------------------------
    def _spawn(self, m: int) -> None:
        groups = self.cfg.learners.expand()
        g = groups[min(m, len(groups) - 1)]
        actor = (
            ray.remote(Learner)
            .options(
                name=f"learner-{m}",
                namespace=self.namespace,
                max_restarts=-1,
                max_task_retries=-1,
                max_concurrency=4,
                num_cpus=g.num_cpus,
                num_gpus=g.num_gpus,
                resources=dict(g.resources) or None,
                # a GPU or TPU learner lets JAX find its accelerator; others stay on the CPU
                runtime_env={
                    "env_vars": _worker_env(
                        self.cfg, accelerator=g.num_gpus > 0 or "TPU" in g.resources, shared_gpu=0 < g.num_gpus < 1
                    )
                },
            )
            .remote(self.cfg_dict, m, "store", "syncer", self.namespace)
        )
        self.learners[m] = actor
        self.runs[m] = actor.run.remote(self.cfg.budget.steps or None)

    # ---- faults ------------------------------------------------------------------------------
    def _inject(self) -> None:
        """Carries out the seeded schedule at its times until the run stops."""
        for f in self.schedule:
            if self._stop_requested.wait(max(0.0, self.started + f.at - time.time())) or self._done.is_set():
                return
            self._fault(f.target, f.kind, f.duration, source="schedule", at=f.at)

    def _fault(self, target: str, kind: str, duration: float = 0.0, source: str = "manual", at=None) -> dict:
        e = {"event": "fault", "time": time.time(), "target": target, "kind": kind, "source": source}
        if at is not None:
            e["at"] = at
        if kind == "freeze":
            e["duration"] = duration
        if target.startswith("learner-"):
            m = int(target.split("-")[1])
            if m not in self.learners:
                e["skipped"] = "learner not running"
            elif m in self._down:
                e["skipped"] = "learner still down from an earlier kill"
            elif kind == "kill":
                self._down[m] = e["time"]
                ray.kill(self.learners[m], no_restart=False)
            else:
                self.learners[m].freeze.remote(duration)
        else:
            ray.kill(self.store if target == "store" else self.syncer, no_restart=False)
        self._record(e)
        return e

    def kill_learner(self, m: int) -> None:
        """Kills learner m's process (as a preemption would); Ray restarts it and it rejoins."""
        self._fault(f"learner-{m}", "kill")

    def freeze_learner(self, m: int, seconds: float) -> None:
        """Learner m stays alive but silent (no steps, pushes or polls) for `seconds`."""
        self._fault(f"learner-{m}", "freeze", seconds)

    def kill_store(self) -> None:
        self._fault("store", "kill")

    def kill_syncer(self) -> None:
        self._fault("syncer", "kill")

    def add_learners(self, n: int) -> list[int]:
        """Starts `n` more learners with new ids (each reads its own data shard)."""
        first = max(self.learners) + 1 if self.learners else 0
        if first + n > self.cfg.data.shards:
            raise ValueError(f"data.shards={self.cfg.data.shards} allows learner ids below it; raise data.shards")
        for m in range(first, first + n):
            self._spawn(m)
        return list(range(first, first + n))

    def remove_learner(self, m: int, timeout: float = 60.0) -> None:
        """Stops learner m for good: it finishes its step, leaves the registry and exits."""
        actor = self.learners.pop(m)
        ray.get(actor.stop.remote(), timeout=timeout)
        ray.wait([self.runs.pop(m)], timeout=timeout)
        ray.get(self.store.retire.remote(m), timeout=timeout)
        ray.kill(actor, no_restart=True)

    # ---- watching ----------------------------------------------------------------------------
    def evaluate(self) -> float:
        """Validation loss of the current global model (fragments fetched from the store)."""
        _, frs = ray.get(self.store.fragments.remote())
        params = inner.replicate(self._bp.plan.join(frs), self._mesh)
        return inner.evaluate(self._eval, params, self._eval_set, self._mesh)

    def status(self) -> dict[str, Any]:
        with self._lock:
            learners = dict(self.status_by)
            merges = sum(e["event"] == "merge" for e in self.events)
            rejected = sum(e["event"] == "rejection" for e in self.events)
            evals = [e for e in self.events if e["event"] == "eval"]
        return {
            "elapsed_s": time.time() - self.started,
            "tokens_trained": self.tokens_trained(),
            "budget_tokens": self.cfg.budget.tokens,
            "merges": merges,
            "rejected": rejected,
            "eval_loss": evals[-1]["loss"] if evals else None,
            "learners": learners,
            "done": self._done.is_set(),
        }

    def metrics(self, event: str | None = None) -> list[dict[str, Any]]:
        """All events so far (or those of one kind: merge, eval, rejection, learner_restart, ...)."""
        with self._lock:
            return [dict(e) for e in self.events if event is None or e["event"] == event]

    def tokens_trained(self) -> int:
        return sum(self.trained.values())

    def _record(self, e: dict[str, Any]) -> None:
        e = {**e, "t": e.get("time", time.time()) - self.started}
        if e["event"] in ("learner_start", "learner_restart"):  # killed before its first registration: start
            self._down.pop(e["learner"], None)
        with self._lock:
            self.events.append(e)
            self._metrics_file.write(json.dumps(e, default=str) + "\n")
            self._metrics_file.flush()
            self._tensorboard.write(e)

    def _poll_actors(self) -> None:
        # A drain call is kept until it answers (a restarting actor answers late): dropping it
        # would drop the events it returns.
        for name, actor in (("store", self.store), ("syncer", self.syncer)):
            ref = self._drains.get(name) or actor.drain_events.remote()
            ready, _ = ray.wait([ref], timeout=2.0)
            self._drains[name] = None if ready else ref
            if ready:
                try:
                    for e in ray.get(ref):
                        self._record(e)
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

    def _supervise(self) -> None:
        b, last_eval = self.cfg.budget, time.time()
        try:
            while not self._stop_requested.is_set():
                time.sleep(0.5)
                self._poll_actors()
                if time.time() - last_eval >= self.cfg.metrics.eval_every_s:
                    self._record(
                        {"event": "eval", "time": time.time(), "loss": self.evaluate(), "tokens": self.tokens_trained()}
                    )
                    self._record_goodput(time.time())
                    last_eval = time.time()
                if self.progress:
                    self.progress(self.status())
                elapsed = time.time() - self.started
                if (b.tokens and self.tokens_trained() >= b.tokens) or (b.seconds and elapsed >= b.seconds):
                    break
                if (
                    b.steps
                    and self.runs
                    and not ray.wait(list(self.runs.values()), num_returns=len(self.runs), timeout=0)[1]
                ):
                    break  # every learner reached budget.steps
        finally:
            self._finish()

    def _record_goodput(self, now: float) -> dict[str, float]:
        """Goodput and uptime so far (ALGORITHM.md §8), recorded as a ``goodput`` event.

        Decision: uptime is measured from the first commit, when the model starts advancing, so
        the start-up (Ray, imports, the first compile) is no stall; goodput does count it.
        """
        events, P = self.metrics(), self._bp.plan.count
        commits = metrics.commit_times(events)
        since = min((t for ts in commits.values() for t in ts), default=self.started)
        e = {
            "event": "goodput",
            "time": now,
            "goodput": metrics.goodput(events, now, P),
            "uptime": metrics.uptime(commits, since, now, self.cfg.metrics.stall_threshold_s, P),
        }
        self._record(e)
        return e

    def _finish(self) -> None:
        self._stop_requested.set()  # no scheduled fault after this point
        # The accounting window ends here, when the run is told to stop: waiting below for learners
        # to finish their step (or a restart to finish) is no provisioned training time.
        stop_at = time.time()
        for a in self.learners.values():
            a.stop.remote()
        ray.wait(list(self.runs.values()), num_returns=len(self.runs), timeout=60)
        self._poll_actors()
        time.sleep(0.5)  # let in-flight rounds commit
        self._poll_actors()
        end_loss = self.evaluate()
        end = time.time()
        self._record({"event": "eval", "time": end, "loss": end_loss, "tokens": self.tokens_trained()})
        final = self._record_goodput(stop_at)
        store = ray.get(self.store.summary.remote())
        events = self.metrics()
        per_learner = metrics.learner_time(events, stop_at, self._bp.plan.count)
        merged = sum(v["merged_tokens"] for v in per_learner.values())
        trained = self.tokens_trained()
        statuses = list(self.status_by.values())
        faults = [e for e in events if e["event"] == "fault"]
        kills = metrics.downtimes(events)
        down = [d["downtime_s"] for d in kills if d["downtime_s"] is not None]
        rejoin = [d["rejoin_s"] for d in kills if d["rejoin_s"] is not None]
        self.summary = {
            "algorithm": self.cfg.algorithm,
            "eval_loss_start": self.eval_loss_start,
            "eval_loss_end": end_loss,
            "tokens_trained": trained,
            "tokens_merged": merged,
            "tokens_merged_ratio": merged / trained if trained else 0.0,
            "goodput": final["goodput"],
            "learner_time": per_learner,
            "faults": len([f for f in faults if not f.get("skipped")]),
            "faults_skipped": len([f for f in faults if f.get("skipped")]),
            "downtime_s": sorted(down),  # kill → registered again (restart)
            "rejoin_s": sorted(rejoin),  # kill → first merge of the new incarnation (restart + rejoin)
            "longest_commit_gaps_s": metrics.longest_commit_gaps(events, self.started, stop_at),
            "payloads_lost": sum(e["event"] == "payload_lost" for e in events),
            "uptime": final["uptime"],
            "merges": sum(e["event"] == "merge" for e in events),
            "rejected": sum(e["event"] == "rejection" for e in events),
            "learners": len(self.learners),
            "restarts": sum(e["event"] == "learner_restart" for e in events),
            "bytes_up": sum(s["bytes_out"] for s in statuses),
            "bytes_down": sum(s["bytes_in"] for s in statuses),
            "versions": store["versions"],
            "placement": {m: s.get("node") for m, s in sorted(self.status_by.items())},
            "wall_time_s": end - self.started,
            "run_dir": str(self.run_dir),
            "config": self.cfg_dict,
        }
        (self.run_dir / "summary.json").write_text(json.dumps(self.summary, indent=2, default=str))
        self._done.set()

    # ---- ending ------------------------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> dict[str, Any] | None:
        """Blocks until the run ends at its budget (or `timeout`); returns the summary."""
        self._done.wait(timeout)
        return self.summary

    def stop(self) -> dict[str, Any] | None:
        """Ends the run now: final evaluation, summary.json, actors removed, local Ray stopped."""
        self._stop_requested.set()
        self._thread.join()
        for a in [*self.learners.values(), self.syncer, self.store]:
            ray.kill(a, no_restart=True)
        if self.cfg.learners.cpu_limit > 0:
            time.sleep(1.0)  # let the killed learner processes exit their cgroups
            isolation.release(f"{self.namespace}-learner-")
        self._metrics_file.close()
        self._tensorboard.close()
        if self.owns_ray:
            ray.shutdown()
        return self.summary


def start(
    cfg: RunConfig,
    address: str | None = None,
    run_dir: str | os.PathLike | None = None,
    progress=None,
    resume: bool = False,
) -> RunHandle:
    """Starts the run described by `cfg` on Ray (a new local cluster unless `address`/RAY_ADDRESS).

    `run_dir` defaults to ``{cfg.run_dir}/{date-time}``. A directory that already holds a run is
    continued only with `resume` (the store restores its snapshot and log). Returns at once with a
    `RunHandle`; the run stops by itself at its budget.
    """
    run_dir = Path(run_dir or Path(cfg.run_dir) / time.strftime("%Y%m%d-%H%M%S"))
    if (run_dir / "store").exists() and not resume:
        raise FileExistsError(
            f"run dir {run_dir} already holds a run: pass --resume to continue it, or another --run-dir"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(asdict(cfg), indent=2))
    build.corpus(cfg)  # prepare (and cache) the data once, before any actor starts
    needed = int(sum(g.num_cpus for g in cfg.learners.expand())) + 1
    owns = connect(address, num_cpus=max(needed, os.cpu_count() or 1))
    try:
        return RunHandle(cfg, run_dir, owns, progress)
    except BaseException:
        if owns:
            ray.shutdown()
        raise
