"""Corpora to token shards on disk, and per-learner resumable token streams.

A corpus is read from a source, split into train/validation by document hash, tokenized and
written as Parquet shards under ``cache_dir/<key[:16]>/``. The key is a content hash of the
inputs, so a second :func:`prepare_corpus` call with the same inputs reads the cache instead of
tokenizing again.

Each learner ``s`` of ``S`` reads a :class:`TokenStream` over the train split: per epoch ``e``
the windows are permuted by ``π_e = permutation(rng([seed, e]))`` and learner ``s`` takes
``π_e[s], π_e[s + S], π_e[s + 2S], …``, so the learners' streams are disjoint within an epoch.
A :class:`Cursor` ``(epoch, index)`` is the whole stream state.

A corpus too large for that is prepared once by :func:`prepare` (``dloco prepare``, on Ray Data)
into fixed-size token shards with a manifest (`shards`), and trained on as ``data.source=tokens:URI``
(:func:`open_tokens`): each learner streams its windows from a few shards at a time
(:class:`ShardStream`), with the same :class:`Cursor`.
"""

# Layout: `tokenizer` (byte and BPE tokenizers), `sources` (reading a corpus's documents), `corpus`
# (split, tokenize and cache them as Parquet shards) and `streams` (cursors, token streams, eval batches);
# for `dloco prepare`: `shards` (the format: manifest, shard files, checksums, the split reader), `encode`
# (the per-batch work an engine runs), `pipeline` (`prepare`: cutting, writing, resuming) and `tokens`
# (the `tokens:` source).

from dloco.data.corpus import (
    DEFAULT_BPE_VOCAB_SIZE,
    FORMAT_VERSION,
    SHARD_MAX_DOCS,
    SHARD_MAX_TOKENS,
    Corpus,
    Progress,
    Split,
    load_tokenizer,
    prepare_corpus,
    split_mask,
    unit_hash,
)
from dloco.data.pipeline import prepare
from dloco.data.shards import Manifest, ShardedTokens
from dloco.data.sources import read_documents
from dloco.data.streams import Cursor, ShardStream, TokenStream, eval_batches
from dloco.data.tokenizer import BPE_EOS_TOKEN, BYTE_EOS_ID, Tokenizer
from dloco.data.tokens import TokenCorpus, open_tokens

__all__ = [
    "BPE_EOS_TOKEN",
    "BYTE_EOS_ID",
    "DEFAULT_BPE_VOCAB_SIZE",
    "FORMAT_VERSION",
    "SHARD_MAX_DOCS",
    "SHARD_MAX_TOKENS",
    "Corpus",
    "Cursor",
    "Manifest",
    "Progress",
    "ShardStream",
    "ShardedTokens",
    "Split",
    "TokenCorpus",
    "TokenStream",
    "Tokenizer",
    "eval_batches",
    "load_tokenizer",
    "open_tokens",
    "prepare",
    "prepare_corpus",
    "read_documents",
    "split_mask",
    "unit_hash",
]
