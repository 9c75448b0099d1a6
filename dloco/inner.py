"""Inner optimization: AdamW train step and eval step, data-parallel over all visible devices.

A learner owns every device visible to its process. `make_mesh()` builds a 1-D `Mesh` with axis
``"data"``; batches are sharded along it, parameters and optimizer state are replicated, and XLA
inserts the gradient all-reduce. With one device this is plain single-device training.

Schedule (`InnerConfig`): lr_t = linear warmup 0 → lr over `warmup_steps`, then cosine decay to
`lr · min_lr_ratio` at `total_steps`. The step index is an explicit argument of the train step, so a
restarted learner with a fresh AdamW state continues the schedule where its step counter is.

Jit-safety: no data-dependent Python control flow inside the jitted functions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dloco.config import InnerConfig

DATA_AXIS = "data"


class TrainState(NamedTuple):
    """A learner's inner state: parameters θ_m, AdamW state and the local step counter t."""

    params: Any
    opt_state: Any
    step: int


def schedule(cfg: InnerConfig) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.lr,
        warmup_steps=cfg.warmup_steps,
        decay_steps=cfg.total_steps,
        end_value=cfg.lr * cfg.min_lr_ratio,
    )


def optimizer(cfg: InnerConfig) -> optax.GradientTransformation:
    """Gradient clipping then AdamW at unit learning rate; the train step scales by lr_t.

    AdamW: θ ← θ − lr_t · (m̂ / (√v̂ + ε) + λ·θ), weight decay λ only on matrices (ndim ≥ 2).
    """
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(
            learning_rate=1.0,
            b1=cfg.b1,
            b2=cfg.b2,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            mask=lambda p: jax.tree_util.tree_map(lambda x: x.ndim >= 2, p),
        ),
    )


def make_mesh(devices: list | None = None) -> Mesh:
    """A 1-D data-parallel mesh over `devices` (default: all devices visible to the process)."""
    devs = np.asarray(devices if devices is not None else jax.devices())
    return Mesh(devs, (DATA_AXIS,))


SHARDINGS = ("replicate", "fsdp")


def leaf_sharding(shape: tuple[int, ...], mesh: Mesh, mode: str = "replicate") -> NamedSharding:
    """Where one array of `shape` lives (`learners.sharding`): ``replicate``, a full copy on every
    device; ``fsdp``, split along its first axis that the device count divides (each device holds
    1/n of it, XLA gathers it where a step needs it), else replicated (scalars, odd shapes)."""
    n = mesh.devices.size
    if mode == "fsdp" and n > 1:
        for axis, size in enumerate(shape):
            if size % n == 0 and size >= n:
                return NamedSharding(mesh, P(*([None] * axis), DATA_AXIS))
    return NamedSharding(mesh, P())


def tree_shardings(tree: Any, mesh: Mesh, mode: str = "replicate") -> Any:
    return jax.tree_util.tree_map(lambda x: leaf_sharding(tuple(np.shape(x)), mesh, mode), tree)


def place(tree: Any, mesh: Mesh, mode: str = "replicate") -> Any:
    """A copy of every leaf of `tree` on `mesh`, replicated or FSDP-sharded (`leaf_sharding`).

    Always a fresh copy: the train step donates its inputs, which must never invalidate arrays
    the caller still holds (`jax.device_put` alone may alias the source on its own device).
    """
    fresh = jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), tree)
    return jax.device_put(fresh, tree_shardings(fresh, mesh, mode))


def replicate(tree: Any, mesh: Mesh) -> Any:
    """A copy of every leaf of `tree` on all devices of `mesh` (`place`, replicated)."""
    return place(tree, mesh, "replicate")


def shard_batch(batch: np.ndarray, mesh: Mesh) -> jax.Array:
    """Splits a [batch, ...] array along the data axis; batch must divide by the device count."""
    n = mesh.devices.size
    if batch.shape[0] % n:
        raise ValueError(f"batch size {batch.shape[0]} must be a multiple of the {n} devices of this learner")
    return jax.device_put(batch, NamedSharding(mesh, P(DATA_AXIS)))


def lm_loss(model: Any, params: Any, batch: jax.Array, aux: bool = False) -> tuple[jax.Array, jax.Array]:
    """Sum of next-token cross-entropies over `batch` [b, seq+1] and the number of targets. With
    `aux` (training), plus the auxiliary losses the model sows into its ``"losses"`` collection
    (the mixture of experts' load balancing, already weighted) × the number of targets, so that
    the mean is cross-entropy + auxiliary loss; evaluation reports cross-entropy alone."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits, sown = model.apply({"params": params}, inputs, mutable=["losses"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    count = jnp.asarray(losses.size, jnp.float32)
    total = losses.sum()
    if aux:
        total = total + count * sum((jnp.sum(x) for x in jax.tree_util.tree_leaves(sown)), jnp.float32(0))
    return total, count


def _value_and_grad(model: Any, params: Any, batch: jax.Array, accum: int, mesh: Mesh) -> tuple[jax.Array, Any]:
    """Mean training loss over `batch` and its gradient, in `accum` equal micro-batches (gradient
    accumulation: a scan, so one micro-batch's activations live at a time). Micro-batch i takes rows
    i, i + accum, ... so that each stays spread over the learner's devices. The mean of the
    micro-batches' mean losses and gradients is the batch's, up to float rounding (the mixture of
    experts' balancing loss is per micro-batch)."""

    def mean_loss(p, b):
        total, count = lm_loss(model, p, b, aux=True)
        return total / count

    if accum == 1:
        return jax.value_and_grad(mean_loss)(params, batch)
    micro = batch.reshape(batch.shape[0] // accum, accum, batch.shape[1]).swapaxes(0, 1)
    if (batch.shape[0] // accum) % mesh.devices.size == 0:
        micro = jax.lax.with_sharding_constraint(micro, NamedSharding(mesh, P(None, DATA_AXIS)))

    def add(carry, b):
        loss, grads = jax.value_and_grad(mean_loss)(params, b)
        return jax.tree_util.tree_map(jnp.add, carry, (loss, grads)), None

    zero = (jnp.zeros((), jnp.float32), jax.tree_util.tree_map(jnp.zeros_like, params))
    (loss, grads), _ = jax.lax.scan(add, zero, micro)
    return loss / accum, jax.tree_util.tree_map(lambda g: g / accum, grads)


def _lazy(build: Callable[[Any], Callable]) -> Callable:
    """A function jitted on its first call, with shardings taken from that call's first argument
    (the parameters: their shapes decide where each FSDP shard lives)."""
    jitted: list[Callable] = []

    def run(*args):
        if not jitted:
            jitted.append(build(args[0]))
        return jitted[0](*args)

    return run


@functools.lru_cache(maxsize=8)
def make_train_step(model: Any, cfg: InnerConfig, mesh: Mesh, sharding: str = "replicate") -> Callable:
    """Returns ``step(params, opt_state, batch, t) -> (params, opt_state, metrics)``, jitted.

    Cached per (model, cfg, mesh, sharding), all hashable and equal when built alike: another
    core in the process (a spare learner taking an identity, in-process runs) reuses the compiled step.

    `metrics` holds the mean loss, the gradient global norm and lr_t. Parameters and optimizer
    state are donated (updated in place), and kept where `place` puts them (`sharding`). The
    gradient is accumulated over `cfg.accum_steps` micro-batches (`_value_and_grad`).
    """
    tx, lr_fn = optimizer(cfg), schedule(cfg)
    replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P(DATA_AXIS))

    def step(params, opt_state, batch, t):
        loss, grads = _value_and_grad(model, params, batch, cfg.accum_steps, mesh)
        updates, opt_state = tx.update(grads, opt_state, params)
        lr = lr_fn(t)
        params = jax.tree_util.tree_map(lambda p, u: p + lr * u, params, updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": lr}
        return params, opt_state, metrics

    if sharding == "replicate":
        return jax.jit(
            step,
            in_shardings=(replicated, replicated, sharded, replicated),
            out_shardings=(replicated, replicated, replicated),
            donate_argnums=(0, 1),
        )

    def build(params):
        # the optimizer state's shapes, without allocating it (`init_state` places the real one)
        ps, os_ = (
            tree_shardings(params, mesh, sharding),
            tree_shardings(jax.eval_shape(tx.init, params), mesh, sharding),
        )
        return jax.jit(
            step,
            in_shardings=(ps, os_, sharded, replicated),
            out_shardings=(ps, os_, replicated),
            donate_argnums=(0, 1),
        )

    return _lazy(build)


@functools.lru_cache(maxsize=8)
def make_grad_step(model: Any, mesh: Mesh, sharding: str = "replicate", accum: int = 1) -> Callable:
    """Returns ``grad_step(params, batch) -> (grads, metrics)``, jitted: the mean-loss gradient on
    `batch` (over `accum` micro-batches) without applying it (the data-parallel baselines send it;
    ALGORITHM.md §9)."""
    replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P(DATA_AXIS))

    def grad_step(params, batch):
        loss, grads = _value_and_grad(model, params, batch, accum, mesh)
        return grads, {"loss": loss, "grad_norm": optax.tree.norm(grads)}

    if sharding == "replicate":
        return jax.jit(grad_step, in_shardings=(replicated, sharded), out_shardings=(replicated, replicated))
    return _lazy(
        lambda params: jax.jit(
            grad_step,
            in_shardings=(tree_shardings(params, mesh, sharding), sharded),
            out_shardings=(tree_shardings(params, mesh, sharding), replicated),
        )
    )


def make_eval_step(model: Any, mesh: Mesh) -> Callable:
    """Returns ``eval_step(params, batch) -> (loss_sum, count)``, jitted and data-parallel."""
    replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P(DATA_AXIS))
    return jax.jit(
        lambda params, batch: lm_loss(model, params, batch),
        in_shardings=(replicated, sharded),
        out_shardings=(replicated, replicated),
    )


def evaluate(eval_step: Callable, params: Any, batches: list[np.ndarray], mesh: Mesh) -> float:
    """Mean next-token loss (nats) over `batches`."""
    total, count = 0.0, 0.0
    for b in batches:
        s, c = eval_step(params, shard_batch(b, mesh))
        total, count = total + float(s), count + float(c)
    return total / max(count, 1.0)


def init_state(params: Any, cfg: InnerConfig, mesh: Mesh, sharding: str = "replicate") -> TrainState:
    """Fresh AdamW state for `params`, both placed on `mesh` (`place`); step 0."""
    params = place(params, mesh, sharding)
    return TrainState(params, place(optimizer(cfg).init(params), mesh, sharding), 0)
