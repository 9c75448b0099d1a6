"""A decoder-only transformer language model (Flax linen), in two families (`ModelConfig.family`).

Pre-norm blocks: x ← x + Attn(RMSNorm(x)), x ← x + MLP(RMSNorm(x)); causal self-attention with
rotary position embeddings. ``classic``: multi-head attention, a GELU MLP, the output head tied to
the token embedding. ``llama``: grouped-query attention (`n_kv_heads` key/value heads shared by
n_heads / n_kv_heads query heads each) through `jax.nn.dot_product_attention`, a SwiGLU MLP
(silu(x·W_gate) ⊙ x·W_up, then W_down), and an untied ``lm_head`` unless `tie_embeddings`. Both
compute in `dtype` (float32 or bfloat16) with float32 parameters; the loss is taken in float32.
The token embedding lives under the top-level ``"embed"`` key, which `dloco.fragments` places on
its own fragment.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
from flax import linen as nn

from dloco.config import ModelConfig

EMBED_KEY = "embed"


def rotary(x: jax.Array, base: float) -> jax.Array:
    """Rotates pairs of features of `x` [batch, seq, heads, head_dim] by position-dependent angles.

    For position t and pair i: θ_i = base^(-2i/d), (x1, x2) ← (x1 cos tθ_i − x2 sin tθ_i,
    x1 sin tθ_i + x2 cos tθ_i).
    """
    seq, dim = x.shape[1], x.shape[-1]
    inv_freq = base ** (-jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * inv_freq[None, :]  # [seq, dim/2]
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return out.reshape(x.shape)


class Attention(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        h, dt = self.cfg.n_heads, _dtype(self.cfg)
        qkv = nn.Dense(3 * d, use_bias=False, dtype=dt, name="qkv")(x).reshape(b, t, 3, h, d // h)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        q, k = rotary(q, self.cfg.rope_base).astype(dt), rotary(k, self.cfg.rope_base).astype(dt)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // h).astype(x.dtype)
        causal = jnp.tril(jnp.ones((t, t), dtype=bool))
        scores = jnp.where(causal[None, None], scores, jnp.finfo(scores.dtype).min)
        attn = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", attn, v).reshape(b, t, d)
        return nn.Dense(d, use_bias=False, dtype=dt, name="out")(out)


class GQAttention(nn.Module):
    """Grouped-query attention (llama): n_heads query heads, n_kv_heads key/value heads."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        h, kv, dt = self.cfg.n_heads, self.cfg.n_kv_heads or self.cfg.n_heads, _dtype(self.cfg)
        hd = d // h
        q = nn.Dense(h * hd, use_bias=False, dtype=dt, name="q")(x).reshape(b, t, h, hd)
        k = nn.Dense(kv * hd, use_bias=False, dtype=dt, name="k")(x).reshape(b, t, kv, hd)
        v = nn.Dense(kv * hd, use_bias=False, dtype=dt, name="v")(x).reshape(b, t, kv, hd)
        q, k = rotary(q, self.cfg.rope_base).astype(dt), rotary(k, self.cfg.rope_base).astype(dt)
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, d)
        return nn.Dense(d, use_bias=False, dtype=dt, name="out")(out)


def swiglu_hidden(cfg: ModelConfig) -> int:
    """The SwiGLU MLP's hidden size: (2/3)·mlp_ratio·d_model, as many weights as the GELU MLP,
    rounded up to a multiple of 8."""
    return max(8, -(-2 * cfg.mlp_ratio * cfg.d_model // 3 // 8) * 8)


def _dtype(cfg: ModelConfig):
    return jnp.bfloat16 if cfg.dtype == "bfloat16" else jnp.float32


class MoE(nn.Module):
    """A mixture of E experts (the family's MLP each, weights stacked [E, ...]), top-k routing.

    Router probabilities p = softmax(x·W_r) in float32; each token goes to its k most probable
    experts, whose outputs are combined with the renormalized probabilities. The load-balancing
    loss (Switch Transformer, over top-k slots) E·Σ_e f_e·P_e, with f_e the share of routed slots
    that went to expert e and P_e its mean probability, is 1 when the routing is balanced; weighted
    by `moe_aux_weight` it is sown into the ``"losses"`` collection (`dloco.inner.lm_loss`).
    Every expert is computed for every token and the unchosen ones weighted 0: the arithmetic of
    a dispatch kernel, not its speed.
    """

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg, dt = self.cfg, _dtype(self.cfg)
        E, k, d = cfg.n_experts, cfg.experts_per_token, cfg.d_model
        llama = cfg.family == "llama"
        f = swiglu_hidden(cfg) if llama else cfg.mlp_ratio * d
        probs = jax.nn.softmax(nn.Dense(E, use_bias=False, name="router")(x.astype(jnp.float32)), axis=-1)
        top_p, top_i = jax.lax.top_k(probs, k)
        chosen = jax.nn.one_hot(top_i, E)  # [b, t, k, E]
        combine = jnp.einsum("btk,btke->bte", top_p / top_p.sum(-1, keepdims=True), chosen)
        init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1)
        w_in = self.param("w_in", init, (E, d, f)).astype(dt)
        h = jnp.einsum("btd,edf->btef", x, w_in)
        if llama:
            w_gate = self.param("w_gate", init, (E, d, f)).astype(dt)
            h = jax.nn.silu(jnp.einsum("btd,edf->btef", x, w_gate)) * h
        else:
            h = jax.nn.gelu(h)
        y = jnp.einsum("btef,efd->bted", h, self.param("w_out", init, (E, f, d)).astype(dt))
        share, mean_p = chosen.sum(-2).mean((0, 1)) / k, probs.mean((0, 1))
        self.sow("losses", "moe_balance", cfg.moe_aux_weight * E * jnp.sum(share * mean_p))
        return jnp.einsum("bted,bte->btd", y, combine.astype(dt))


class Block(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d, dt = self.cfg.d_model, _dtype(self.cfg)
        llama = self.cfg.family == "llama"
        attn = GQAttention(self.cfg, name="attn") if llama else Attention(self.cfg, name="attn")
        x = x + attn(nn.RMSNorm(dtype=dt, name="attn_norm")(x))
        y = nn.RMSNorm(dtype=dt, name="mlp_norm")(x)
        if self.cfg.n_experts:
            return x + MoE(self.cfg, name="moe")(y)
        if llama:
            f = swiglu_hidden(self.cfg)
            gate, up = (
                nn.Dense(f, use_bias=False, dtype=dt, name="mlp_gate")(y),
                nn.Dense(f, use_bias=False, dtype=dt, name="mlp_up")(y),
            )
            return x + nn.Dense(d, use_bias=False, dtype=dt, name="mlp_down")(jax.nn.silu(gate) * up)
        y = nn.Dense(self.cfg.mlp_ratio * d, use_bias=False, dtype=dt, name="mlp_in")(y)
        y = nn.Dense(d, use_bias=False, dtype=dt, name="mlp_out")(jax.nn.gelu(y))
        return x + y


class TransformerLM(nn.Module):
    """Maps token ids [batch, seq] to next-token logits [batch, seq, vocab]."""

    cfg: ModelConfig
    vocab_size: int

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        dt = _dtype(self.cfg)
        embed = nn.Embed(
            self.vocab_size, self.cfg.d_model, embedding_init=nn.initializers.normal(0.02), dtype=dt, name=EMBED_KEY
        )
        x = embed(tokens)
        for i in range(self.cfg.n_layers):
            x = Block(self.cfg, name=f"block_{i}")(x)
        x = nn.RMSNorm(dtype=dt, name="final_norm")(x)
        if self.cfg.tie_embeddings:
            return embed.attend(x)
        # as small as the embedding's init: the first loss is near uniform, ln(vocab), as when tied
        head = nn.Dense(
            self.vocab_size, use_bias=False, dtype=dt, kernel_init=nn.initializers.normal(0.02), name="lm_head"
        )
        return head(x)


def build(cfg: ModelConfig, vocab_size: int) -> nn.Module:
    """Builds the model; `cfg.vocab_size` (if non-zero) overrides the tokenizer's `vocab_size`.

    With `cfg.factory` (``"package.module:function"``) the model is yours: ``function(cfg,
    vocab_size)`` returns a Flax linen module that maps token ids [batch, seq] (int32) to logits
    [batch, seq, vocab_size]; everything else (init from the seed, the loss: next-token cross
    entropy in float32, fragments, merging, export) works on its parameters as on ours. Parameters
    under a top-level ``"embed"`` key are treated as the token embedding (a fragment of their own,
    merged by weighted mean). The module must be importable on every node of the cluster.
    """
    vocab = cfg.vocab_size or vocab_size
    if not cfg.factory:
        return TransformerLM(cfg, vocab)
    mod, _, fn = cfg.factory.partition(":")
    try:
        made = getattr(importlib.import_module(mod), fn)(cfg, vocab)
    except (ImportError, AttributeError) as e:
        raise ValueError(
            f"model.factory={cfg.factory}: cannot load it ({e}); expected 'package.module:function'"
        ) from None
    if not isinstance(made, nn.Module):
        raise ValueError(f"model.factory={cfg.factory}: returned {type(made).__name__}, not a flax.linen Module")
    return made


def init_params(model: nn.Module, seed: int, seq_len: int) -> dict:
    """Initial parameters from `jax.random.PRNGKey(seed)` (same seed → same parameters, the same
    bits on every thread and device count).

    Decision: jitted, one compiled program. Run op by op, flax's init compiles each of its ~90
    operations on its own: 7–8 s on 2 cores against ~2 s (and a hit in the persistent compilation
    cache after that), paid by every process that builds the model (driver, store, learners)."""
    return _jitted_init(model, seq_len)(jax.random.PRNGKey(seed))


@functools.lru_cache(maxsize=8)
def _jitted_init(model: nn.Module, seq_len: int):
    """One compiled init per model and sequence length (modules are hashable, equal by their
    fields), so that a process building the same model again (an in-process run, a test) reuses it."""
    # (the tokens are made inside: a caller may trace this under `jax.eval_shape`, and an array made
    # out here would then be a tracer kept in the cache)
    return jax.jit(lambda key: model.init(key, jnp.zeros((1, seq_len), dtype=jnp.int32))["params"])


def count_params(params: dict) -> int:
    return sum(int(x.size) for x in jax.tree_util.tree_leaves(params))
