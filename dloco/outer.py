"""Outer optimizer: one optax SGD-with-Nesterov state per fragment (ALGORITHM.md §6).

With merged pseudo-gradient Δ (Δ = anchor − θ, a descent direction like a gradient), momentum μ
and learning rate η, optax's Nesterov SGD computes

    m ← μ·m + Δ
    Θ ← Θ − η·(Δ + μ·m)

With μ = 0 this is Θ ← Θ − η·Δ; with η = 1 as well, the fragment becomes the learner's θ.

For the data-parallel baselines (`algorithm: dp | elastic_dp`, ALGORITHM.md §9) the merged
"pseudo-gradient" is the global-batch gradient g of one step, and the outer optimizer is the inner
AdamW of `InnerConfig` with its learning-rate schedule (`outer_config` picks it): every learner
installs Θ ← AdamW(Θ, g), exactly what lock-step data-parallel training computes.

Fragments and outer states are flat dicts of float32 arrays keyed by tensor name. The state
round-trips through numpy (`state_to_numpy` / `state_from_numpy`) for snapshots.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dloco import inner
from dloco.config import DP_ALGORITHMS, InnerConfig, OuterConfig, RunConfig


def outer_config(cfg: RunConfig) -> OuterConfig | InnerConfig:
    """The outer optimizer's config: `cfg.outer` (SGD, Nesterov), or `cfg.inner` (AdamW) for dp."""
    return cfg.inner if cfg.algorithm in DP_ALGORITHMS else cfg.outer


def outer_optimizer(cfg: OuterConfig | InnerConfig) -> optax.GradientTransformation:
    """optax SGD with learning rate η and (Nesterov) momentum μ (no momentum when μ = 0); or, given
    an `InnerConfig` (dp baselines), clipped AdamW scaled by the inner schedule lr_t, t = version."""
    if isinstance(cfg, InnerConfig):
        return optax.chain(inner.optimizer(cfg), optax.scale_by_schedule(inner.schedule(cfg)))
    return optax.sgd(cfg.lr, momentum=cfg.momentum or None, nesterov=cfg.nesterov and cfg.momentum > 0)


def init(cfg: OuterConfig | InnerConfig, fragment: Mapping[str, np.ndarray]) -> Any:
    """The outer state s_p of a fragment (zero momentum)."""
    return outer_optimizer(cfg).init({k: jnp.asarray(v) for k, v in fragment.items()})


def make_outer_step(cfg: OuterConfig | InnerConfig) -> Callable:
    """Returns ``outer_step(fragment, state, pseudo_grad) -> (fragment, state)``, jitted.

    All three arguments are flat dicts of float32 arrays with the same names. Returned arrays
    are numpy (host) arrays, ready for the store and the object store.
    """
    tx = outer_optimizer(cfg)

    @jax.jit
    def _step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def outer_step(fragment, state, pseudo_grad):
        new, state = _step(dict(fragment), state, dict(pseudo_grad))
        return {k: np.asarray(v) for k, v in new.items()}, state

    return outer_step


def state_to_numpy(state: Any) -> list[np.ndarray]:
    """The leaves of an outer state as numpy arrays (for snapshots)."""
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(state)]


def state_from_numpy(
    cfg: OuterConfig | InnerConfig, fragment: Mapping[str, np.ndarray], leaves: list[np.ndarray]
) -> Any:
    """Rebuilds an outer state for `fragment` from `state_to_numpy` leaves."""
    like = init(cfg, fragment)
    treedef = jax.tree_util.tree_structure(like)
    if treedef.num_leaves != len(leaves):
        raise ValueError(f"outer state has {len(leaves)} leaves, expected {treedef.num_leaves}")
    return jax.tree_util.tree_unflatten(treedef, [jnp.asarray(x) for x in leaves])
