"""Outer optimizer: one optax SGD-with-Nesterov state per fragment (ALGORITHM.md §6).

With merged pseudo-gradient Δ (Δ = anchor − θ, a descent direction like a gradient), momentum μ
and learning rate η, optax's Nesterov SGD computes

    m ← μ·m + Δ
    Θ ← Θ − η·(Δ + μ·m)

With μ = 0 this is Θ ← Θ − η·Δ; with η = 1 as well, a full round makes the fragment the
contributors' merged θ (a partial round applies its share of it, `merge.scale_by_share`).

**Delayed Nesterov** (`outer.delay` N > 1; Liu et al. 2024, *Asynchronous Local-SGD*, Alg. 3).
Under quorum K < M one sync period of fragment p is committed in several partial merges, each
carrying about 1/M of the period's progress (`merge.scale_by_share`). Per-commit Nesterov would
update and apply the momentum at each of them, so it compounds ~M times per period. Delayed
Nesterov keeps a buffer A of the pseudo-gradients since the last momentum update and counts
the merged contributions c:

    A ← A + Δ;  c ← c + n                       (n: contributions this commit merged)
    if c ≥ N:   m ← μ·m + A;  Θ ← Θ − η·(Δ + μ·m);  A ← 0;  c ← 0
    else:       Θ ← Θ − η·Δ

Over one period the commits add up to η·(Σ Δ + μ·m) with m ← μ·m + Σ Δ: synchronous DiLoCo's
Nesterov step on the period's merged pseudo-gradient. The paper divides each pseudo-gradient by
N; here each partial merge is already scaled by its share of the learners' weight, which plays
that role and adapts to rounds of any size. With N = 1 it is per-commit Nesterov; rounds of a
blocking algorithm hold all M contributions, so N = M fires at every round there too.

For the data-parallel baselines (`algorithm: dp | elastic_dp`, ALGORITHM.md §9) the merged
"pseudo-gradient" is the global-batch gradient g of one step, and the outer optimizer is the inner
AdamW of `InnerConfig` with its learning-rate schedule (`outer_config` picks it): every learner
installs Θ ← AdamW(Θ, g), exactly what lock-step data-parallel training computes.

Fragments and outer states are flat dicts of float32 arrays keyed by tensor name. The state
round-trips through numpy (`state_to_numpy` / `state_from_numpy`) for snapshots.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dloco import inner
from dloco.config import DP_ALGORITHMS, InnerConfig, OuterConfig, RunConfig


def outer_config(cfg: RunConfig) -> OuterConfig | InnerConfig:
    """The outer optimizer's config: `cfg.outer` (SGD, Nesterov) with the delay N resolved
    (0 → learners.count), or `cfg.inner` (AdamW) for dp."""
    if cfg.algorithm in DP_ALGORITHMS:
        return cfg.inner
    return dataclasses.replace(cfg.outer, delay=cfg.outer.delay or cfg.learners.count)


class DelayedNesterovState(NamedTuple):
    """Delayed Nesterov state s_p: momentum m, pseudo-gradient buffer A, contributions c since m moved."""

    momentum: Any
    buffer: Any
    count: jax.Array  # type: ignore[assignment]  # shadows tuple.count on purpose, as optax's own states do


def delayed_nesterov(lr: float, momentum: float, delay: int) -> optax.GradientTransformationExtraArgs:
    """Delayed Nesterov (module docstring) as an optax transformation.

    `update(updates, state, params=None, contributions=1)`: `contributions` is n, the number of
    merged contributions in this commit (a traced integer, so one compiled step serves all n).
    """

    def init(params):
        zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
        return DelayedNesterovState(zeros, jax.tree_util.tree_map(jnp.zeros_like, params), jnp.zeros((), jnp.int32))

    def update(updates, state, params=None, *, contributions=1, **_):
        del params
        count = state.count + jnp.asarray(contributions, jnp.int32)
        buffer = jax.tree_util.tree_map(jnp.add, state.buffer, updates)
        fire = count >= delay
        m = jax.tree_util.tree_map(lambda m, a: jnp.where(fire, momentum * m + a, m), state.momentum, buffer)
        out = jax.tree_util.tree_map(lambda d, m: -lr * (d + jnp.where(fire, momentum * m, 0.0)), updates, m)
        buffer = jax.tree_util.tree_map(lambda a: jnp.where(fire, jnp.zeros_like(a), a), buffer)
        return out, DelayedNesterovState(m, buffer, jnp.where(fire, 0, count))

    return optax.GradientTransformationExtraArgs(init, update)


def outer_optimizer(cfg: OuterConfig | InnerConfig) -> optax.GradientTransformation:
    """optax SGD with learning rate η and (Nesterov) momentum μ (no momentum when μ = 0);
    Delayed Nesterov when μ > 0 and the delay N > 1; or, given an `InnerConfig` (dp baselines),
    clipped AdamW scaled by the inner schedule lr_t, t = version."""
    if isinstance(cfg, InnerConfig):
        return optax.chain(inner.optimizer(cfg), optax.scale_by_schedule(inner.schedule(cfg)))
    if cfg.momentum > 0 and cfg.delay > 1:
        return delayed_nesterov(cfg.lr, cfg.momentum, cfg.delay)
    return optax.sgd(cfg.lr, momentum=cfg.momentum or None, nesterov=cfg.nesterov and cfg.momentum > 0)


def init(cfg: OuterConfig | InnerConfig, fragment: Mapping[str, np.ndarray]) -> Any:
    """The outer state s_p of a fragment (zero momentum)."""
    return outer_optimizer(cfg).init({k: jnp.asarray(v) for k, v in fragment.items()})


def make_outer_step(cfg: OuterConfig | InnerConfig) -> Callable:
    """Returns ``outer_step(fragment, state, pseudo_grad, contributions=1) -> (fragment, state)``, jitted.

    The first three arguments are flat dicts of float32 arrays with the same names;
    `contributions` is how many pushes the commit merged (Delayed Nesterov counts them). Returned
    arrays are numpy (host) arrays, ready for the store and the object store.
    """
    tx = outer_optimizer(cfg)
    extra = isinstance(tx, optax.GradientTransformationExtraArgs) and isinstance(cfg, OuterConfig)

    @jax.jit
    def _step(params, state, grads, contributions):
        if extra:
            updates, state = tx.update(grads, state, params, contributions=contributions)
        else:
            updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def outer_step(fragment, state, pseudo_grad, contributions=1):
        new, state = _step(dict(fragment), state, dict(pseudo_grad), np.int32(contributions))
        return {k: np.asarray(v) for k, v in new.items()}, state

    return outer_step


def state_to_numpy(state: Any) -> list[np.ndarray]:
    """The leaves of an outer state as numpy arrays (for snapshots)."""
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(state)]


def state_from_numpy(
    cfg: OuterConfig | InnerConfig, fragment: Mapping[str, np.ndarray], leaves: list[np.ndarray]
) -> Any:
    """Rebuilds an outer state for `fragment` from `state_to_numpy` leaves."""
    like, treedef = jax.tree_util.tree_flatten(init(cfg, fragment))
    if len(like) != len(leaves):
        raise ValueError(f"outer state has {len(leaves)} leaves, expected {len(like)}")
    return jax.tree_util.tree_unflatten(treedef, [jnp.asarray(x) for x in leaves])
