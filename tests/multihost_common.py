"""The model, parameters and batches shared by `multihost_worker.py` and `test_multihost.py`."""

import jax
import numpy as np

from dloco import config, model

STEPS = 3
BATCH, SEQ = 8, 16


def model_and_params():
    # inner.lr 3e-3: on these uniform random tokens (loss ≈ ln 256 from the start) the default 6e-3
    # overshoots within the few steps, and the check that it trained would read noise
    overrides = (
        "preset=micro",
        f"data.seq_len={SEQ}",
        f"inner.batch_size={BATCH}",
        "inner.warmup_steps=0",
        "inner.lr=0.003",
    )
    cfg = config.load(overrides=overrides)
    m = model.build(cfg.model, 256)
    params = model.init_params(m, cfg.seed, SEQ)
    return m, params, cfg


def batches():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (BATCH, SEQ + 1), dtype=np.int32) for _ in range(STEPS)]


def flat(params) -> dict[str, np.ndarray]:
    """Leaf path → this process's copy of the (replicated) leaf."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return {jax.tree_util.keystr(path): np.asarray(x.addressable_data(0)) for path, x in leaves}
