"""Run configuration: frozen, typed dataclasses, one per concern, nested in `RunConfig`.

Symbols of ALGORITHM.md §2 and their config names:

    M  learners.count        P  fragments.count      H  sync.every
    τ  sync.overlap          K  syncer.quorum        γ  syncer.grace_factor
    η  outer.lr              μ  outer.momentum       N  outer.delay
    α  learner.blend_alpha

`load(path, overrides)` starts from a preset (`tiny` unless the YAML file or an override says
`preset: small`), applies the YAML file, then dotted overrides such as ``"sync.every=48"``. Every
invalid value or combination raises `ConfigError` naming the field, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """An invalid configuration value; the message names the field, the value and the fix."""


def _fail(name: str, value: Any, allowed: str) -> typing.NoReturn:
    raise ConfigError(f"{name}={value!r} is invalid: {allowed}")


def _check(ok: bool, name: str, value: Any, allowed: str) -> None:
    if not ok:
        _fail(name, value, allowed)


def _positive(section: str, obj: Any, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        _check(v > 0, f"{section}.{n}", v, "must be > 0")


def _choice(section: str, obj: Any, name: str, allowed: Sequence[str]) -> None:
    v = getattr(obj, name)
    _check(v in allowed, f"{section}.{name}", v, f"must be one of {', '.join(allowed)}")


@dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer LM. `vocab_size=0` takes the tokenizer's vocabulary size."""

    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    mlp_ratio: int = 4
    vocab_size: int = 0
    rope_base: float = 10000.0

    def __post_init__(self) -> None:
        _positive("model", self, "d_model", "n_layers", "n_heads", "mlp_ratio", "rope_base")
        _check(self.vocab_size >= 0, "model.vocab_size", self.vocab_size, "must be >= 0 (0: from tokenizer)")
        _check(
            self.d_model % self.n_heads == 0 and (self.d_model // self.n_heads) % 2 == 0,
            "model.d_model",
            self.d_model,
            f"must be a multiple of model.n_heads={self.n_heads} with an even head size (rotary)",
        )


@dataclass(frozen=True)
class DataConfig:
    """Corpus, tokenizer and windows. `source`: stdlib | shakespeare | text:GLOB | parquet:GLOB."""

    source: str = "stdlib"
    tokenizer: str = "byte"
    vocab_size: int = 4096  # BPE only
    seq_len: int = 128
    val_fraction: float = 0.05
    max_bytes: int = 0  # 0: the whole corpus
    cache_dir: str = "~/.cache/dloco/data"
    eval_batches: int = 8
    eval_batch_size: int = 16  # rows per validation batch: the same held-out set whatever the batch size
    shards: int = 64  # disjoint data streams; learner m reads shard m, so at most this many learners

    def __post_init__(self) -> None:
        _check(
            self.source in ("stdlib", "shakespeare") or self.source.startswith(("text:", "parquet:")),
            "data.source",
            self.source,
            "must be stdlib, shakespeare, text:GLOB or parquet:GLOB",
        )
        _choice("data", self, "tokenizer", ("byte", "bpe"))
        _check(self.vocab_size >= 260, "data.vocab_size", self.vocab_size, "must be >= 260 (BPE over bytes)")
        _positive("data", self, "seq_len", "eval_batches", "eval_batch_size", "shards")
        _check(0 < self.val_fraction < 1, "data.val_fraction", self.val_fraction, "must be in (0, 1)")
        _check(self.max_bytes >= 0, "data.max_bytes", self.max_bytes, "must be >= 0 (0: no limit)")


@dataclass(frozen=True)
class InnerConfig:
    """Inner optimizer: AdamW with linear warmup then cosine decay to `lr * min_lr_ratio`."""

    lr: float = 3e-3
    warmup_steps: int = 20
    total_steps: int = 400  # horizon of the cosine schedule
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    batch_size: int = 16

    def __post_init__(self) -> None:
        _positive("inner", self, "lr", "total_steps", "eps", "grad_clip", "batch_size")
        _check(self.warmup_steps >= 0, "inner.warmup_steps", self.warmup_steps, "must be >= 0")
        _check(
            self.warmup_steps < self.total_steps,
            "inner.warmup_steps",
            self.warmup_steps,
            f"must be < inner.total_steps={self.total_steps}",
        )
        _check(0 <= self.min_lr_ratio <= 1, "inner.min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")
        _check(self.weight_decay >= 0, "inner.weight_decay", self.weight_decay, "must be >= 0")
        for n in ("b1", "b2"):
            v = getattr(self, n)
            _check(0 <= v < 1, f"inner.{n}", v, "must be in [0, 1)")


@dataclass(frozen=True)
class OuterConfig:
    """Outer optimizer: SGD with Nesterov momentum, learning rate η, momentum μ, delay N.

    `delay` is N of Delayed Nesterov (Liu et al. 2024, *Asynchronous Local-SGD*, Algorithm 3;
    `dloco.outer`): each commit applies its pseudo-gradient as a plain SGD step, and the momentum
    is updated (and applied) once per N merged contributions. With quorum K < M one sync period of
    a fragment is committed in several partial merges; N = M updates the momentum about once per
    period, as synchronous DiLoCo does, instead of compounding it over every partial merge.
    1: per-commit Nesterov (momentum updated at every commit). 0: N = learners.count.

    Default: plain averaging (η 1, μ 0), the winner of the tuning sweep (`benchmarks/quality.py`,
    docs/RESULTS.md): under K = 1 every momentum setting tried, delayed or per commit, ended
    higher; with momentum, set `outer.momentum` and keep `outer.delay` at 0 (Delayed Nesterov).
    """

    lr: float = 1.0
    momentum: float = 0.0
    nesterov: bool = True
    delay: int = 0

    def __post_init__(self) -> None:
        _positive("outer", self, "lr")
        _check(0 <= self.momentum < 1, "outer.momentum", self.momentum, "must be in [0, 1)")
        _check(self.delay >= 0, "outer.delay", self.delay, "must be >= 0 (0: learners.count, 1: per-commit Nesterov)")
        _check(
            self.nesterov or self.delay == 1 or self.momentum == 0,
            "outer.delay",
            self.delay,
            "must be 1 with outer.nesterov=false (Delayed Nesterov needs the Nesterov form)",
        )


@dataclass(frozen=True)
class FragmentsConfig:
    """P disjoint parameter fragments (balanced tensor bin-packing, embedding on its own)."""

    count: int = 4

    def __post_init__(self) -> None:
        _positive("fragments", self, "count")


@dataclass(frozen=True)
class SyncConfig:
    """H = `every` inner steps between two sends of one fragment; τ = `overlap`."""

    every: int = 24
    overlap: int = 2

    def __post_init__(self) -> None:
        _positive("sync", self, "every")
        _check(self.overlap >= 0, "sync.overlap", self.overlap, "must be >= 0")


@dataclass(frozen=True)
class SyncerConfig:
    """Quorum K, grace factor γ, grace cap (in steps) and contribution checks."""

    quorum: int = 1
    grace_factor: float = 0.5
    max_grace_steps: float = 1.0
    max_staleness: int = 8
    max_norm_ratio: float = 10.0
    norm_warmup: int = 8
    ema_decay: float = 0.9
    elastic_timeout_s: float = 2.0  # elastic_dp: wait this long for a missing learner, then drop it

    def __post_init__(self) -> None:
        _positive("syncer", self, "quorum", "max_norm_ratio", "elastic_timeout_s")
        _check(self.grace_factor >= 0, "syncer.grace_factor", self.grace_factor, "must be >= 0")
        _check(self.max_grace_steps >= 0, "syncer.max_grace_steps", self.max_grace_steps, "must be >= 0")
        _check(self.max_staleness >= 0, "syncer.max_staleness", self.max_staleness, "must be >= 0")
        _check(self.norm_warmup >= 0, "syncer.norm_warmup", self.norm_warmup, "must be >= 0")
        _check(0 <= self.ema_decay < 1, "syncer.ema_decay", self.ema_decay, "must be in [0, 1)")


@dataclass(frozen=True)
class MergeConfig:
    """Merge rule for non-embedding tensors and contribution weighting (ALGORITHM.md §6).

    `scale_by_share` (this project's decision, docs/ARCHITECTURE.md): a round that includes
    only some of the live learners applies Δ scaled by its share of their token weight, so that
    the rounds of one sync period together move Θ_p by the weighted mean of the learners'
    progress (as a full round does), not by its sum.
    """

    rule: str = "rda"
    weighting: str = "tokens"
    scale_by_share: bool = True

    def __post_init__(self) -> None:
        _choice("merge", self, "rule", ("rda", "mean"))
        _choice("merge", self, "weighting", ("tokens", "uniform"))


@dataclass(frozen=True)
class CompressionConfig:
    """Wire formats: learner→syncer `dtype`, syncer→learner `publish` (ALGORITHM.md §7).

    `publish: delta` sends each merged fragment as a difference quantized to `publish_dtype`:
    with `learner.install: own` against the copy the store knows the learner holds (one delta per
    delivery, `dloco.publish`), with `every` against the syncer's shadow Θ̂_p (what every
    up-to-date learner holds); `full` sends Θ_p in float32. `int2` (ternary, 4 values per byte)
    is the aggressive variant for ablations.
    """

    dtype: str = "int4"
    block: int = 128
    error_feedback: bool = True
    publish: str = "full"
    publish_dtype: str = "int4"

    def __post_init__(self) -> None:
        dtypes = ("fp32", "bf16", "int8", "int4", "int2")
        _choice("compression", self, "dtype", dtypes)
        _choice("compression", self, "publish_dtype", dtypes)
        _choice("compression", self, "publish", ("full", "delta"))
        _check(self.block >= 2 and self.block % 2 == 0, "compression.block", self.block, "must be an even number >= 2")
        if "int2" in (self.dtype, self.publish_dtype):
            _check(self.block % 4 == 0, "compression.block", self.block, "must be a multiple of 4 for int2")


@dataclass(frozen=True)
class LearnerConfig:
    """How a learner installs a merged fragment: overwrite | blend (α = blend_alpha) | rebase.

    `rebase` is the default. With K = 1 + grace and learners of different speeds most rounds hold
    one push; each then applies its share (≈ 1/M) of that learner's progress (`merge.scale_by_share`).
    rebase keeps every learner's own unmerged progress, so nothing trained is lost; overwrite
    throws it away and blend keeps half. In the compute-optimal quality runs (benchmarks/quality.py,
    docs/RESULTS.md, receive table) rebase has the lowest loss at M = 4, one seed, by less than
    the seed spread; earlier, shorter runs (up to 1000 steps) chose it as the only mode that beat
    synchronous DiLoCo on the longest run.

    `install` (`dloco.publish`): `every` sends each committed version of a fragment to every
    learner; `own` (default) sends it to a learner when it merges that learner's own push (once
    per sync period), or when the learner has fallen max(1, ⌈`syncer.max_staleness` / 2⌉) versions behind.
    Measured in an earlier, 160-step version of the quality benchmark (M = 4): own 2.404 vs every
    2.419 at 11.8 vs 42.9 MB received per learner; with int4 both ways the measured wire ratio to
    fp32 dp was 183× vs 78×.
    """

    receive: str = "rebase"
    blend_alpha: float = 0.5
    install: str = "own"

    def __post_init__(self) -> None:
        _choice("learner", self, "receive", ("overwrite", "blend", "rebase"))
        _choice("learner", self, "install", ("every", "own"))
        _check(0 <= self.blend_alpha <= 1, "learner.blend_alpha", self.blend_alpha, "must be in [0, 1]")


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
        _check(self.latency_s >= 0, f"{pre}.latency_s", self.latency_s, "must be >= 0 seconds")
        _check(self.count >= 0, f"{pre}.count", self.count, "must be >= 0")
        _check(self.batch_size >= 0, f"{pre}.batch_size", self.batch_size, "must be >= 0 (0: inner.batch_size)")
        _check(self.num_cpus >= 0, f"{pre}.num_cpus", self.num_cpus, "must be >= 0")
        _check(self.num_gpus >= 0, f"{pre}.num_gpus", self.num_gpus, "must be >= 0")
        _check(self.slowdown >= 1, f"{pre}.slowdown", self.slowdown, "must be >= 1")
        for k, v in self.resources.items():
            _check(v >= 0, f"{pre}.resources.{k}", v, "must be >= 0")


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

    def __post_init__(self) -> None:
        _positive("learners", self, "xla_threads")
        if self.groups:
            names = [g.name for g in self.groups]
            _check(len(set(names)) == len(names), "learners.groups", names, "group names must be unique")
            object.__setattr__(self, "count", sum(g.count for g in self.groups))
        _check(self.count >= 1, "learners.count", self.count, "must be >= 1")
        _check(self.num_cpus >= 0, "learners.num_cpus", self.num_cpus, "must be >= 0")
        _check(self.num_gpus >= 0, "learners.num_gpus", self.num_gpus, "must be >= 0")
        _check(self.cpu_limit >= 0, "learners.cpu_limit", self.cpu_limit, "must be >= 0 cores (0: no cap)")
        for k, v in self.resources.items():
            _check(v >= 0, f"learners.resources.{k}", v, "must be >= 0")

    def expand(self) -> list[LearnerGroup]:
        """One entry per learner id 0..M−1 (its group)."""
        if not self.groups:
            g = LearnerGroup("default", self.count, 0, self.num_cpus, self.num_gpus, self.resources)
            return [g] * self.count
        return [g for g in self.groups for _ in range(g.count)]


@dataclass(frozen=True)
class StoreConfig:
    """Fragment store durability: a snapshot every `snapshot_every` commits, `keep` kept."""

    snapshot_every: int = 8
    keep: int = 3

    def __post_init__(self) -> None:
        _positive("store", self, "snapshot_every", "keep")


@dataclass(frozen=True)
class MetricsConfig:
    """Evaluation cadence and the uptime stall threshold (ALGORITHM.md §8)."""

    eval_every_s: float = 10.0
    stall_threshold_s: float = 30.0

    def __post_init__(self) -> None:
        _positive("metrics", self, "eval_every_s", "stall_threshold_s")


@dataclass(frozen=True)
class ChaosConfig:
    """Seeded fault injection (ALGORITHM.md §10): the same `seed` gives the same schedule for every
    algorithm, so one schedule can be replayed against dp, elastic_dp, diloco, streaming and decoupled.

    Times are seconds of run wall time (from the run's start). Per learner, failures (real process
    kills; Ray restarts the actor) arrive as a renewal process with Exponential(`mtbf_s`) gaps, and
    freezes (alive but silent for `freeze_s`) with Exponential(`freeze_mtbf_s`) gaps; none before
    `warmup_s`. `stragglers` learners (a seeded choice) run every step `straggler_factor` times
    slower; every learner's step is further multiplied by U(1, 1 + `jitter`), drawn per step. Each
    push is lost on the wire with probability `payload_loss` (blocking algorithms resend it after
    `resend_s`). The syncer and the store are killed at the listed times. 0 turns a fault off.
    """

    seed: int = 0  # the schedule's seed: same seed, same faults, for every algorithm
    mtbf_s: float = 0.0  # per-learner mean time between kills (real process kills)
    freeze_mtbf_s: float = 0.0  # per-learner mean time between freezes
    freeze_s: float = 5.0  # how long a freeze lasts
    warmup_s: float = 0.0  # no learner fault before this time (the first compile)
    stragglers: int = 0  # how many learners (a seeded choice) are slowed
    straggler_factor: float = 1.0  # a straggler's step takes this many times longer
    jitter: float = 0.0  # every step takes U(1, 1 + jitter) times longer, drawn per step
    payload_loss: float = 0.0  # probability that a push is lost on the wire
    resend_s: float = 1.0  # blocking algorithms resend a lost push after this long
    syncer_kills_s: tuple[float, ...] = ()  # kill the syncer at these times
    store_kills_s: tuple[float, ...] = ()  # kill the store at these times
    horizon_s: float = 3600.0  # the schedule's length

    def __post_init__(self) -> None:
        for n in ("mtbf_s", "freeze_mtbf_s", "warmup_s", "jitter"):
            _check(getattr(self, n) >= 0, f"chaos.{n}", getattr(self, n), "must be >= 0 (0: off)")
        _positive("chaos", self, "freeze_s", "resend_s", "horizon_s")
        _check(self.stragglers >= 0, "chaos.stragglers", self.stragglers, "must be >= 0")
        _check(self.straggler_factor >= 1, "chaos.straggler_factor", self.straggler_factor, "must be >= 1")
        _check(0 <= self.payload_loss < 1, "chaos.payload_loss", self.payload_loss, "must be in [0, 1)")
        for n in ("syncer_kills_s", "store_kills_s"):
            times = getattr(self, n)
            object.__setattr__(self, n, tuple(float(t) for t in times))
            _check(all(t > 0 for t in getattr(self, n)), f"chaos.{n}", times, "times must be > 0 seconds")


@dataclass(frozen=True)
class BudgetConfig:
    """When a run stops: whichever of the total-token or wall-time budget is hit first (0: none).

    `steps` caps each learner's local steps (0: none); a run whose learners all reached it ends.
    """

    tokens: int = 400_000
    seconds: float = 0.0
    steps: int = 0

    def __post_init__(self) -> None:
        _check(self.tokens >= 0, "budget.tokens", self.tokens, "must be >= 0 (0: no token budget)")
        _check(self.seconds >= 0, "budget.seconds", self.seconds, "must be >= 0 (0: no time budget)")
        _check(self.steps >= 0, "budget.steps", self.steps, "must be >= 0 (0: no step cap)")
        _check(
            self.tokens > 0 or self.seconds > 0 or self.steps > 0,
            "budget.tokens",
            self.tokens,
            "set budget.tokens, budget.seconds or budget.steps > 0",
        )


ALGORITHMS = ("decoupled", "diloco", "streaming", "dp", "elastic_dp")
DP_ALGORITHMS = ("dp", "elastic_dp")
# Algorithms in which a learner waits for merges (ALGORITHM.md §9); their quorum K defaults to M.
BLOCKING_ALGORITHMS = ("diloco", "streaming", *DP_ALGORITHMS)

# What each baseline implies (ALGORITHM.md §9), applied over the preset and under the user's values
# (so a conflicting explicit value fails validation with a message, never silently wins).
# dp: one fragment sent every step (H = 1, P = 1, τ = 0) holding the full fp32 gradient, averaged
# by tokens; every learner installs the same AdamW update (see `dloco.outer`). diloco installs the
# merged model as it is (the paper's overwrite) and waits for it right after its push (τ = 0: with
# τ > 0 the overwrite would discard the τ steps trained meanwhile, 8 % of the compute at H = 24,
# τ = 2); streaming blends, Streaming DiLoCo's mixing of the local and the merged fragment.
_DP = {
    "sync": {"every": 1, "overlap": 0},
    "fragments": {"count": 1},
    "compression": {"dtype": "fp32", "error_feedback": False},
    "merge": {"rule": "mean"},
    "syncer": {"grace_factor": 0.0, "max_staleness": 0},
    "learner": {"receive": "overwrite"},
}
ALGORITHM_DEFAULTS: dict[str, dict[str, Any]] = {
    "dp": _DP,
    "elastic_dp": _DP,
    "diloco": {
        "fragments": {"count": 1},
        "sync": {"overlap": 0},
        "syncer": {"grace_factor": 0.0},
        "learner": {"receive": "overwrite"},
    },
    "streaming": {"syncer": {"grace_factor": 0.0}, "learner": {"receive": "blend"}},
}


@dataclass(frozen=True)
class RunConfig:
    """One run, built from one config: everything a launcher needs."""

    preset: str = "tiny"
    algorithm: str = "decoupled"
    seed: int = 0
    run_dir: str = "runs"  # each run writes to {run_dir}/{date-time} unless given one
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    fragments: FragmentsConfig = field(default_factory=FragmentsConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    syncer: SyncerConfig = field(default_factory=SyncerConfig)
    merge: MergeConfig = field(default_factory=MergeConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    learners: LearnersConfig = field(default_factory=LearnersConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    chaos: ChaosConfig = field(default_factory=ChaosConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)

    def __post_init__(self) -> None:
        _choice("", self, "preset", tuple(PRESETS))
        _choice("", self, "algorithm", ALGORITHMS)
        H, P, tau = self.sync.every, self.fragments.count, self.sync.overlap
        _check(P <= H, "fragments.count", P, f"must be <= sync.every={H} (1 <= P <= H)")
        _check(H % P == 0, "sync.every", H, f"must be a multiple of fragments.count={P} (H % P == 0)")
        _check(tau < H / P, "sync.overlap", tau, f"must be < sync.every / fragments.count = {H // P} (τ < H/P)")
        K, M = self.syncer.quorum, self.learners.count
        _check(K <= M, "syncer.quorum", K, f"must be <= learners.count={M} (K <= M)")
        _check(
            self.data.shards >= M, "learners.count", M, f"must be <= data.shards={self.data.shards} (one shard each)"
        )
        if self.outer.momentum > 0 and (self.outer.delay or M) > 1 and K < M and self.algorithm not in DP_ALGORITHMS:
            _check(
                self.merge.scale_by_share,
                "merge.scale_by_share",
                self.merge.scale_by_share,
                "must be true for Delayed Nesterov with syncer.quorum < learners.count (each partial merge "
                "applies its share of the period's progress; or set outer.delay=1)",
            )
        if self.algorithm in BLOCKING_ALGORITHMS:
            _check(K == M, "syncer.quorum", K, f"must equal learners.count={M} for algorithm={self.algorithm} (K = M)")
        if self.algorithm == "diloco":
            _check(P == 1, "fragments.count", P, "must be 1 for algorithm=diloco (use streaming for P > 1)")
        if self.algorithm in DP_ALGORITHMS:
            a = self.algorithm
            _check(H == 1, "sync.every", H, f"must be 1 for algorithm={a} (a gradient exchange every step)")
            _check(P == 1, "fragments.count", P, f"must be 1 for algorithm={a} (the whole gradient at once)")
            _check(tau == 0, "sync.overlap", tau, f"must be 0 for algorithm={a} (lock-step)")
            _check(
                self.learner.receive == "overwrite",
                "learner.receive",
                self.learner.receive,
                f"must be overwrite for algorithm={a} (every learner installs the same update)",
            )
            _check(
                self.syncer.max_staleness == 0,
                "syncer.max_staleness",
                self.syncer.max_staleness,
                f"must be 0 for algorithm={a} (a gradient applies only to the model it was computed on)",
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Presets are overrides on the dataclass defaults. `tiny`: a 0.4M-parameter model that trains in
# seconds on one CPU core. `small`: a 3.2M-parameter model for quality comparisons.
#
# Presets choose the model, data and budget; the algorithm's settings are the dataclass defaults
# (one truth: `dloco train` runs what docs/CONFIG.md and README state).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {},
    # `micro`: a 21k-parameter model on 400 kB of the corpus, for smoke runs and tests; `mini`: a
    # 115k-parameter model, for benchmarks that time the system rather than the arithmetic.
    "micro": {
        "model": {"d_model": 32, "n_heads": 2, "n_layers": 1},
        "inner": {"batch_size": 4},
        "data": {"seq_len": 32, "max_bytes": 400_000},
    },
    "mini": {
        "model": {"d_model": 64, "n_heads": 2, "n_layers": 2},
        "inner": {"batch_size": 8},
        "data": {"seq_len": 64, "max_bytes": 2_000_000},
    },
    "small": {
        "model": {"d_model": 256, "n_layers": 4, "n_heads": 4},
        "inner": {"lr": 2e-3, "warmup_steps": 50, "total_steps": 2000, "batch_size": 8},
        "data": {"seq_len": 128},
        "sync": {"every": 48},
        "budget": {"tokens": 8_000_000},
    },
}


def _section_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(name: str, value: Any, tp: Any) -> Any:
    """Checks a YAML/override value against the field type; ints widen to floats."""
    origin = typing.get_origin(tp)
    if origin is typing.Union or isinstance(tp, types.UnionType):
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
        origin = typing.get_origin(tp)
    if tp is bool:
        _check(isinstance(value, bool), name, value, "must be true or false")
    elif tp is int:
        _check(isinstance(value, int) and not isinstance(value, bool), name, value, "must be an integer")
    elif tp is float:
        _check(isinstance(value, int | float) and not isinstance(value, bool), name, value, "must be a number")
        value = float(value)
    elif tp is str:
        _check(isinstance(value, str), name, value, "must be a string")
    elif origin is tuple and not dataclasses.is_dataclass(typing.get_args(tp)[0]):
        _check(isinstance(value, list | tuple), name, value, "must be a list")
        value = tuple(_coerce(f"{name}[{i}]", v, typing.get_args(tp)[0]) for i, v in enumerate(value))
    elif origin is tuple and dataclasses.is_dataclass(typing.get_args(tp)[0]):
        _check(isinstance(value, list | tuple), name, value, "must be a list of mappings")
        item = typing.get_args(tp)[0]
        value = tuple(
            _build(item, v, f"{name}[{i}].")
            if isinstance(v, Mapping)
            else _fail(f"{name}[{i}]", v, "must be a mapping")
            for i, v in enumerate(value)
        )
    elif origin in (Mapping, dict) or tp in (Mapping, dict):
        _check(isinstance(value, Mapping), name, value, "must be a mapping")
        value = {str(k): _coerce(f"{name}.{k}", v, typing.get_args(tp)[1]) for k, v in value.items()}
    return value


def _build(cls: type, values: Mapping[str, Any], prefix: str) -> Any:
    hints = _section_types(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if key not in fields:
            _fail(name, value, f"unknown key; allowed keys here: {', '.join(sorted(fields))}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            _check(isinstance(value, Mapping), name, value, "must be a mapping of its fields")
            kwargs[key] = _build(tp, value, f"{name}.")
        else:
            kwargs[key] = _coerce(name, value, tp)
    return cls(**kwargs)


def _merge(base: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in update.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) and k != "resources":
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def _parse_override(text: str) -> dict[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        _fail("override", text, "use dotted KEY=VALUE, e.g. sync.every=48")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    node: dict[str, Any] = {}
    cur = node
    parts = key.strip().split(".")
    for p in parts[:-1]:
        cur[p] = {}
        cur = cur[p]
    cur[parts[-1]] = value
    return node


def from_dict(values: Mapping[str, Any]) -> RunConfig:
    """Builds a `RunConfig` from nested plain values on top of the named preset (default tiny)."""
    preset = values.get("preset", "tiny")
    _check(preset in PRESETS, "preset", preset, f"must be one of {', '.join(PRESETS)}")
    algorithm = values.get("algorithm", "decoupled")
    _check(algorithm in ALGORITHMS, "algorithm", algorithm, f"must be one of {', '.join(ALGORITHMS)}")
    merged = _merge(_merge(PRESETS[preset], ALGORITHM_DEFAULTS.get(algorithm, {})), values)
    if algorithm in BLOCKING_ALGORITHMS and "quorum" not in merged.get("syncer", {}):
        learners = _build(LearnersConfig, merged.get("learners", {}), "learners.")
        merged = _merge(merged, {"syncer": {"quorum": learners.count}})  # K = M unless set
    return _build(RunConfig, merged, "")


def load(path: str | Path | None = None, overrides: Sequence[str] = ()) -> RunConfig:
    """Loads a run config: preset → YAML file → dotted overrides (``"sync.every=48"``).

    Raises:
      ConfigError: unknown key, wrong type, invalid value or invalid combination.
      FileNotFoundError: `path` does not exist.
    """
    values: dict[str, Any] = {}
    if path is not None:
        text = Path(path).read_text()
        try:
            loaded = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML ({e})") from None
        _check(isinstance(loaded, Mapping), str(path), type(loaded).__name__, "must be a YAML mapping")
        values = dict(loaded)
    for text in overrides:
        values = _merge(values, _parse_override(text))
    return from_dict(values)


def replace(cfg: RunConfig, *overrides: str) -> RunConfig:
    """Returns `cfg` with dotted overrides applied (validated like `load`)."""
    values = _merge(cfg.to_dict(), {})
    for text in overrides:
        values = _merge(values, _parse_override(text))
    return _build(RunConfig, values, "")
