"""dloco: Decoupled DiLoCo — the pure library (no Ray; `actors/` wraps it in Ray actors).

Public surface, one module (or package) per concept (ALGORITHM.md section in brackets):

- `dloco.config`: `RunConfig` and its sections, `load`, `ConfigError` [§2]
- `dloco.model`: the decoder-only transformer LM; `dloco.data`: corpora, tokenizers, streams
- `dloco.inner`: AdamW train/eval steps, data-parallel over a device mesh
- `dloco.fragments`: `partition`, `FragmentPlan` (send schedule, conversions) [§3]
- `dloco.merge`: `token_weights`, `weighted_mean`, `rda`, `merge_fragment` [§6]
- `dloco.outer`: the outer Nesterov SGD (per commit or Delayed Nesterov) per fragment [§6]
- `dloco.compress`: `encode`/`decode` of fp32/bf16/int8/int4/int2 payloads, error feedback,
  `pack`/`unpack` (lossless zstd coding of their bytes, `dloco.entropy`) [§7]
- `dloco.policy`: contribution checks, grace window, per-fragment rounds [§5]
- `dloco.learner.LearnerCore`, `dloco.syncer.SyncerCore`, `dloco.store.StoreCore`: the three
  roles' algorithms without transport [§1, §4, §5, §8]
- `dloco.build`: everything an actor derives from a config; `dloco.metrics`: run accounting
  (goodput, uptime, downtime from events) [§8]
- `dloco.chaos`: the seeded fault schedule, stragglers and payload loss [§10]; `dloco.goodput`:
  the discrete-event goodput simulator of a fleet at scale [§8, §10]
- `dloco.tensorboard.TensorBoardSink`: run events as TensorBoard scalars; `dloco.plot`: the figures
  of ``dloco plot`` (both read or write only a run directory)
- `dloco.result.Result`: a run's final metrics, directory, newest checkpoint and error, read back from
  its run directory (`Result.from_path`; what ``RunHandle.wait()`` returns)
"""

__version__ = "0.1.0"
