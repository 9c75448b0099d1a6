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

# Layout: `check` (ConfigError and the field checks), `train` (the sections of the training
# computation), `system` (learners, store, metrics, chaos, budget), `run` (`RunConfig`, the
# algorithms' defaults, the presets) and `loading` (YAML, dotted overrides, `from_dict`, `load`).

from dloco.config.check import ConfigError
from dloco.config.loading import from_dict, load, replace
from dloco.config.run import ALGORITHM_DEFAULTS, ALGORITHMS, BLOCKING_ALGORITHMS, DP_ALGORITHMS, PRESETS, RunConfig
from dloco.config.system import (
    BudgetConfig,
    ChaosConfig,
    ExportConfig,
    LearnerGroup,
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

__all__ = [
    "ALGORITHMS",
    "ALGORITHM_DEFAULTS",
    "BLOCKING_ALGORITHMS",
    "DP_ALGORITHMS",
    "PRESETS",
    "BudgetConfig",
    "ChaosConfig",
    "CompressionConfig",
    "ConfigError",
    "DataConfig",
    "FragmentsConfig",
    "InnerConfig",
    "LearnerConfig",
    "LearnerGroup",
    "LearnersConfig",
    "MergeConfig",
    "MetricsConfig",
    "ModelConfig",
    "OuterConfig",
    "RunConfig",
    "StoreConfig",
    "ExportConfig",
    "SyncConfig",
    "SyncerConfig",
    "from_dict",
    "load",
    "replace",
]
