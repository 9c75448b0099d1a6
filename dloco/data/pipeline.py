"""``dloco prepare`` as a pipeline over an engine: a source's documents split by hash, tokenized and
written as fixed-size token shards, then a manifest (`dloco.data.shards`).

`prepare` lists the source, settles the tokenizer, and feeds the engine's encoded batches
(`dloco.data.encode`) in document order to one writer per split, which cuts shard k of a split
as its tokens ``[k·S, (k+1)·S)`` (S = ``shard_tokens``). The engine does the reading and the
tokenizing (Ray Data in ``dloco prepare``: `actors.prepare`; `local_engine` in one process); the
cutting and writing stay in the calling process, so the shards are the same whatever the engine.

Resuming. The journal ``progress.json``, rewritten after every shard, holds the digest of the inputs
(`fingerprint`), the tokenizer's digest, each file finished so far (its tokens and documents per
split, and the digest of its documents) and each shard written (name, tokens, checksum). A run
into a directory with a journal of the same inputs verifies the journal's shards (their
checksums, read from the files), finds the first shard of each split that fails (missing,
damaged, or never written) and reads the source again from the first file that contributes to
one of them (`resume_point`); the tokens of earlier files that such a shard needs are read back
from the intact shard before it. Every shard from there on is computed again and written unless
the file already there has the checksum it should have (then it is left alone, its mtime too):
nothing on disk is trusted because a journal names it. A directory holding a manifest or a
journal of other inputs, or shard files with neither, is refused, never overwritten.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from dloco.data.corpus import DEFAULT_BPE_VOCAB_SIZE, Progress
from dloco.data.encode import EncodedBatch, Encoder, Engine, local_engine, sample_texts
from dloco.data.shards import (
    DEFAULT_SHARD_TOKENS,
    FORMAT,
    JOURNAL,
    MANIFEST,
    SPLITS,
    TOKENIZER,
    Location,
    Manifest,
    ShardInfo,
    checksum,
    shard_bytes,
    shard_name,
    token_dtype,
    tokenizer_digest,
)
from dloco.data.sources import relative_name, source_files
from dloco.data.tokenizer import BYTE_EOS_ID, Tokenizer, train_bpe

DEFAULT_SAMPLE_BYTES = 32_000_000  # text a BPE is trained on (`Sampler`): never the whole corpus


@dataclasses.dataclass
class Journal:
    """What a run has finished (module docstring): ``files`` rows are ``[train tokens, val tokens,
    train documents, val documents, digest]`` of each finished file, in order."""

    input: str
    tokenizer: str
    sample: list[int] = dataclasses.field(default_factory=list)  # a trained BPE's [bytes, documents]
    files: list[list] = dataclasses.field(default_factory=list)
    shards: dict[str, list[ShardInfo]] = dataclasses.field(default_factory=lambda: {s: [] for s in SPLITS})

    def to_json(self) -> str:
        shards = {s: [i.to_list() for i in self.shards[s]] for s in SPLITS}
        d = dataclasses.asdict(self)
        return json.dumps({"format": FORMAT, **d, "shards": shards})

    @classmethod
    def from_json(cls, text: str) -> Journal | None:
        """The journal, or None if it cannot be read (then the run starts from the first file)."""
        try:
            d = json.loads(text)
            shards = {s: [ShardInfo.from_list(x) for x in d["shards"][s]] for s in SPLITS}
            return cls(str(d["input"]), str(d["tokenizer"]), list(d["sample"]), [list(r) for r in d["files"]], shards)
        except (ValueError, KeyError, TypeError):
            return None


def fingerprint(
    kind: str,
    files: Iterable[tuple[str, int, int]],
    text_field: str,
    tokenizer: Any,
    val_fraction: float,
    shard_tokens: int,
) -> str:
    """The digest of a run's inputs: the source's kind, its files (name relative to the source's root,
    size, mtime), the text field, the tokenizer asked for, the split and the shard size."""
    spec = {
        "format": FORMAT,
        "kind": kind,
        "files": [list(f) for f in files],
        "text_field": text_field,
        "tokenizer": tokenizer,
        "val_fraction": val_fraction,
        "shard_tokens": shard_tokens,
    }
    return hashlib.blake2b(json.dumps(spec, sort_keys=True).encode(), digest_size=16).hexdigest()


def resume_point(files: list[list], intact: dict[str, int], shard_tokens: int) -> int:
    """The first file to read again: the first that contributes a token to a shard not among a split's
    `intact` leading shards. Split X's first such shard starts at token ``P = intact[X]·S``; the file
    holding that token is the first whose cumulative count of X tokens exceeds P. Every file before
    the result contributes only to intact shards (or to the one a resumed writer reads back)."""
    first = len(files)
    for column, split in enumerate(SPLITS):
        ends = np.cumsum([int(r[column]) for r in files], dtype=np.int64)
        first = min(first, int(np.searchsorted(ends, intact[split] * shard_tokens, side="right")))
    return first


class _SplitWriter:
    """Cuts one split's token stream into shards of `shard_tokens`, from shard ``len(kept)`` on, the
    split's earlier tokens of that shard being `prefix`; a shard whose file already has the checksum it
    should have is not written again."""

    def __init__(
        self,
        split: str,
        loc: Location,
        shard_tokens: int,
        kept: list[ShardInfo],
        prefix: np.ndarray,
        existing: set[str],
    ):
        self.split, self.loc, self.size, self.existing = split, loc, shard_tokens, existing
        self.shards, self.pending, self.count = list(kept), [prefix], len(prefix)

    def add(self, tokens: np.ndarray, final: bool = False) -> bool:
        """Takes `tokens`; returns whether a shard was cut (`final`: the split's last, shorter one too)."""
        if len(tokens):
            self.pending.append(tokens)
            self.count += len(tokens)
        cut = False
        while self.count >= self.size or (final and self.count):
            flat = np.concatenate(self.pending)
            shard, rest = flat[: self.size], flat[self.size :]
            self.pending, self.count = [rest], len(rest)
            name = shard_name(self.split, len(self.shards))
            data = shard_bytes(shard)
            digest = checksum(data)
            if name not in self.existing or self.loc.checksum_of(name) != digest:
                self.loc.write(name, data)
            self.shards.append(ShardInfo(name, len(shard), digest))
            cut = True
        return cut


class _Run:
    """The writing side of a run: where it resumes (`resume_point`), the files it has finished, one
    `_SplitWriter` per split, and the journal it rewrites after every shard."""

    def __init__(
        self, loc: Location, journal: Journal, paths: list[str], shard_tokens: int, dtype: np.dtype, existing: set[str]
    ):
        self.loc, self.journal, self.dtype = loc, journal, dtype
        intact = {}
        for s in SPLITS:
            k, held = 0, journal.shards[s]
            while k < len(held) and loc.checksum_of(held[k].name) == held[k].checksum:
                k += 1
            intact[s] = k
        self.first = resume_point(journal.files, intact, shard_tokens)
        journal.files = journal.files[: self.first]
        self.writers = {}
        for column, s in enumerate(SPLITS):
            position = sum(int(r[column]) for r in journal.files)
            k0 = position // shard_tokens
            prefix = np.zeros(0, dtype)
            if position > k0 * shard_tokens:  # shard k0 is intact (`resume_point`): its head is these files'
                prefix = np.array(loc.load(journal.shards[s][k0], dtype)[: position - k0 * shard_tokens])
            self.writers[s] = _SplitWriter(s, loc, shard_tokens, journal.shards[s][:k0], prefix, existing)
        self.index = {p: i for i, p in enumerate(paths)}
        self.file, self.counts, self.hash = self.first, [0, 0, 0, 0], hashlib.blake2b(digest_size=16)

    def _finish_files(self, upto: int) -> None:
        """Files before `upto` are finished (one the engine never named held no document)."""
        while self.file < upto:
            self.journal.files.append([*self.counts, self.hash.hexdigest()])
            self.file, self.counts, self.hash = self.file + 1, [0, 0, 0, 0], hashlib.blake2b(digest_size=16)

    def _save(self) -> None:
        self.journal.shards = {s: list(w.shards) for s, w in self.writers.items()}
        self.loc.write(JOURNAL, self.journal.to_json().encode())

    def feed(self, b: EncodedBatch) -> None:
        start = 0
        for path, n in b.runs:
            i = self.index.get(path, self.index.get(path.split("://", 1)[-1], -1))
            if i < self.file:
                raise RuntimeError(f"the engine gave {path} out of order (or a file not of the source)")
            self._finish_files(i)
            val, lengths = b.val[start : start + n], b.lengths[start : start + n]
            self.counts[0] += int(lengths[~val].sum())
            self.counts[1] += int(lengths[val].sum())
            self.counts[2] += int((~val).sum())
            self.counts[3] += int(val.sum())
            self.hash.update(b.digests[16 * start : 16 * (start + n)])
            start += n
        mask = np.repeat(b.val, b.lengths)
        cut = self.writers["train"].add(b.tokens[~mask])
        if self.writers["val"].add(b.tokens[mask]) or cut:
            self._save()

    def close(self, files: int) -> np.ndarray:
        """Finishes the files and the splits' last shards; returns [train tokens, val tokens, train
        documents, val documents]."""
        self._finish_files(files)
        for w in self.writers.values():
            w.add(np.zeros(0, self.dtype), final=True)
        self._save()
        return np.array([r[:4] for r in self.journal.files], dtype=np.int64).reshape(-1, 4).sum(axis=0)


def _stat(paths: list[str], root: str, fs: Any) -> list[tuple[str, int, int]]:
    """(name, size, mtime ns) of each file; PermissionError for a local file that cannot be read."""
    out = []
    if fs is None:
        for p in paths:
            if not os.access(p, os.R_OK):
                raise PermissionError(13, "Permission denied", p)
            st = os.stat(p)
            out.append((relative_name(p, root), st.st_size, st.st_mtime_ns))
        return out
    for p, info in zip(paths, fs.get_file_info(paths), strict=True):
        out.append((relative_name(p, root), int(info.size or 0), int(info.mtime_ns or 0)))
    return out


def _asked(tokenizer: str, vocab_size: int, sample_bytes: int) -> tuple[Any, bytes | None]:
    """The tokenizer asked for, as the fingerprint records it, and a ``file:``'s content."""
    if tokenizer.startswith("file:"):
        path = Path(tokenizer[5:]).expanduser()
        Tokenizer.from_file(path)  # it loads and has an EOS, else ValueError
        raw = path.read_bytes()
        return {"file": tokenizer_digest(raw)}, raw
    if tokenizer == "bpe":
        if vocab_size < 257:
            raise ValueError(f"--vocab-size={vocab_size} is too small (a BPE over bytes needs >= 257)")
        return {"bpe": vocab_size, "sample_bytes": sample_bytes}, None
    if tokenizer == "byte":
        return "byte", None
    raise ValueError(f"--tokenizer must be byte, bpe or file:PATH (a tokenizer.json), got {tokenizer!r}")


def _existing(
    loc: Location, out: str, names: dict, fp: str, report: Progress
) -> tuple[Manifest | None, Journal | None]:
    """What ``out`` holds of this run: its manifest if every shard of it verifies, and its journal.
    Raises ValueError (one line) for a manifest or journal of other inputs, or stray shard files."""
    manifest = loc.manifest() if MANIFEST in names else None
    raw = loc.read(JOURNAL) if JOURNAL in names else None
    journal = Journal.from_json(raw.decode("utf-8", errors="replace")) if raw else None
    if raw and journal is None:
        raise _refuse(out, f"a {JOURNAL} that cannot be read (not one dloco prepare wrote)")
    if manifest is not None and manifest.input != fp:
        raise _refuse(out, "a manifest of other data", manifest)
    if journal is not None and journal.input != fp:
        raise _refuse(out, "a half-written dloco prepare of other data")
    if manifest is None and journal is None and any(n.endswith(".npy") for n in names):
        raise _refuse(out, "shard files that no manifest or journal of dloco prepare describes")
    if manifest is not None:
        shards = [i for s in SPLITS for i in manifest.shards(s)]
        bad = 0
        for n, info in enumerate(shards):
            report("verifying", n, len(shards))
            bad += loc.checksum_of(info.name) != info.checksum
        report("verifying", len(shards), len(shards))
        manifest = None if bad else manifest
    return manifest, journal


def _refuse(out: str, what: str, m: Manifest | None = None) -> ValueError:
    held = f" (source {m.source!r}, {m.files} files, tokenizer {m.tokenizer['kind']})" if m else ""
    return ValueError(f"--out {out} holds {what}{held}: choose another --out, or remove it to prepare there")


def prepare(
    source: str,
    out: str,
    *,
    tokenizer: str = "byte",
    vocab_size: int | None = None,
    tokenizer_sample_bytes: int = DEFAULT_SAMPLE_BYTES,
    val_fraction: float = 0.05,
    text_field: str = "text",
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    engine: Engine | None = None,
    progress: Progress | None = None,
) -> Manifest:
    """Prepares ``source`` into the directory ``out`` (a path or a URI) as token shards and a manifest;
    resumes a run cut short, and returns at once (after verifying every shard) when ``out`` holds
    this preparation already.

    Args:
      source: ``stdlib``, ``shakespeare``, ``text:GLOB``, ``jsonl:GLOB`` or ``parquet:GLOB`` (a text column).
      out: the output directory.
      tokenizer: ``byte``, ``bpe`` (trained on at most `tokenizer_sample_bytes` of training documents,
        each taken with probability ``tokenizer_sample_bytes / source bytes`` by a hash) or ``file:PATH``.
      vocab_size: the BPE's vocabulary (default 4096). val_fraction: in (0, 1).
      text_field: the JSON field or Parquet column of a document's text.
      shard_tokens: tokens per shard. engine: `local_engine` unless given (Ray Data: `actors.prepare`).
      progress: called as ``progress(stage, done, total)``: listing, sampling, training tokenizer,
        verifying (shards), tokenizing (bytes of documents), done.

    Raises:
      ValueError, OSError: one line; a bad argument, an unreadable source, an ``out`` of other data.
    """
    engine = engine or local_engine
    report: Progress = progress or (lambda stage, done, total: None)
    vocab_size = vocab_size or DEFAULT_BPE_VOCAB_SIZE
    if not 0 < val_fraction < 1:
        raise ValueError(f"--val-fraction must be in (0, 1), got {val_fraction}")
    if shard_tokens < 1 or tokenizer_sample_bytes < 1:
        raise ValueError(
            f"--shard-tokens and --tokenizer-sample-bytes must be >= 1, got {shard_tokens}, {tokenizer_sample_bytes}"
        )
    report("listing", 0, 1)
    kind, paths, root, fs = source_files(source)
    if kind == "parquet":
        import pyarrow.parquet as pq

        if "tokens" in pq.read_schema(paths[0], filesystem=fs).names:
            raise ValueError(f"{paths[0]}: a 'tokens' column is tokenized already: train on it as data.source={source}")
    files = _stat(paths, root, fs)
    total_bytes = sum(f[1] for f in files)
    report("listing", 1, 1)
    spec, raw_tokenizer = _asked(tokenizer, vocab_size, tokenizer_sample_bytes)
    fp = fingerprint(kind, files, text_field, spec, val_fraction, shard_tokens)
    loc = Location(out)
    names = loc.names()
    complete, journal = _existing(loc, out, names, fp, report)
    if complete is not None:
        return complete

    # the tokenizer: bytes, the given file, the BPE a journal of these inputs names, or a new BPE
    origin = "byte" if tokenizer == "byte" else "file" if raw_tokenizer is not None else "trained"
    sample: list[int] = []
    if tokenizer == "bpe":
        held = loc.read(TOKENIZER) if TOKENIZER in names else None
        if held is not None and journal is not None and tokenizer_digest(held) == journal.tokenizer:
            raw_tokenizer, sample = held, journal.sample
        else:
            rate = min(1.0, tokenizer_sample_bytes / max(total_bytes, 1))
            report("sampling", 0, 1)
            texts = sample_texts(engine, kind, paths, fs, text_field, val_fraction, rate, tokenizer_sample_bytes)
            report("sampling", 1, 1)
            report("training tokenizer", 0, 1)
            raw_tokenizer = train_bpe(texts, vocab_size)._backend.to_str().encode("utf-8")
            report("training tokenizer", 1, 1)
            sample = [sum(len(t.encode("utf-8")) for t in texts), len(texts)]
    if raw_tokenizer is not None:
        tok = Tokenizer("bpe", _hf_from_str(raw_tokenizer.decode("utf-8")))
        vocab, eos = tok.vocab_size, tok.eos_id
        if loc.read(TOKENIZER) != raw_tokenizer:
            loc.write(TOKENIZER, raw_tokenizer)
    else:
        vocab, eos = BYTE_EOS_ID + 1, BYTE_EOS_ID
    tok_digest = tokenizer_digest(raw_tokenizer) if raw_tokenizer is not None else "byte"
    dtype = token_dtype(vocab)

    if journal is None or journal.tokenizer != tok_digest:
        journal = Journal(fp, tok_digest, sample)
    run = _Run(loc, journal, paths, shard_tokens, dtype, set(names))
    done_bytes = 0
    report("tokenizing", 0, total_bytes)
    kwargs = {
        "kind": kind,
        "text_field": text_field,
        "val_fraction": val_fraction,
        "dtype": dtype.name,
        "tokenizer_json": raw_tokenizer.decode("utf-8") if raw_tokenizer is not None else None,
    }
    for out_batch in engine(kind, paths[run.first :], fs, text_field, Encoder, kwargs):
        for b in EncodedBatch.rows(out_batch, dtype):
            run.feed(b)
            done_bytes += b.nbytes
            report("tokenizing", min(done_bytes, total_bytes), total_bytes)
    counts = run.close(len(paths))
    report("tokenizing", total_bytes, total_bytes)
    if not counts[2] or not counts[3]:
        empty = "training" if not counts[2] else "validation"
        raise ValueError(
            f"data.source={source}: no document fell in the {empty} split ({int(counts[2] + counts[3])} documents, "
            f"--val-fraction={val_fraction}): use a corpus of more documents, or another --val-fraction"
        )
    documents = hashlib.blake2b(digest_size=32)
    for (name, _, _), r in zip(files, journal.files, strict=True):
        documents.update(json.dumps([name, r[4]]).encode())
    tokenizer_info = {
        "kind": "byte" if raw_tokenizer is None else "bpe",
        "from": origin,
        "digest": tok_digest,
        "vocab_size": vocab,
        "eos_id": eos,
        "asked": spec,
        "sample": sample,
    }
    manifest = Manifest(
        source=source,
        input=fp,
        documents=documents.hexdigest(),
        files=len(files),
        input_bytes=total_bytes,
        tokenizer=tokenizer_info,
        dtype=dtype.name,
        shard_tokens=shard_tokens,
        val_fraction=val_fraction,
        splits={
            s: {"tokens": int(counts[c]), "documents": int(counts[2 + c]), "shards": run.writers[s].shards}
            for c, s in enumerate(SPLITS)
        },
    )
    loc.write(MANIFEST, manifest.to_json().encode())
    report("done", 1, 1)
    return manifest


def _hf_from_str(text: str):
    from tokenizers import Tokenizer as HFTokenizer

    return HFTokenizer.from_str(text)
