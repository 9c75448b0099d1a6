"""Test environment: JAX on CPU with two virtual devices, few threads, no Ray started here."""

import dataclasses
import os
import signal
import subprocess
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a local Ray listens on 127.0.0.1 only

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from dloco import build, compress, config, defence  # noqa: E402
from dloco.policy import ContributionMeta  # noqa: E402
from dloco.services.store import StoreService  # noqa: E402
from dloco.services.syncer import SyncerService  # noqa: E402
from dloco.sim import SimTransport, VirtualClock  # noqa: E402

# The `micro` preset (a 21k-parameter model on 400 kB of the stdlib corpus) compiles in about a
# second, so that tests of runs (in-process, Ray, CLI) spend their time on the system under test.
TINY_RUN = (
    "preset=micro",
    "sync.every=8",
    "fragments.count=2",
    "sync.overlap=1",
)


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    """One tokenized-corpus cache for the whole session."""
    return str(tmp_path_factory.mktemp("data-cache"))


@pytest.fixture(scope="session")
def tiny_run(data_cache):
    """Dotted overrides for a tiny, fast run using the session's data cache."""
    return (*TINY_RUN, f"data.cache_dir={data_cache}")


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster for one test module (4 CPUs, an ``evaluator`` resource, two region
    resources for store/syncer shards, 512 MiB object store, loopback only)."""
    import ray

    ray.init(
        address="local",
        num_cpus=4,
        resources={"evaluator": 1, "region_a": 1, "region_b": 1},
        include_dashboard=False,
        object_store_memory=512 * 1024**2,
        log_to_driver=False,
    )
    yield
    ray.shutdown()


def decoupled_micro(data_cache, *overrides):
    """The config of a small decoupled run in two fragments (micro preset, 2 learners, H = 4, τ = 1)
    for in-process runs (`dloco.sim`) of what the store does with its commits."""
    base = ("preset=micro", f"data.cache_dir={data_cache}", "learners.count=2", "algorithm=decoupled")
    return config.load(None, [*base, "sync.every=4", "sync.overlap=1", "fragments.count=2", *overrides])


@pytest.fixture(scope="session")
def store_run(tmp_path_factory, data_cache):
    """One in-process decoupled micro run (`decoupled_micro`: int4 pushes and published deltas,
    Delayed Nesterov; its store logging steps, a checkpoint every third commit, the newest two kept)
    for the tests of what the store leaves on disk (`test_commitlog`, `test_checkpoints`), which
    read it and never change it. Returns the config, the run directory, the fragments' final state
    read from the live store, and per checkpoint taken: (versions, a copy of the cut)."""
    from dloco import preflight
    from dloco.checkpoints import Checkpointer
    from dloco.sim import Sim

    run_dir = tmp_path_factory.mktemp("store-run") / "run"
    cfg = decoupled_micro(
        data_cache, "outer.momentum=0.9", "store.snapshot_every=100", "export.every_commits=3", "export.keep=2"
    )
    preflight.record(preflight.check(cfg, run_dir), cfg)
    taken: dict[int, tuple[list[int], dict[str, np.ndarray]]] = {}
    real = Checkpointer.take

    def take(self, commits, versions, values):
        started = real(self, commits, versions, values)
        if started:  # a copy of what the store held at that commit
            taken[commits] = (list(versions), {n: np.array(x) for v in values for n, x in v.items()})
        return started

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Checkpointer, "take", take)
        sim = Sim.start(cfg, run_dir, step_times=[1.0, 1.3])
        sim.run(24)
        final = [dataclasses.replace(f) for f in sim.store_service.core.fragments]
        sim.store_service.close()  # waits for the checkpoint being written
    return cfg, run_dir, final, taken


def wait_for(pred, timeout=120.0, every=0.25, fail=True):
    """Polls `pred` until it returns something truthy (returned) or `timeout` seconds pass (fails,
    or with ``fail=False`` returns the last falsy value, for a caller that explains the failure)."""
    end = time.time() + timeout
    value = None
    while time.time() < end:
        value = pred()
        if value:
            return value
        time.sleep(every)
    if fail:
        raise AssertionError(f"condition not met within {timeout} s")
    return value


def run_privileged_script(cmd, cwd, timeout, drop_env=("RAY_ADDRESS",)):
    """Runs a script that builds network namespaces (exit 77: skip); returns (returncode, output).

    On timeout it sends SIGTERM first, so the script's own cleanup stops its Ray nodes and deletes
    its namespaces, then SIGKILL, and fails the test."""
    env = {k: v for k, v in os.environ.items() if k not in drop_env}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        pytest.fail(f"{cmd} did not finish within {timeout} s:\n{out[-4000:]}")
    if proc.returncode == 77:
        pytest.skip(out.strip().splitlines()[-1] if out.strip() else f"{cmd} skipped")
    return proc.returncode, out


# ---- a store and a syncer driven by hand (tests/test_defence.py, tests/test_hostile.py) ----
P = 1  # the fragment the rig's tests push to (not the embedding)


class Rig:
    """A store and a syncer service on a run directory; learners 0 and 1 registered; K = 1, no grace."""

    def __init__(self, run_dir, tiny_run, *overrides):
        self.cfg = config.load(
            overrides=(
                *tiny_run,
                "learners.count=2",
                "syncer.quorum=1",
                "syncer.grace_factor=0",
                "compression.dtype=fp32",
                *overrides,
            )
        )
        self.run_dir, self.clock, self.transport = run_dir, VirtualClock(), SimTransport(set())
        self.plan = build.blueprint(self.cfg).plan
        self.store = StoreService(self.cfg, run_dir, self.transport, self.clock)
        self.inc = {m: self.store.register(m).incarnation for m in (0, 1)}
        self.syncer = SyncerService(self.cfg, self.store, self.transport, self.clock)
        self.steps = {0: 0, 1: 0}
        self.rng = np.random.default_rng(0)

    def restart_syncer(self):
        self.syncer = SyncerService(self.cfg, self.store, self.transport, self.clock)

    def restart_store(self):
        self.store.close()
        self.store = StoreService(self.cfg, self.run_dir, self.transport, self.clock)

    def theta(self, p=P):
        return {k: np.array(v) for k, v in self.store.core.fragment(p)[1].items()}

    def honest(self, p=P):
        """A per-step norm of honest size: 0.3 × one AdamW step's bound (measured: 0.25–0.5 typical)."""
        size = self.plan.fragments[p].size
        return 0.3 * defence.adam_step_bound(self.cfg, size, defence.norm(self.theta(p).values()))

    def payload(self, norm, p=P, scale_values=None):
        """fp32 payload of a random direction with ‖δ‖ = norm (built directly: no encode checks)."""
        shapes = self.plan.fragments[p].shape_map
        raw = {n: self.rng.normal(size=s).astype(np.float32) for n, s in shapes.items()}
        k = norm / defence.norm(raw.values())
        return {n: compress.Payload("fp32", x.shape, (x * k).astype(np.float32), None, 128) for n, x in raw.items()}

    def meta(self, m, steps=8, p=P, **kw):
        self.steps[m] += steps
        tps = build.learner_batch_size(self.cfg, m) * self.cfg.data.seq_len
        fields = dict(
            learner_id=m,
            incarnation=self.inc[m],
            fragment_id=p,
            base_version=self.store.core.versions[p],
            tokens=steps * tps,
            steps=steps,
            step=self.steps[m],
            step_time=1.0,
            cursor={"epoch": 0, "index": self.steps[m]},
        )
        return ContributionMeta(**{**fields, **kw})

    def push(self, meta, payload):
        return self.syncer.push(meta, self.transport.put(payload))

    def close(self):
        """Closes every due round; returns the syncer's and the store's new events."""
        self.clock.t += 1.0
        self.syncer.run_due()
        return self.syncer.drain_events()


@pytest.fixture
def rig(tmp_path, tiny_run):
    """`rig(*overrides)` makes a Rig on tmp_path; `rig(*overrides, sub="name")` on tmp_path / name."""

    def make(*overrides, sub=None):
        return Rig(tmp_path if sub is None else tmp_path / sub, tiny_run, *overrides)

    return make
