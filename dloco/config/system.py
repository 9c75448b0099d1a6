"""The sections of `RunConfig` that define where and how long a run runs: the learners (and their
groups), store durability, metrics cadence, fault injection and the budget."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from dloco.config.check import choice, finite, positive, require, resource

# Ray's own resource names, which `.options()` refuses inside `resources` (num_cpus/num_gpus set them).
_RAY_NAMED = ("CPU", "GPU")


def _resources(pre: str, num_cpus: float, num_gpus: float, resources: Mapping[str, float]) -> None:
    """What Ray's `.options()` would refuse when it creates a learner, after the run has started."""
    resource(f"{pre}.num_cpus", num_cpus)
    resource(f"{pre}.num_gpus", num_gpus)
    require(
        num_gpus <= 1 or num_gpus == int(num_gpus),
        f"{pre}.num_gpus",
        num_gpus,
        "must be <= 1 (a share of one GPU) or a whole number (a learner owns whole GPUs)",
    )
    for k, v in resources.items():
        require(k not in _RAY_NAMED, f"{pre}.resources.{k}", v, f"use {pre}.num_cpus / num_gpus for CPU and GPU")
        require(v >= 0, f"{pre}.resources.{k}", v, "must be >= 0")
        resource(f"{pre}.resources.{k}", v)


@dataclass(frozen=True)
class LearnerGroup:
    """Learners that share resources and batch size, e.g. one region's accelerators.

    `batch_size` 0 takes `inner.batch_size`. `resources` are Ray custom resources each learner
    needs (e.g. ``{region_us: 1}`` to place it on nodes that carry that label). `slowdown` ≥ 1
    makes each step take that many times longer (emulated slower hardware). `latency_s` is the
    emulated one-way network latency between this group's region and the syncer's: the learner's
    transport sends each push, and hands over each merged fragment that arrived, this many seconds
    late (a decoupled learner trains on meanwhile; blocking algorithms wait). Bandwidth is not
    emulated here: cap the real link (`benchmarks/wan.py` uses `tc`).
    """

    name: str = "default"
    count: int = 1
    batch_size: int = 0
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: Mapping[str, float] = field(default_factory=dict)
    slowdown: float = 1.0
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        pre = f"learners.groups[{self.name}]"
        finite(pre, self)
        require(self.latency_s >= 0, f"{pre}.latency_s", self.latency_s, "must be >= 0 seconds")
        require(self.count >= 0, f"{pre}.count", self.count, "must be >= 0")
        require(self.batch_size >= 0, f"{pre}.batch_size", self.batch_size, "must be >= 0 (0: inner.batch_size)")
        require(self.num_cpus >= 0, f"{pre}.num_cpus", self.num_cpus, "must be >= 0")
        require(self.num_gpus >= 0, f"{pre}.num_gpus", self.num_gpus, "must be >= 0")
        require(self.slowdown >= 1, f"{pre}.slowdown", self.slowdown, "must be >= 1")
        _resources(pre, self.num_cpus, self.num_gpus, self.resources)


@dataclass(frozen=True)
class LearnersConfig:
    """M learners (ALGORITHM.md §1): `count` identical ones, or `groups` (then M = Σ counts).

    Scaling a run is one line: ``learners.count=8``, or a group's ``count``. `cpu_limit` > 0 caps
    every learner process at that many CPU cores with a Linux cgroup, so that learners sharing one
    test machine behave like learners on their own hosts (`actors.isolation`; needs root).
    """

    count: int = 4
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: Mapping[str, float] = field(default_factory=dict)
    xla_threads: int = 1
    groups: tuple[LearnerGroup, ...] = ()
    cpu_limit: float = 0.0  # emulated hosts: cap each learner process at this many cores (0: no cap)
    sharding: str = "replicate"  # over a learner's devices: replicate | fsdp (parameters and AdamW state split)
    compile_cache_dir: str = "~/.cache/dloco/jax"  # JAX's persistent compilation cache ("": none)
    drain_s: float = 20.0  # on SIGTERM (a preemption notice): push unmerged progress, leave within this (0: at once)
    spares: int = 0  # warm spare learner processes (the first group's resources) that take over a dead learner's id

    def __post_init__(self) -> None:
        finite("learners", self)
        positive("learners", self, "xla_threads")
        if self.groups:
            names = [g.name for g in self.groups]
            require(len(set(names)) == len(names), "learners.groups", names, "group names must be unique")
            object.__setattr__(self, "count", sum(g.count for g in self.groups))
        require(self.count >= 1, "learners.count", self.count, "must be >= 1")
        require(self.num_cpus >= 0, "learners.num_cpus", self.num_cpus, "must be >= 0")
        require(self.num_gpus >= 0, "learners.num_gpus", self.num_gpus, "must be >= 0")
        require(self.cpu_limit >= 0, "learners.cpu_limit", self.cpu_limit, "must be >= 0 cores (0: no cap)")
        require(self.drain_s >= 0, "learners.drain_s", self.drain_s, "must be >= 0 seconds (0: leave at once)")
        require(self.spares >= 0, "learners.spares", self.spares, "must be >= 0 (0: Ray restarts a dead learner)")
        require(self.sharding in ("replicate", "fsdp"), "learners.sharding", self.sharding, "must be replicate or fsdp")
        _resources("learners", self.num_cpus, self.num_gpus, self.resources)

    def expand(self) -> list[LearnerGroup]:
        """One entry per learner id 0..M−1 (its group)."""
        if not self.groups:
            g = LearnerGroup("default", self.count, 0, self.num_cpus, self.num_gpus, self.resources)
            return [g] * self.count
        return [g for g in self.groups for _ in range(g.count)]


@dataclass(frozen=True)
class StoreConfig:
    """Fragment store durability: a snapshot every `snapshot_every` commits, `keep` kept.

    Each learner keeps one long poll of the store open; with no mail it returns after
    `long_poll_s` and is sent again. `object_store_mb` sizes Ray's object store when
    `dloco train` starts a local cluster (pushes and published fragments live there).
    `fail_after_s`: commits that keep failing (a full or read-only disk, a store that cannot
    write) for this long, with no commit succeeding meanwhile, end the run with that error;
    shorter outages are reported and the run carries on once commits succeed again.
    `copies_mb`: the most memory the store spends on what each learner holds (the per-learner
    copies of `compression.publish: delta` with `learner.install: own`); past it, the least
    recently used are dropped and their learners sent their next version in full.
    `fresh_if_lost`: a store that finds every snapshot and log file of its run damaged (each is set
    aside in ``quarantine/``) ends the start with that error; true starts over from the initial model.
    `mirror`: a `pyarrow.fs` URI (``gs://bucket/run``, ``s3://bucket/run``, ``file:///mnt/shared/run``)
    that receives a copy of every commit, snapshot and registry write before the store answers, so
    that the run survives losing the head node and its disk: a store that starts with an empty
    ``run_dir/store`` restores from it. One store holds a mirror at a time (a lease renewed at each
    write; a holder on another host that stops renewing is taken over after `mirror_lease_s`).
    """

    snapshot_every: int = 8
    keep: int = 3
    long_poll_s: float = 30.0
    object_store_mb: int = 512
    fail_after_s: float = 300.0
    copies_mb: int = 2048
    mirror: str = ""
    mirror_lease_s: float = 120.0
    fresh_if_lost: bool = False

    def __post_init__(self) -> None:
        finite("store", self)
        positive("store", self, "snapshot_every", "keep", "long_poll_s", "fail_after_s", "copies_mb", "mirror_lease_s")
        scheme = self.mirror.partition("://")[0]
        require(
            not self.mirror or ("://" in self.mirror and scheme.isidentifier() and bool(self.mirror.split("://")[1])),
            "store.mirror",
            self.mirror,
            "must be empty or a URI with a scheme and a path (gs://bucket/run, s3://bucket/run, file:///abs/dir)",
        )
        require(
            self.object_store_mb >= 80, "store.object_store_mb", self.object_store_mb, "must be >= 80 (Ray's minimum)"
        )


@dataclass(frozen=True)
class ExportConfig:
    """Checkpoints a running run leaves behind (`dloco.checkpoints`): every `every_commits` store
    commits, or `every_s` seconds (whichever comes first; 0: that trigger is off; both 0: none), the
    store writes the global model as it stands (a consistent cut: every fragment at the version it
    had at one commit) to ``run_dir/checkpoints/commit-{n}/`` as a `dloco export` of `format`
    (``safetensors``, or ``hf``: a Hugging Face checkpoint of the llama family), off its commit
    path; the newest `keep` are kept. `dloco status` names the newest, `Result.checkpoint` too.
    """

    every_commits: int = 0
    every_s: float = 0.0
    keep: int = 3
    format: str = "safetensors"

    def __post_init__(self) -> None:
        finite("export", self)
        require(self.every_commits >= 0, "export.every_commits", self.every_commits, "must be >= 0 (0: off)")
        require(self.every_s >= 0, "export.every_s", self.every_s, "must be >= 0 (0: off)")
        positive("export", self, "keep")
        choice("export", self, "format", ("safetensors", "hf"))

    @property
    def enabled(self) -> bool:
        return self.every_commits > 0 or self.every_s > 0


@dataclass(frozen=True)
class MetricsConfig:
    """Evaluation cadence and the uptime stall threshold (ALGORITHM.md §8)."""

    eval_every_s: float = 10.0
    stall_threshold_s: float = 30.0
    wandb: str = ""  # a W&B project to log to ("": off; pip install 'dloco[wandb]'; dloco.sinks)
    wandb_mode: str = "online"  # online (wandb login) | offline (files under RUN_DIR/wandb, `wandb sync` later)
    mlflow: str = ""  # an MLflow tracking URI, file:PATH or http(s)://HOST ("": off; pip install 'dloco[mlflow]')
    eval_num_gpus: float = 0.0  # GPUs of an evaluator actor (0 and no eval_resources: evaluated in the driver)
    eval_resources: Mapping[str, float] = field(default_factory=dict)  # an evaluator actor's resources, e.g. {TPU: 4}

    def __post_init__(self) -> None:
        finite("metrics", self)
        positive("metrics", self, "eval_every_s", "stall_threshold_s")
        choice("metrics", self, "wandb_mode", ("online", "offline"))
        require(self.eval_num_gpus >= 0, "metrics.eval_num_gpus", self.eval_num_gpus, "must be >= 0")
        for k, v in self.eval_resources.items():
            resource(f"metrics.eval_resources.{k}", v)


@dataclass(frozen=True)
class ChaosConfig:
    """Seeded fault injection (ALGORITHM.md §10): the same `seed` gives the same schedule for every
    algorithm, so one schedule can be replayed against dp, elastic_dp, diloco, streaming and decoupled.

    Times are seconds of run wall time from the moment every learner first registered (on Ray: its
    process up, its step compiled; in the simulator: the start). Per learner, failures (real process
    kills; Ray restarts the actor) arrive as a renewal process with Exponential(`mtbf_s`) gaps, and
    freezes (alive but silent for `freeze_s`) with Exponential(`freeze_mtbf_s`) gaps; none before
    `warmup_s`. `stragglers` learners (a seeded choice) run every step `straggler_factor` times
    slower; every learner's step is further multiplied by U(1, 1 + `jitter`), drawn per step. Each
    push is lost on the wire with probability `payload_loss` (a blocking learner asks the syncer
    every `resend_s` whether it has its push, and resends only one it has not). The syncer and the
    store are killed at the listed times. 0 turns a fault off.
    """

    seed: int = 0  # the schedule's seed: same seed, same faults, for every algorithm
    mtbf_s: float = 0.0  # per-learner mean time between kills (real process kills)
    freeze_mtbf_s: float = 0.0  # per-learner mean time between freezes
    freeze_s: float = 5.0  # how long a freeze lasts
    warmup_s: float = 0.0  # no learner fault before this long after every learner is up
    stragglers: int = 0  # how many learners (a seeded choice) are slowed
    straggler_factor: float = 1.0  # a straggler's step takes this many times longer
    jitter: float = 0.0  # every step takes U(1, 1 + jitter) times longer, drawn per step
    payload_loss: float = 0.0  # probability that a push is lost on the wire
    resend_s: float = 1.0  # a blocking learner waiting this long asks the syncer; resends a push it lacks
    syncer_kills_s: tuple[float, ...] = ()  # kill the syncer at these times
    store_kills_s: tuple[float, ...] = ()  # kill the store at these times
    horizon_s: float = 3600.0  # the schedule's length

    def __post_init__(self) -> None:
        finite("chaos", self)
        # numpy's SeedSequence (every draw is seeded with (seed, ...)) refuses negative entries
        require(self.seed >= 0, "chaos.seed", self.seed, "must be >= 0")
        for n in ("mtbf_s", "freeze_mtbf_s", "warmup_s", "jitter"):
            require(getattr(self, n) >= 0, f"chaos.{n}", getattr(self, n), "must be >= 0 (0: off)")
        positive("chaos", self, "freeze_s", "resend_s", "horizon_s")
        require(self.stragglers >= 0, "chaos.stragglers", self.stragglers, "must be >= 0")
        require(self.straggler_factor >= 1, "chaos.straggler_factor", self.straggler_factor, "must be >= 1")
        require(0 <= self.payload_loss < 1, "chaos.payload_loss", self.payload_loss, "must be in [0, 1)")
        for n in ("syncer_kills_s", "store_kills_s"):
            times = getattr(self, n)
            object.__setattr__(self, n, tuple(float(t) for t in times))
            require(all(t > 0 for t in getattr(self, n)), f"chaos.{n}", times, "times must be > 0 seconds")


@dataclass(frozen=True)
class BudgetConfig:
    """When a run stops: whichever of the total-token or wall-time budget is hit first (0: none).

    `seconds` counts training time: from the first learner's registration (its train step already
    compiled), not from the command, so a 30-second budget trains for 30 seconds whatever Ray's
    start, the imports and the compiles took before (``startup_s`` in ``summary.json``).
    `steps` caps each learner's local steps (0: none); a run whose learners all reached it ends.
    """

    tokens: int = 400_000
    seconds: float = 0.0
    steps: int = 0

    def __post_init__(self) -> None:
        finite("budget", self)
        require(self.tokens >= 0, "budget.tokens", self.tokens, "must be >= 0 (0: no token budget)")
        require(self.seconds >= 0, "budget.seconds", self.seconds, "must be >= 0 (0: no time budget)")
        require(self.steps >= 0, "budget.steps", self.steps, "must be >= 0 (0: no step cap)")
        require(
            self.tokens > 0 or self.seconds > 0 or self.steps > 0,
            "budget.tokens",
            self.tokens,
            "set budget.tokens, budget.seconds or budget.steps > 0",
        )
