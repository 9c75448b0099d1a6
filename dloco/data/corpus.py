"""A corpus split by document hash into train/validation, tokenized and cached as Parquet shards
(with document names) plus one flat Arrow IPC file per split that learners memory-map."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal, cast

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dloco.data.sources import read_documents
from dloco.data.tokenizer import Tokenizer, train_bpe

if TYPE_CHECKING:
    from dloco.data.shards import ShardedTokens

FORMAT_VERSION = 1
DEFAULT_BPE_VOCAB_SIZE = 4096
SHARD_MAX_DOCS = 1024
SHARD_MAX_TOKENS = 4_000_000

Split = Literal["train", "val"]
# progress(stage, done, total) while a corpus is prepared: "reading" (files), "training tokenizer"
# (0 of 1, then 1 of 1), "tokenizing" (documents), "writing" (splits)
Progress = Callable[[str, int, int], None]
TOKENIZE_CHUNK = 512  # documents per batch encode (one progress report each)


def _content_digest(content: bytes | np.ndarray) -> bytes:
    data = content if isinstance(content, bytes) else content.astype("<i8").tobytes()
    return hashlib.blake2b(data, digest_size=16).digest()


def unit_hash(digest: bytes) -> float:
    """Maps a digest to ``u ∈ [0, 1)``: the top 53 bits of its first 8 bytes (big-endian) / 2**53."""
    return (int.from_bytes(digest[:8], "big") >> 11) / 2.0**53


def split_mask(unit_hashes: Sequence[float], val_fraction: float) -> np.ndarray:
    """Validation mask ``u_i < val_fraction``, fixed up so that neither split is left empty.

    With ``n >= 1`` documents train is non-empty: if every document fell in validation, the
    one with the largest ``u`` moves to train. With ``n >= 2`` validation is non-empty: if no
    document fell there, the one with the smallest ``u`` moves there. Ties go by index.
    """
    u = np.asarray(unit_hashes, dtype=np.float64)
    is_val = u < val_fraction
    order = np.argsort(u, kind="stable")
    if u.size >= 1 and is_val.all():
        is_val[order[-1]] = False
    if u.size >= 2 and not is_val.any():
        is_val[order[0]] = True
    return is_val


def _token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.int32)


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A tokenized corpus in ``path`` (``train-*.parquet``, ``val-*.parquet``, ``meta.json``).

    ``tokenizer`` is ``"byte"``, ``"bpe"`` or ``"pretokenized"`` (then ``eos_id`` is -1: the
    documents are stored as given). ``cached`` says whether this call found it on disk.
    """

    path: Path
    vocab_size: int
    eos_id: int
    tokenizer: str
    train_tokens: int
    val_tokens: int
    key: str
    cached: bool

    def _shards(self, split: Split) -> list[Path]:
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        return sorted(self.path.glob(f"{split}-*.parquet"))

    def load_split(self, split: Split) -> np.ndarray | ShardedTokens:
        """Returns the split's tokens as one flat read-only array (documents in order, each ending in
        EOS), memory-mapped from ``{split}.arrow``: learners on one node share the page cache instead
        of each holding a copy. A cache written before that file existed gets it here (from the
        Parquet shards); a cache that cannot be written is read into memory instead. (A ``tokens:``
        corpus, `dloco.data.TokenCorpus`, returns `ShardedTokens`, read a range at a time.)"""
        shards = self._shards(split)
        flat = self.path / f"{split}.arrow"
        if not flat.exists():
            tokens = self._read_shards(shards)
            try:
                _write_flat(flat, tokens)
            except OSError:
                return tokens
        column = pa.ipc.open_file(pa.memory_map(str(flat), "r")).get_batch(0).column(0)
        return column.to_numpy(zero_copy_only=True)

    def _read_shards(self, shards: list[Path]) -> np.ndarray:
        parts = []
        for shard in shards:
            column = pq.read_table(shard, columns=["tokens"]).column("tokens")
            parts += [chunk.flatten().to_numpy(zero_copy_only=False) for chunk in column.chunks]
        if not parts:
            return np.zeros(0, _token_dtype(self.vocab_size))
        return np.concatenate(parts).astype(_token_dtype(self.vocab_size), copy=False)

    def doc_ids(self, split: Split) -> list[str]:
        """Returns the split's document names in order."""
        return [
            d for s in self._shards(split) for d in pq.read_table(s, columns=["doc_id"]).column("doc_id").to_pylist()
        ]


def load_tokenizer(corpus: Corpus) -> Tokenizer:
    """Returns the tokenizer that produced ``corpus``."""
    if corpus.tokenizer == "byte":
        return Tokenizer.byte()
    if corpus.tokenizer == "bpe":
        return Tokenizer.from_file(corpus.path / "tokenizer.json")
    raise ValueError(f"corpus {corpus.path} is pre-tokenized and has no tokenizer")


def _read_meta(path: Path, cached: bool) -> Corpus:
    meta = json.loads((path / "meta.json").read_text())
    return Corpus(
        path=path,
        vocab_size=meta["vocab_size"],
        eos_id=meta["eos_id"],
        tokenizer=meta["tokenizer"],
        train_tokens=meta["train_tokens"],
        val_tokens=meta["val_tokens"],
        key=meta["key"],
        cached=cached,
    )


def _write_flat(path: Path, tokens: np.ndarray) -> None:
    """Writes ``tokens`` as one uncompressed Arrow IPC record batch (column ``tokens``), atomically."""
    batch = pa.record_batch([pa.array(tokens)], names=["tokens"])
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, batch.schema) as writer:
        writer.write_batch(batch)
    os.replace(tmp, path)


def _write_split(out: Path, split: str, names: list[str], ids: list[np.ndarray], dtype) -> int:
    """Writes shards of at most SHARD_MAX_DOCS docs / ~SHARD_MAX_TOKENS tokens; returns tokens."""
    groups, start, count = [], 0, 0
    for i, doc in enumerate(ids):
        if i > start and (i - start >= SHARD_MAX_DOCS or count + len(doc) > SHARD_MAX_TOKENS):
            groups.append((start, i))
            start, count = i, 0
        count += len(doc)
    groups.append((start, len(ids)))  # an empty split still gets one (empty) shard
    schema = pa.schema([("doc_id", pa.string()), ("tokens", pa.list_(pa.from_numpy_dtype(dtype)))])
    for shard, (lo, hi) in enumerate(groups):
        lengths = [len(d) for d in ids[lo:hi]]
        offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int32)
        values = np.concatenate(ids[lo:hi]).astype(dtype) if hi > lo else np.zeros(0, dtype)
        tokens = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
        table = pa.table({"doc_id": pa.array(names[lo:hi], pa.string()), "tokens": tokens}, schema=schema)
        pq.write_table(table, out / f"{split}-{shard:05d}.parquet")
    _write_flat(out / f"{split}.arrow", np.concatenate(ids).astype(dtype) if ids else np.zeros(0, dtype))
    return int(sum(len(d) for d in ids))


def prepare_corpus(
    source: str = "stdlib",
    *,
    tokenizer: str = "byte",
    vocab_size: int | None = None,
    val_fraction: float = 0.05,
    max_bytes: int = 0,
    cache_dir: str | os.PathLike,
    text_field: str = "text",
    given_tokenizer: bytes | None = None,
    progress: Progress | None = None,
) -> Corpus:
    """Reads, splits, tokenizes and caches a corpus; returns the cached one if present.

    Document ``i`` goes to validation iff ``u_i < val_fraction``, where ``u_i ∈ [0, 1)`` is the
    :func:`unit_hash` of the blake2b-128 digest of its content (UTF-8 bytes, or little-endian
    int64 ids), adjusted by :func:`split_mask`. Identical documents therefore land in the same
    split. The BPE tokenizer is trained on the train documents only. The cache key is a
    blake2b hash of ``FORMAT_VERSION``, the arguments and every selected document's name and
    content digest; shards are written to a temporary sibling directory and renamed into place.

    Args:
      source: see :func:`read_documents`.
      tokenizer: ``"byte"``, ``"bpe"`` (trained here on the train documents) or ``"file:PATH"``
        (a pretrained HF ``tokenizer.json``, copied into the corpus); ignored for a ``tokens`` column.
      vocab_size: BPE vocabulary size (default 4096); for pre-tokenized documents an upper
        bound on the ids (default ``max id + 1``); unused for ``"byte"``.
      val_fraction: expected fraction of documents in validation, in ``[0, 1)``.
      max_bytes: corpus size limit, 0 for none (see :func:`read_documents`).
      cache_dir: directory holding one ``<key[:16]>`` subdirectory per corpus.
      text_field: the JSON field or Parquet column of a document's text (see :func:`read_documents`;
        the key covers every document's content, so another field is another corpus).
      given_tokenizer: the ``tokenizer.json`` another process prepared (a run's driver): used
        instead of training a BPE here, or instead of reading ``file:PATH`` (which then need not
        exist here), so that every node tokenizes with the same ids. ``meta.json`` records
        ``tokenizer_from``: ``"trained"``, ``"file"`` or ``"given"``.
      progress: called as ``progress(stage, done, total)`` while the corpus is prepared (`Progress`).

    Returns:
      The :class:`Corpus`; ``cached`` is True when nothing was tokenized.

    Raises:
      ValueError: a bad argument. FileNotFoundError: the source has no files.
    """
    pretrained = None
    if tokenizer.startswith("file:"):  # a pretrained tokenizer.json: the corpus is keyed by its content
        if given_tokenizer is None:
            Tokenizer.from_file(Path(tokenizer[5:]).expanduser())  # loads, and has an EOS (else ValueError)
        pretrained = given_tokenizer or Path(tokenizer[5:]).expanduser().read_bytes()
    elif tokenizer not in ("byte", "bpe"):
        raise ValueError(f"tokenizer must be 'byte', 'bpe' or 'file:PATH' (a tokenizer.json), got {tokenizer!r}")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0 (0 = no limit), got {max_bytes}")
    docs = read_documents(source, max_bytes, text_field, progress)
    pretokenized = isinstance(docs[0][1], np.ndarray)
    if tokenizer == "bpe" and not pretokenized and vocab_size is None:
        vocab_size = DEFAULT_BPE_VOCAB_SIZE
    if vocab_size is not None and vocab_size < (257 if tokenizer == "bpe" and not pretokenized else 1):
        raise ValueError(f"vocab_size={vocab_size} is too small (BPE needs >= 257)")
    digests = [_content_digest(content) for _, content in docs]
    header = {
        "format_version": FORMAT_VERSION,
        "source": source,
        "val_fraction": val_fraction,
        "tokenizer": "pretokenized" if pretokenized else tokenizer,
        "max_bytes": max_bytes,
        "vocab_size": None if tokenizer == "byte" and not pretokenized else vocab_size,
    }
    if pretrained is not None and not pretokenized:  # its content, not its path, names the corpus
        header["tokenizer"] = "file:" + hashlib.blake2b(pretrained, digest_size=16).hexdigest()
        header["vocab_size"] = None
    h = hashlib.blake2b(json.dumps(header, sort_keys=True).encode(), digest_size=32)
    for (name, _), digest in zip(docs, digests, strict=True):
        encoded = name.encode("utf-8", errors="surrogatepass")
        h.update(len(encoded).to_bytes(8, "big") + encoded + digest)
    key = h.hexdigest()

    cache_dir = Path(cache_dir)
    final = cache_dir / key[:16]
    if (final / "meta.json").exists():
        return _read_meta(final, cached=True)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key[:16]}-", dir=cache_dir))
    try:
        is_val = split_mask([unit_hash(d) for d in digests], val_fraction)
        ids: list[np.ndarray]
        if pretokenized:  # read_documents gives one kind per source: all id arrays here, all bytes below
            ids = [cast(np.ndarray, content) for _, content in docs]
            vocab = max(int(d.max()) + 1 if d.size else 0 for d in ids)
            if vocab_size is not None and vocab > vocab_size:
                raise ValueError(f"token id {vocab - 1} does not fit vocab_size={vocab_size}")
            vocab, eos_id = vocab_size or vocab, -1
        else:
            texts = [cast(bytes, content).decode("utf-8") for _, content in docs]
            origin = "given" if given_tokenizer is not None else "file" if pretrained is not None else "trained"
            pretrained = given_tokenizer if tokenizer == "bpe" else pretrained
            if tokenizer == "byte":
                tok, origin = Tokenizer.byte(), "byte"
            elif pretrained is not None:
                (tmp / "tokenizer.json").write_bytes(pretrained)
                tok = Tokenizer.from_file(tmp / "tokenizer.json")
            else:
                assert vocab_size is not None  # set to DEFAULT_BPE_VOCAB_SIZE above
                _report(progress, "training tokenizer", 0, 1)
                tok = train_bpe([t for t, v in zip(texts, is_val, strict=True) if not v], vocab_size)
                tok._backend.save(str(tmp / "tokenizer.json"))
                _report(progress, "training tokenizer", 1, 1)
            ids = []
            for lo in range(0, len(texts), TOKENIZE_CHUNK):
                ids += tok._encode_documents(texts[lo : lo + TOKENIZE_CHUNK])
                _report(progress, "tokenizing", len(ids), len(texts))
            vocab, eos_id = tok.vocab_size, tok.eos_id
        dtype = _token_dtype(vocab)
        meta = {"key": key, **header, "vocab_size": vocab, "eos_id": eos_id, "dtype": dtype.name}
        if not pretokenized:
            meta["tokenizer_from"] = origin
        if pretrained is not None and not pretokenized:
            meta["tokenizer"], meta["pretrained"] = "bpe", header["tokenizer"]  # read back as tokenizer.json
        for split, mask in (("train", ~is_val), ("val", is_val)):
            index = np.flatnonzero(mask)
            names = [docs[i][0] for i in index]
            meta[f"{split}_tokens"] = _write_split(tmp, split, names, [ids[i] for i in index], dtype)
            meta[f"{split}_docs"] = len(index)
            _report(progress, "writing", 1 + (split == "val"), 2)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "meta.json").exists():
                raise
            # A concurrent writer got there first; its output is identical.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _read_meta(final, cached=False)


def _report(progress: Progress | None, stage: str, done: int, total: int) -> None:
    if progress is not None:
        progress(stage, done, total)
