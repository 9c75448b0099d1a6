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

**Fused merge + outer step** (`make_merge_step`). The syncer's merge (`dloco.merge`) and the outer
step are one pass over each tensor where the pushes are packed integer payloads and the optimizer
is SGD, Nesterov or Delayed Nesterov (`dloco.kernels.combine_outer`): each push's codes are read
once, Δ is never stored as an array of its own (RDA's sum, needed for its norm first, is written
into the array that becomes Θ'), and Θ with its state is read and written once, chunk by chunk.
Its Θ and state are the jitted step's on the merged Δ, bit for bit (`tests/test_fused.py`);
everything else (fp32 or bf16 pushes, AdamW for dp) takes `merge_fragment` and the jitted step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dloco import compress, inner, merge
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

    The two cases are the branches of a `jax.lax.cond` on the traced c ≥ N, not a `jnp.where` per
    value: XLA then rounds each branch the same way at every tensor size. With a `where`, whether
    it fused μ·m into Δ + μ·m (one rounding, a multiply-add) depended on how it vectorized the loop:
    at 32,768 values it did, at 32,769 it did not, and the same first 32,768 values of Θ, m, A and Δ
    (standard normal) came out 1 ulp apart in 16 % of them (e.g. −1.2773542 against −1.2773541).
    The fused pass (`make_merge_step`) computes what this computes, bit for bit: it needs one answer.
    """

    def init(params):
        zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
        return DelayedNesterovState(zeros, jax.tree_util.tree_map(jnp.zeros_like, params), jnp.zeros((), jnp.int32))

    def update(updates, state, params=None, *, contributions=1, **_):
        del params
        count = state.count + jnp.asarray(contributions, jnp.int32)
        buffer = jax.tree_util.tree_map(jnp.add, state.buffer, updates)

        def fire(_):  # m ← μ·m + A;  −η·(Δ + μ·m);  A ← 0;  c ← 0
            m = jax.tree_util.tree_map(lambda m, a: momentum * m + a, state.momentum, buffer)
            out = jax.tree_util.tree_map(lambda d, m: -lr * (d + momentum * m), updates, m)
            zeros = jax.tree_util.tree_map(jnp.zeros_like, buffer)
            return out, DelayedNesterovState(m, zeros, jnp.zeros((), jnp.int32))

        def hold(_):  # −η·Δ; m kept
            return jax.tree_util.tree_map(lambda d: -lr * d, updates), DelayedNesterovState(
                state.momentum, buffer, count
            )

        return jax.lax.cond(count >= delay, fire, hold, None)

    return optax.GradientTransformationExtraArgs(init, update)


def _delayed(cfg: OuterConfig) -> bool:
    return cfg.momentum > 0 and cfg.delay > 1


def outer_optimizer(cfg: OuterConfig | InnerConfig) -> optax.GradientTransformation:
    """optax SGD with learning rate η and (Nesterov) momentum μ (no momentum when μ = 0);
    Delayed Nesterov when μ > 0 and the delay N > 1; or, given an `InnerConfig` (dp baselines),
    clipped AdamW scaled by the inner schedule lr_t, t = version."""
    if isinstance(cfg, InnerConfig):
        return optax.chain(inner.optimizer(cfg), optax.scale_by_schedule(inner.schedule(cfg)))
    if _delayed(cfg):
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


def make_merge_step(cfg: OuterConfig | InnerConfig, outer_step: Callable | None = None) -> Callable:
    """Returns ``merge_step(fragment, state, deltas, weights, rule, embedding, norms, scale,
    contributions) -> (fragment, state)``: the outer step on the merged pseudo-gradient,

        outer_step(fragment, state, merge.merge_fragment(deltas, weights, rule, embedding, norms, scale),
                   contributions)

    in one fused pass per tensor where `merge.plan_fragment` gives a plan and the optimizer is SGD,
    Nesterov or Delayed Nesterov on x86-64 with FMA (module docstring), the same bits; else exactly that.
    `outer_step`: this config's `make_outer_step`, if the caller has one (one compile, not two).
    """
    step = outer_step or make_outer_step(cfg)

    def merge_step(
        fragment, state, deltas, weights, rule="rda", embedding=frozenset(), norms=None, scale=1.0, contributions=1
    ):
        plans = None
        if isinstance(cfg, OuterConfig) and _fusable(fragment, deltas):
            plans = merge.plan_fragment(deltas, weights, rule, embedding, norms, scale)
        shapes = {k: np.shape(v) for k, v in fragment.items()}
        if isinstance(cfg, OuterConfig) and plans is not None and {k: p.shape for k, p in plans.items()} == shapes:
            return _fused_step(cfg, fragment, state, plans, contributions)
        pseudo_grad = merge.merge_fragment(deltas, weights, rule, embedding, norms, scale)
        return step(fragment, state, pseudo_grad, contributions)

    return merge_step


def _fusable(fragment: Mapping[str, Any], deltas: Any) -> bool:
    """Float32 tensors, and numba's kernels where this CPU runs them (imported only for packed pushes)."""
    if not deltas or not all(isinstance(x, compress.Payload) and x.scales is not None for x in deltas[0].values()):
        return False
    from dloco import kernels  # numba: only the processes that merge load it

    return kernels.FUSED and all(np.asarray(v).dtype == np.float32 for v in fragment.values())


def _fused_step(cfg: OuterConfig, fragment: Mapping[str, Any], state: Any, plans: Mapping, contributions: int):
    """Θ' and s' of `make_outer_step`'s step on the planned Δ, tensor by tensor in one pass each
    (`kernels.combine_outer`), in the jitted step's layout: keys sorted (as jax returns a dict), Θ'
    read-only host arrays, the state the optimizer's own NamedTuples."""
    from dloco import kernels

    rules = kernels.OuterRule
    nlr, mu = np.float32(-cfg.lr), np.float32(cfg.momentum)  # the constants as XLA folds them
    count = 0
    if _delayed(cfg):  # the same count as the jitted step's (int32; scheduling stays outside the kernel)
        count = int(np.asarray(state.count)) + int(contributions)
        rule = rules.DELAYED_FIRE if count >= cfg.delay else rules.DELAYED_HOLD
    else:
        rule = _rules(cfg)[0]
    values: dict[str, np.ndarray] = {}
    moms: dict[str, np.ndarray] = {}
    bufs: dict[str, np.ndarray] = {}
    for k in sorted(fragment):
        plan, theta = plans[k], np.asarray(fragment[k])
        mom = buf = None
        if rule in (rules.MOMENTUM, rules.NESTEROV):
            mom = np.asarray(state[0].trace[k])
        elif rule in (rules.DELAYED_HOLD, rules.DELAYED_FIRE):
            mom, buf = np.asarray(state.momentum[k]), np.asarray(state.buffer[k])
        o = kernels.Outer(rule, nlr, mu, theta, mom, buf)
        args = (plan.codes, plan.scales, theta.size, plan.block, plan.dtype, plan.factor, o, plan.summed)
        new, m, a = kernels.combine_outer(*args)
        values[k] = _frozen(new.reshape(theta.shape))
        if m is not None:
            moms[k] = _frozen(m.reshape(theta.shape))
        if a is not None:
            bufs[k] = _frozen(a.reshape(theta.shape))
    if rule == rules.SGD:
        return values, state
    if rule in (rules.MOMENTUM, rules.NESTEROV):
        return values, (optax.TraceState(trace=moms), *state[1:])
    if rule == rules.DELAYED_HOLD:
        return values, DelayedNesterovState(state.momentum, bufs, jnp.asarray(count, jnp.int32))
    return values, DelayedNesterovState(moms, bufs, jnp.zeros((), jnp.int32))


def _rules(cfg: OuterConfig) -> tuple:
    """The `kernels.OuterRule`s that `cfg`'s outer step takes (both of Delayed Nesterov's)."""
    from dloco import kernels

    rules = kernels.OuterRule
    if cfg.momentum == 0:
        return (rules.SGD,)
    if _delayed(cfg):
        return (rules.DELAYED_HOLD, rules.DELAYED_FIRE)
    return (rules.NESTEROV if cfg.nesterov else rules.MOMENTUM,)


def warm_merge_step(cfg: OuterConfig | InnerConfig, dtype: str) -> None:
    """Compiles (or loads) the kernels `make_merge_step` runs for `cfg` on pushes of `dtype` (an
    integer wire dtype), so that a syncer's first merge does not wait for them; nothing for AdamW."""
    from dloco import kernels

    kernels.warm(dtype, _rules(cfg) if isinstance(cfg, OuterConfig) and kernels.FUSED else ())


def _frozen(x: np.ndarray) -> np.ndarray:
    """`x`, read-only, as the jitted step's host arrays are (nothing mutates a committed Θ in place)."""
    x.flags.writeable = False
    return x


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
