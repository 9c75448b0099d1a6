"""Builds the pieces of a run from one `RunConfig`: corpus, model, fragment plan, initial Θ.

Every actor (learner, store, syncer, driver) calls these with the same config and gets the same
model, plan and initial fragments, so nothing but arrays and small metadata has to travel.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from flax import linen as nn

from dloco import data, model, outer
from dloco.config import RunConfig
from dloco.fragments import FragmentPlan, embedding_names, partition


@dataclass(frozen=True)
class Blueprint:
    """What every actor derives from the config: corpus, model, plan, initial fragments Θ_p⁰."""

    corpus: data.Corpus
    model: nn.Module  # ours (`dloco.model.TransformerLM`) or `model.factory`'s
    plan: FragmentPlan
    initial: tuple[dict[str, np.ndarray], ...]

    @property
    def embedding(self) -> frozenset[str]:
        return embedding_names(self.plan.names)


def corpus(cfg: RunConfig, tokenizer: bytes | None = None, progress: data.Progress | None = None) -> data.Corpus:
    """The tokenized corpus of `cfg.data` (prepared once, then read from the cache); `tokenizer` is
    the driver's ``tokenizer.json`` (`corpus_identity`), used instead of training or reading one.
    ``tokens:URI``: the corpus `dloco prepare` wrote there (its manifest fixes the tokenizer)."""
    d = cfg.data
    if d.source.startswith("tokens:"):
        return data.open_tokens(d.source.removeprefix("tokens:"), Path(d.cache_dir).expanduser())
    return data.prepare_corpus(
        d.source,
        tokenizer=d.tokenizer,
        vocab_size=d.vocab_size if d.tokenizer == "bpe" else None,
        val_fraction=d.val_fraction,
        max_bytes=d.max_bytes,
        cache_dir=Path(d.cache_dir).expanduser(),
        text_field=d.text_field,
        given_tokenizer=tokenizer,
        progress=progress,
    )


def corpus_identity(c: data.Corpus) -> dict[str, Any]:
    """What the driver sends every learner: the cache key (the documents and how they were split
    and tokenized), the tokenizer's digest, and the tokenizer itself (``tokenizer_json``, None for
    bytes), so that no node trains its own BPE or needs the ``file:`` tokenizer."""
    tok = c.path / "tokenizer.json"
    raw = tok.read_bytes() if tok.exists() else None
    digest = hashlib.blake2b(raw, digest_size=16).hexdigest() if raw is not None else c.tokenizer
    return {"key": c.key, "tokenizer": digest, "tokenizer_json": raw}


def check_corpus(cfg: RunConfig, c: data.Corpus, expect: dict[str, Any] | None, who: str) -> None:
    """Raises `ValueError` (one line) if `c` is not the corpus the driver prepared (`expect`)."""
    mine = corpus_identity(c)
    if expect is None or all(mine[k] == expect[k] for k in ("key", "tokenizer")):
        return
    same_docs = mine["key"] == expect["key"]
    raise ValueError(
        f"{who}: its {'tokenizer' if same_docs else 'corpus'} differs from the driver's (data.source="
        f"{cfg.data.source}: key {mine['key'][:12]}, tokenizer {mine['tokenizer'][:12]} here; {expect['key'][:12]}, "
        f"{expect['tokenizer'][:12]} on the driver): "
        + (
            f"this node's cache ({c.path}) holds the corpus tokenized otherwise: remove it"
            if same_docs
            else "every node needs the same corpus files (stdlib differs between Python patch versions)"
        )
    )


def blueprint(cfg: RunConfig, tokenizer: bytes | None = None) -> Blueprint:
    """Corpus (tokenized with `tokenizer`, the driver's, if given), model, plan and the initial
    parameters: from `jax.random.PRNGKey(cfg.seed)`, or the weights `model.init_from` names."""
    c = corpus(cfg, tokenizer)
    m = model.build(cfg.model, c.vocab_size)
    if cfg.model.init_from:
        from dloco.export import initial_params

        params = initial_params(cfg.model.init_from, cfg, c.vocab_size, cfg.data.seq_len)
    else:
        params = model.init_params(m, cfg.seed, cfg.data.seq_len)
    plan = partition(params, cfg.fragments.count)
    return Blueprint(c, m, plan, tuple(plan.split(params)))


def stream(cfg: RunConfig, tokens: np.ndarray | data.ShardedTokens, learner_id: int, cursor=None, batch_size: int = 0):
    """Learner `learner_id`'s token stream: shard `learner_id` of `data.shards` disjoint shards (of a
    ``tokens:`` corpus's shards, `data.ShardStream`)."""
    kind = data.ShardStream if isinstance(tokens, data.ShardedTokens) else data.TokenStream
    return kind(
        tokens,
        seq_len=cfg.data.seq_len,
        batch_size=batch_size or cfg.inner.batch_size,
        shard=learner_id,
        num_shards=cfg.data.shards,
        seed=cfg.seed,
        cursor=cursor,
    )


def eval_set(cfg: RunConfig, c: data.Corpus) -> list[np.ndarray]:
    """The fixed validation batches used for every evaluation of a run (of a ``tokens:`` corpus, the
    same: read from the first validation shards)."""
    tokens = c.load_split("val")
    if isinstance(tokens, data.ShardedTokens):
        T, B = cfg.data.seq_len, cfg.data.eval_batch_size
        tokens = tokens.read(0, min(len(tokens), cfg.data.eval_batches * B * T + 1))
    return data.eval_batches(
        tokens,
        seq_len=cfg.data.seq_len,
        batch_size=cfg.data.eval_batch_size,
        max_batches=cfg.data.eval_batches,
    )


def initial_outer(cfg: RunConfig, bp: Blueprint) -> list[list[np.ndarray]]:
    """s_p⁰ (zero momentum) per fragment, as numpy leaves for the store."""
    return [outer.state_to_numpy(outer.init(outer.outer_config(cfg), f)) for f in bp.initial]


def learner_batch_size(cfg: RunConfig, learner_id: int) -> int:
    """Rows per step of learner `learner_id` (its group's batch size, else `inner.batch_size`)."""
    groups = cfg.learners.expand()
    g = groups[learner_id] if learner_id < len(groups) else groups[-1]
    return g.batch_size or cfg.inner.batch_size
