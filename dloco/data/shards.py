"""Token shards: what ``dloco prepare`` writes and ``data.source=tokens:URI`` reads.

A prepared corpus is a directory (a local path or a URI: ``file://``, ``s3://``, ``gs://``,
``hdfs://``, read and written through `pyarrow.fs`) holding

- ``train-00000.npy``, ``train-00001.npy``, …, ``val-00000.npy``, …: each split's tokens in
  document order (each document ending in EOS), cut into shards of ``shard_tokens`` tokens (the
  last one of a split shorter), as ``.npy`` arrays of uint16, or uint32 for a vocabulary over 65536;
- ``tokenizer.json``: the BPE tokenizer (none for bytes);
- ``progress.json``: the journal that lets a run resume (`dloco.data.pipeline`);
- ``manifest.json``, written last: the `Manifest`. A directory without one is not a corpus yet.

Every shard's XXH3-128 checksum (of the whole file) is in the manifest, and a shard is verified
each time it is opened (`Location.load`): a damaged or missing one is a one-line error naming it,
and nothing of it is read as tokens.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

from dloco import durable

FORMAT = "dloco-tokens/1"
MANIFEST = "manifest.json"
JOURNAL = "progress.json"
TOKENIZER = "tokenizer.json"
DEFAULT_SHARD_TOKENS = 1 << 24  # 32 MiB of uint16 per shard
SPLITS = ("train", "val")


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 for a vocabulary of at most 65536 ids, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.uint32)


def checksum(data: bytes | np.ndarray) -> str:
    """XXH3-128 of `data` (bytes, or a contiguous array's memory) as hex: what the manifest records of
    every shard file."""
    return xxhash.xxh3_128_hexdigest(data if isinstance(data, bytes) else data.data)


def tokenizer_digest(raw: bytes) -> str:
    """The digest of a ``tokenizer.json`` (as `dloco.build.corpus_identity` computes it)."""
    return hashlib.blake2b(raw, digest_size=16).hexdigest()


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.npy"


def shard_bytes(tokens: np.ndarray) -> bytes:
    """The ``.npy`` file of `tokens`, as written (its checksum is the shard's)."""
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.ascontiguousarray(tokens), allow_pickle=False)
    return buf.getvalue()


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    """One shard file: its name, token count and XXH3-128 checksum."""

    name: str
    tokens: int
    checksum: str

    def to_list(self) -> list:
        return [self.name, self.tokens, self.checksum]

    @classmethod
    def from_list(cls, x: Sequence) -> ShardInfo:
        name, tokens, digest = x
        return cls(str(name), int(tokens), str(digest))


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What a prepared corpus holds, and where it came from.

    ``input`` is the digest of the inputs (`dloco.data.pipeline.fingerprint`: the source's files, their
    sizes and times, the tokenizer asked for and the settings), by which a second ``dloco prepare``
    into the same directory tells the same data from other data; ``documents`` the digest of every
    document's content, in order. Documents are split as `dloco.data.prepare_corpus` splits them
    (validation iff `unit_hash` of the blake2b-128 digest of the document's UTF-8 bytes is below
    ``val_fraction``), without its fix-up for a split left empty: ``dloco prepare`` refuses that.
    ``digest`` (of everything else) is the corpus key that a run's fingerprint and the learners'
    corpus check compare.
    """

    source: str
    input: str
    documents: str
    files: int
    input_bytes: int
    tokenizer: dict[str, Any]  # kind (byte | bpe), from (byte | file | trained), digest, vocab_size, eos_id
    dtype: str
    shard_tokens: int
    val_fraction: float
    splits: dict[str, dict[str, Any]]  # split → {"tokens", "documents", "shards": [ShardInfo]}

    def shards(self, split: str) -> list[ShardInfo]:
        if split not in SPLITS:
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        return list(self.splits[split]["shards"])

    def tokens(self, split: str) -> int:
        return int(self.splits[split]["tokens"])

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["splits"] = {s: {**self.splits[s], "shards": [i.to_list() for i in self.shards(s)]} for s in SPLITS}
        return {"format": FORMAT, **d}

    @property
    def digest(self) -> str:
        return hashlib.blake2b(json.dumps(self.to_dict(), sort_keys=True).encode(), digest_size=32).hexdigest()

    def to_json(self) -> str:
        return json.dumps({**self.to_dict(), "digest": self.digest}, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: str) -> Manifest:
        """Parses a manifest; ValueError (one line naming `where`) if it is not one, or damaged."""
        try:
            d = json.loads(text)
            if d.pop("format", None) != FORMAT:
                raise ValueError(f"not a {FORMAT} manifest")
            stated = d.pop("digest")
            splits = {
                s: {**d["splits"][s], "shards": [ShardInfo.from_list(x) for x in d["splits"][s]["shards"]]}
                for s in SPLITS
            }
            m = cls(**{**d, "splits": splits})
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{where}: not a manifest of dloco prepare ({' '.join(str(e).split())})") from None
        if m.digest != stated:
            raise ValueError(f"{where}: the manifest is damaged (its digest does not match): run dloco prepare again")
        return m


class Location:
    """A directory of shards: a local path or a URI, through `pyarrow.fs` (local files are also
    memory-mapped when read)."""

    def __init__(self, uri: str):
        import pyarrow.fs as pafs

        self.uri = uri
        if "://" in uri:
            self.fs, self.root = pafs.FileSystem.from_uri(uri)
        else:
            self.fs, self.root = pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri))
        self.local = isinstance(self.fs, pafs.LocalFileSystem)

    def path(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{name}"

    def where(self, name: str) -> str:
        """`name` as the user named the directory, for messages."""
        return f"{self.uri.rstrip('/')}/{name}"

    def names(self) -> dict[str, tuple[int, int]]:
        """The files in the directory: name → (size, mtime in ns); empty if it does not exist."""
        import pyarrow.fs as pafs

        try:
            infos = self.fs.get_file_info(pafs.FileSelector(self.root, allow_not_found=True))
        except (FileNotFoundError, NotADirectoryError):
            return {}
        return {
            os.path.basename(i.path): (int(i.size or 0), int(i.mtime_ns or 0))
            for i in infos
            if i.type == pafs.FileType.File
        }

    def read(self, name: str) -> bytes | None:
        """The file's bytes, or None if it does not exist."""
        try:
            with self.fs.open_input_stream(self.path(name)) as f:
                return f.read()
        except FileNotFoundError:
            return None
        except OSError as e:  # pyarrow raises a bare OSError for a missing file on some filesystems
            if "not found" in str(e).lower() or "no such file" in str(e).lower():
                return None
            raise

    def write(self, name: str, data: bytes) -> None:
        """Writes the file whole. Local: `durable.replace_bytes` into a `durable.mkdir` directory (a
        fresh 0600 temporary file that no planted link redirects, fsynced, renamed; directories
        0700: the corpus is its user's); elsewhere in one upload (an object store writes an object
        atomically)."""
        if self.local:
            durable.mkdir(self.root)
            durable.replace_bytes(self.path(name), data)
            return
        self.fs.create_dir(self.root, recursive=True)
        with self.fs.open_output_stream(self.path(name)) as f:
            f.write(data)

    def checksum_of(self, name: str) -> str | None:
        """The checksum of the file as it is now, or None if it does not exist."""
        if self.local:
            try:
                if os.path.getsize(self.path(name)) == 0:
                    return checksum(b"")
                return checksum(np.memmap(self.path(name), np.uint8, "r"))
            except FileNotFoundError:
                return None
        data = self.read(name)
        return None if data is None else checksum(data)

    def load(self, info: ShardInfo, dtype: np.dtype) -> np.ndarray:
        """The shard's tokens (read-only; memory-mapped when local), after its checksum is verified.

        Raises:
          ValueError: one line naming the shard: missing, damaged, or not of the manifest's shape.
        """
        redo = "re-run the same dloco prepare to redo it"
        got = self.checksum_of(info.name)
        if got is None:
            raise ValueError(f"shard {self.where(info.name)} is missing: {redo}")
        if got != info.checksum:
            raise ValueError(
                f"shard {self.where(info.name)} is damaged (XXH3-128 {got[:16]}…, the manifest says "
                f"{info.checksum[:16]}…): {redo}"
            )
        if self.local:
            tokens = np.load(self.path(info.name), mmap_mode="r", allow_pickle=False)
        else:
            tokens = np.load(io.BytesIO(self.read(info.name) or b""), allow_pickle=False)
            tokens.flags.writeable = False
        if tokens.dtype != dtype or tokens.shape != (info.tokens,):
            raise ValueError(
                f"shard {self.where(info.name)} holds {tokens.dtype}{list(tokens.shape)}, the manifest says "
                f"{dtype}[{info.tokens}]: {redo}"
            )
        return tokens

    def manifest(self) -> Manifest | None:
        raw = self.read(MANIFEST)
        return None if raw is None else Manifest.from_json(raw.decode("utf-8", errors="replace"), self.where(MANIFEST))


class ShardedTokens:
    """One split of a prepared corpus as one flat token sequence, without holding it: `read` opens
    the shards a range touches (verifying each, `Location.load`) and keeps the last `keep` open, so a
    reader that moves forward holds a few shards (memory-mapped when local) whatever the corpus size.

    Args:
      location: the corpus directory. shards: the split's shards, in order. dtype: their token dtype.
      keep: shards kept open.
    """

    def __init__(self, location: Location, shards: Sequence[ShardInfo], dtype: np.dtype, keep: int = 4):
        self.location, self.shards, self.dtype, self.keep = location, list(shards), np.dtype(dtype), keep
        self._ends = np.cumsum([s.tokens for s in self.shards], dtype=np.int64)
        self._open: OrderedDict[int, np.ndarray] = OrderedDict()

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def locate(self, position: int) -> tuple[str, int]:
        """The shard holding token `position` and the offset of that token in it."""
        if not 0 <= position < len(self):
            raise IndexError(f"token {position} is outside the split's {len(self)} tokens")
        k = int(np.searchsorted(self._ends, position, side="right"))
        return self.shards[k].name, position - (int(self._ends[k - 1]) if k else 0)

    def _shard(self, k: int) -> np.ndarray:
        if k in self._open:
            self._open.move_to_end(k)
            return self._open[k]
        tokens = self.location.load(self.shards[k], self.dtype)
        self._open[k] = tokens
        while len(self._open) > self.keep:
            self._open.popitem(last=False)
        return tokens

    def read(self, lo: int, hi: int) -> np.ndarray:
        """Tokens ``[lo, hi)`` of the split, as a new array."""
        if not 0 <= lo <= hi <= len(self):
            raise IndexError(f"tokens [{lo}, {hi}) are outside the split's {len(self)} tokens")
        parts = []
        k = int(np.searchsorted(self._ends, lo, side="right"))
        while lo < hi:
            start = int(self._ends[k - 1]) if k else 0
            take = min(hi, int(self._ends[k])) - lo
            parts.append(self._shard(k)[lo - start : lo - start + take])
            lo, k = lo + take, k + 1
        return np.concatenate(parts) if parts else np.zeros(0, self.dtype)
