"""`RunConfig`: every section nested in one frozen dataclass, the cross-section checks, the algorithms
(and the settings each baseline implies) and the presets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from dloco.config.check import choice, fail, require
from dloco.config.system import (
    BudgetConfig,
    ChaosConfig,
    ExportConfig,
    LearnersConfig,
    MetricsConfig,
    StoreConfig,
)
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

# jax.random.PRNGKey keeps the low 32 bits of a seed (2**32 gives the parameters of 0) and
# cannot convert one of 2**63 or more at all.
SEED_LIMIT = 2**32
# The byte tokenizer's vocabulary (256 bytes and EOS, `dloco.data.Tokenizer.byte`).
BYTE_VOCAB = 257
# The driver draws the whole chaos schedule when the run starts (`dloco.chaos.schedule`).
MAX_SCHEDULED_FAULTS = 1_000_000

# What each baseline implies (ALGORITHM.md §9), applied over the preset and under the user's values
# (so a conflicting explicit value fails validation with a message, never silently wins).
# dp: one fragment sent every step (H = 1, P = 1, τ = 0) holding the full fp32 gradient, averaged
# by tokens; every learner installs the same AdamW update (see `dloco.outer`). diloco installs the
# merged model as it is (the paper's overwrite) and waits for it right after its push (τ = 0: with
# τ > 0 the overwrite would discard the τ steps trained meanwhile, 8 % of the compute at H = 24,
# τ = 2); streaming blends, Streaming DiLoCo's mixing of the local and the merged fragment. The
# blocking algorithms push on the fixed schedule (sync.dynamic off: they wait for each merge anyway)
# and receive the merged model in full (publish: full), as their papers and our measurements do.
_DP = {
    "sync": {"every": 1, "overlap": 0, "dynamic": False},
    "fragments": {"count": 1},
    "compression": {"dtype": "fp32", "error_feedback": False, "publish": "full"},
    "merge": {"rule": "mean"},
    "syncer": {"grace_factor": 0.0, "max_staleness": 0},
    "learner": {"receive": "overwrite"},
}
ALGORITHM_DEFAULTS: dict[str, dict[str, Any]] = {
    "dp": _DP,
    "elastic_dp": _DP,
    "diloco": {
        "fragments": {"count": 1},
        "sync": {"overlap": 0, "dynamic": False},
        "compression": {"publish": "full"},
        "syncer": {"grace_factor": 0.0},
        "learner": {"receive": "overwrite"},
    },
    "streaming": {
        "sync": {"dynamic": False},
        "compression": {"publish": "full"},
        "syncer": {"grace_factor": 0.0},
        "learner": {"receive": "blend"},
    },
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
    export: ExportConfig = field(default_factory=ExportConfig)

    def __post_init__(self) -> None:
        choice("", self, "preset", tuple(PRESETS))
        choice("", self, "algorithm", ALGORITHMS)
        require(0 <= self.seed < SEED_LIMIT, "seed", self.seed, f"must be in [0, {SEED_LIMIT}) (jax.random.PRNGKey)")
        self._check_resources_and_data()
        H, P, tau = self.sync.every, self.fragments.count, self.sync.overlap
        require(P <= H, "fragments.count", P, f"must be <= sync.every={H} (1 <= P <= H)")
        require(H % P == 0, "sync.every", H, f"must be a multiple of fragments.count={P} (H % P == 0)")
        require(tau < H / P, "sync.overlap", tau, f"must be < sync.every / fragments.count = {H // P} (τ < H/P)")
        require(self.syncer.shards <= P, "syncer.shards", self.syncer.shards, f"must be <= fragments.count={P}")
        require(
            not self.export.enabled or self.syncer.shards == 1,
            "export.every_commits",
            self.export.every_commits or self.export.every_s,
            "checkpoints during a run need syncer.shards=1 (no store holds every fragment otherwise); "
            "export the run afterwards with dloco export",
        )
        if self.export.enabled and self.export.format == "hf":
            require(
                self.model.family == "llama" and not self.model.factory,
                "export.format",
                "hf",
                "a Hugging Face checkpoint is of the llama family: set model.family=llama (no model.factory)",
            )
        K, M = self.syncer.quorum, self.learners.count
        require(K <= M, "syncer.quorum", K, f"must be <= learners.count={M} (K <= M)")
        require(
            self.data.shards >= M, "learners.count", M, f"must be <= data.shards={self.data.shards} (one shard each)"
        )
        if self.outer.momentum > 0 and (self.outer.delay or M) > 1 and K < M and self.algorithm not in DP_ALGORITHMS:
            require(
                self.merge.scale_by_share,
                "merge.scale_by_share",
                self.merge.scale_by_share,
                "must be true for Delayed Nesterov with syncer.quorum < learners.count (each partial merge "
                "applies its share of the period's progress; or set outer.delay=1)",
            )
        if self.sync.dynamic:
            require(
                self.algorithm == "decoupled",
                "sync.dynamic",
                True,
                f"is for algorithm=decoupled only ({self.algorithm}'s learners push on a fixed schedule)",
            )
        if self.algorithm in BLOCKING_ALGORITHMS:
            require(K == M, "syncer.quorum", K, f"must equal learners.count={M} for algorithm={self.algorithm} (K = M)")
        if self.algorithm == "diloco":
            require(P == 1, "fragments.count", P, "must be 1 for algorithm=diloco (use streaming for P > 1)")
        if self.algorithm in DP_ALGORITHMS:
            a = self.algorithm
            require(H == 1, "sync.every", H, f"must be 1 for algorithm={a} (a gradient exchange every step)")
            require(P == 1, "fragments.count", P, f"must be 1 for algorithm={a} (the whole gradient at once)")
            require(tau == 0, "sync.overlap", tau, f"must be 0 for algorithm={a} (lock-step)")
            require(
                self.learner.receive == "overwrite",
                "learner.receive",
                self.learner.receive,
                f"must be overwrite for algorithm={a} (every learner installs the same update)",
            )
            require(
                self.syncer.max_staleness == 0,
                "syncer.max_staleness",
                self.syncer.max_staleness,
                f"must be 0 for algorithm={a} (a gradient applies only to the model it was computed on)",
            )

    def _check_resources_and_data(self) -> None:
        """Combinations that the learners, the model or the chaos schedule would fail on after Ray started."""
        d, m = self.data, self.model
        if m.vocab_size and d.tokenizer == "byte" and not d.source.startswith("parquet:"):
            require(
                m.vocab_size >= BYTE_VOCAB,
                "model.vocab_size",
                m.vocab_size,
                f"must be 0 (the tokenizer's) or >= {BYTE_VOCAB}, the byte tokenizer's vocabulary "
                "(a larger id embeds as NaN: every loss would be NaN)",
            )
        for g in self.learners.expand():  # a GPU learner's batch is split across its devices
            devices = int(g.num_gpus) if g.num_gpus >= 1 else 1
            batch = g.batch_size or self.inner.batch_size
            name = "inner.batch_size" if not g.batch_size else f"learners.groups[{g.name}].batch_size"
            if batch % devices:
                fail(name, batch, f"must be a multiple of the learner's {devices} GPUs (one slice each)")
            if batch % self.inner.accum_steps:
                fail(
                    name,
                    batch,
                    f"must be a multiple of inner.accum_steps={self.inner.accum_steps} (equal micro-batches)",
                )
        c, M = self.chaos, self.learners.count
        span = max(0.0, c.horizon_s - c.warmup_s)
        for name, mean in (("mtbf_s", c.mtbf_s), ("freeze_mtbf_s", c.freeze_mtbf_s + c.freeze_s)):
            if getattr(c, name) > 0:
                expected = M * span / mean
                require(
                    expected <= MAX_SCHEDULED_FAULTS,
                    f"chaos.{name}",
                    getattr(c, name),
                    f"schedules about {expected:.3g} faults for {M} learners over chaos.horizon_s={c.horizon_s} "
                    f"(at most {MAX_SCHEDULED_FAULTS:,}, drawn when the run starts): raise it or lower chaos.horizon_s",
                )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Presets are overrides on the dataclass defaults. `tiny`: a 0.4M-parameter model that trains in
# seconds on one CPU core. `small`: a 3.2M-parameter model for quality comparisons.
#
# Presets choose the model, data and budget; the algorithm's settings are the dataclass defaults
# (one truth: `dloco train` runs what docs/CONFIG.md and README state).
_LLAMA_TRAINING: dict[str, Any] = {
    "inner": {"lr": 3e-4, "warmup_steps": 500, "total_steps": 20_000, "batch_size": 32},
    "data": {"seq_len": 1024, "tokenizer": "bpe", "vocab_size": 32768},
    "sync": {"every": 100},
}

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
    # The llama family (model.family: llama): `llama-micro` for tests on CPU; ~125 M, ~350 M and
    # ~1 B parameters (with the 32768-token BPE these presets train) for GPU or TPU learners,
    # computing in bfloat16 with float32 parameters, with 20 tokens per parameter as budget.
    "llama-micro": {
        "model": {
            "family": "llama",
            "d_model": 32,
            "n_heads": 4,
            "n_kv_heads": 2,
            "n_layers": 1,
            "tie_embeddings": False,
        },
        "inner": {"batch_size": 4},
        "data": {"seq_len": 32, "max_bytes": 400_000},
    },
    "llama-125m": {
        "model": {
            "family": "llama",
            "d_model": 768,
            "n_heads": 12,
            "n_kv_heads": 4,
            "n_layers": 12,
            "tie_embeddings": False,
            "dtype": "bfloat16",
        },
        **_LLAMA_TRAINING,
        "budget": {"tokens": 2_500_000_000},  # 20 tokens per parameter
    },
    "llama-350m": {
        "model": {
            "family": "llama",
            "d_model": 1024,
            "n_heads": 16,
            "n_kv_heads": 8,
            "n_layers": 24,
            "tie_embeddings": False,
            "dtype": "bfloat16",
        },
        **_LLAMA_TRAINING,
        "budget": {"tokens": 7_000_000_000},  # 20 tokens per parameter
    },
    "llama-1b": {
        "model": {
            "family": "llama",
            "d_model": 2048,
            "n_heads": 32,
            "n_kv_heads": 8,
            "n_layers": 20,
            "tie_embeddings": False,
            "dtype": "bfloat16",
        },
        **_LLAMA_TRAINING,
        "budget": {"tokens": 20_000_000_000},  # 20 tokens per parameter
    },
}
