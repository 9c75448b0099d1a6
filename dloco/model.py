"""A decoder-only transformer language model (Flax linen).

Pre-norm blocks: x ← x + Attn(RMSNorm(x)), x ← x + MLP(RMSNorm(x)); causal self-attention with
rotary position embeddings; the output head is tied to the token embedding. The token embedding
lives under the top-level ``"embed"`` key, which `dloco.fragments` places on its own fragment.
"""

from __future__ import annotations

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
        h = self.cfg.n_heads
        qkv = nn.Dense(3 * d, use_bias=False, name="qkv")(x).reshape(b, t, 3, h, d // h)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        q, k = rotary(q, self.cfg.rope_base), rotary(k, self.cfg.rope_base)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // h).astype(x.dtype)
        causal = jnp.tril(jnp.ones((t, t), dtype=bool))
        scores = jnp.where(causal[None, None], scores, jnp.finfo(scores.dtype).min)
        attn = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", attn, v).reshape(b, t, d)
        return nn.Dense(d, use_bias=False, name="out")(out)


class Block(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d = self.cfg.d_model
        x = x + Attention(self.cfg, name="attn")(nn.RMSNorm(name="attn_norm")(x))
        y = nn.RMSNorm(name="mlp_norm")(x)
        y = nn.Dense(self.cfg.mlp_ratio * d, use_bias=False, name="mlp_in")(y)
        y = nn.Dense(d, use_bias=False, name="mlp_out")(jax.nn.gelu(y))
        return x + y


class TransformerLM(nn.Module):
    """Maps token ids [batch, seq] to next-token logits [batch, seq, vocab]."""

    cfg: ModelConfig
    vocab_size: int

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        embed = nn.Embed(self.vocab_size, self.cfg.d_model, embedding_init=nn.initializers.normal(0.02), name=EMBED_KEY)
        x = embed(tokens)
        for i in range(self.cfg.n_layers):
            x = Block(self.cfg, name=f"block_{i}")(x)
        x = nn.RMSNorm(name="final_norm")(x)
        return embed.attend(x)


def build(cfg: ModelConfig, vocab_size: int) -> TransformerLM:
    """Builds the model; `cfg.vocab_size` (if non-zero) overrides the tokenizer's `vocab_size`."""
    return TransformerLM(cfg, cfg.vocab_size or vocab_size)


def init_params(model: TransformerLM, seed: int, seq_len: int) -> dict:
    """Initial parameters from `jax.random.PRNGKey(seed)` (same seed → same parameters)."""
    tokens = jnp.zeros((1, seq_len), dtype=jnp.int32)
    return model.init(jax.random.PRNGKey(seed), tokens)["params"]


def count_params(params: dict) -> int:
    return sum(int(x.size) for x in jax.tree_util.tree_leaves(params))
