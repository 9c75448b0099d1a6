"""The ``data.source=tokens:URI`` corpus: what ``dloco prepare`` wrote to URI, read as a `Corpus`
whose splits are `ShardedTokens` (learners stream them with `dloco.data.ShardStream`)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np

from dloco.data.corpus import Corpus, Split
from dloco.data.shards import MANIFEST, SPLITS, TOKENIZER, Location, Manifest, ShardedTokens, tokenizer_digest


@dataclasses.dataclass(frozen=True)
class TokenCorpus(Corpus):
    """A prepared corpus: ``key`` is its manifest's digest, ``path`` a local directory under the data
    cache holding its ``tokenizer.json`` (for a BPE), as a `Corpus` from `dloco.data.prepare_corpus`
    does; the tokens stay at ``uri``."""

    manifest: Manifest | None = None
    uri: str = ""

    def load_split(self, split: Split) -> ShardedTokens:
        """The split as `ShardedTokens`: its shards are opened (and verified) as they are read."""
        assert self.manifest is not None, "open_tokens builds a TokenCorpus with its manifest"
        return ShardedTokens(Location(self.uri), self.manifest.shards(split), np.dtype(self.manifest.dtype))

    def doc_ids(self, split: Split) -> list[str]:
        raise ValueError(f"tokens:{self.uri} keeps no document names (its manifest counts them: {split})")


def open_tokens(uri: str, cache_dir: str | os.PathLike) -> TokenCorpus:
    """Reads the manifest at `uri` and checks that every shard it names is there (their checksums are
    verified as each one is opened); a BPE's ``tokenizer.json`` is checked against the manifest's
    digest and copied to ``cache_dir/<key[:16]>/``.

    Raises:
      ValueError: one line: no manifest there, a damaged one, a missing shard or tokenizer.
    """
    loc = Location(uri)
    m = loc.manifest()
    if m is None:
        raise ValueError(
            f"data.source=tokens:{uri}: no {MANIFEST} there: write it with dloco prepare SOURCE --out {uri}"
        )
    names = loc.names()
    for split in SPLITS:
        for info in m.shards(split):
            if info.name not in names:
                raise ValueError(f"shard {loc.where(info.name)} is missing: re-run the same dloco prepare to redo it")
    key = m.digest
    path = Path(cache_dir).expanduser() / key[:16]
    if m.tokenizer["kind"] == "bpe":
        raw = loc.read(TOKENIZER)
        if raw is None or tokenizer_digest(raw) != m.tokenizer["digest"]:
            state = "missing" if raw is None else "not the one its manifest names"
            raise ValueError(f"{loc.where(TOKENIZER)} is {state}: re-run the same dloco prepare to redo it")
        mine = path / TOKENIZER
        if not mine.exists() or mine.read_bytes() != raw:
            Location(str(path)).write(TOKENIZER, raw)
    return TokenCorpus(
        path=path,
        vocab_size=int(m.tokenizer["vocab_size"]),
        eos_id=int(m.tokenizer["eos_id"]),
        tokenizer=str(m.tokenizer["kind"]),
        train_tokens=m.tokens("train"),
        val_tokens=m.tokens("val"),
        key=key,
        cached=True,
        manifest=m,
        uri=uri,
    )
