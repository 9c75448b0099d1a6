"""`RunConfig`: every section nested in one frozen dataclass, the cross-section checks, the algorithms
(and the settings each baseline implies) and the presets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from dloco.config.check import _check, _choice
from dloco.config.system import BudgetConfig, ChaosConfig, LearnersConfig, MetricsConfig, StoreConfig
from dloco.config.train import (
    CompressionConfig,
    DataConfig,
    FragmentsConfig,
    InnerConfig,
    LearnerConfig,
    MergeConfig,
    ModelConfig,
    OuterConfig,
    SyncConfig,
    SyncerConfig,
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
