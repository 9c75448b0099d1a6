"""The per-batch work of ``dloco prepare``, the same on Ray Data and in one process.

An *engine* reads the files of a source in order as batches of documents and applies a batch
function to each, yielding the results in input order: `local_engine` here, in this process;
`actors.prepare.ray_engine` on a Ray cluster (``ray.data.read_*`` → ``map_batches``). A batch of
documents is a dict of columns with ``path`` (the file each document came from) and either
``bytes`` (a text file, one document) or the ``text_field`` column (a JSON Lines or Parquet row).
The batch functions are classes built once per worker from plain arguments:

- `Encoder` splits documents by hash (as `dloco.data.prepare_corpus`), tokenizes them (appending
  EOS) and packs one batch into one row (`EncodedBatch`);
- `Sampler` keeps the training documents of a hash-chosen sample, the text a BPE is trained on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np

from dloco.data.corpus import unit_hash
from dloco.data.sources import iter_documents
from dloco.data.tokenizer import BYTE_EOS_ID, Tokenizer

BATCH_DOCUMENTS = 256  # documents per batch function call


class Engine(Protocol):
    """Applies ``udf(**kwargs)`` to the batches of documents of `paths` (files of a source of `kind`;
    `fs` None or a `pyarrow.fs.FileSystem`), yielding its output batches in input order."""

    def __call__(
        self, kind: str, paths: list[str], fs: Any, text_field: str, udf: type, kwargs: dict[str, Any]
    ) -> Iterator[dict[str, np.ndarray]]: ...


def local_engine(
    kind: str, paths: list[str], fs: Any, text_field: str, udf: type, kwargs: dict[str, Any]
) -> Iterator[dict[str, np.ndarray]]:
    """The engine of one process: the documents as `dloco.data.read_documents` reads them."""
    fn = udf(**kwargs)
    column = "bytes" if kind == "text" else text_field
    for path in paths:
        docs: list[Any] = []
        for _, content in iter_documents(kind, [path], "/", text_field, fs):
            if isinstance(content, np.ndarray):
                raise ValueError(f"{path}: a 'tokens' column is tokenized already: train on it as data.source=parquet:")
            docs.append(content if kind == "text" else content.decode("utf-8"))
            if len(docs) == BATCH_DOCUMENTS:
                yield fn({column: np.array(docs, dtype=object), "path": np.array([path] * len(docs), dtype=object)})
                docs = []
        if docs:
            yield fn({column: np.array(docs, dtype=object), "path": np.array([path] * len(docs), dtype=object)})


def contents(batch: dict[str, np.ndarray], kind: str, text_field: str) -> list[bytes]:
    """Each document's UTF-8 bytes, as `dloco.data.read_documents` gives them.

    Raises:
      ValueError: a row without text in `text_field` (one line naming the file).
    """
    if kind == "text":
        return [bytes(b).decode("utf-8", errors="replace").encode("utf-8") for b in batch["bytes"]]
    paths = batch["path"]
    if text_field not in batch:
        names = sorted(k for k in batch if k != "path")
        raise ValueError(f"{paths[0]}: no {text_field!r} field (data.text_field), has {names}")
    out = []
    for path, value in zip(paths, batch[text_field], strict=True):
        if not isinstance(value, str):
            got = "missing" if value is None else type(value).__name__
            raise ValueError(f"{path}: field {text_field!r} is {got}, not a string (data.text_field)")
        out.append(value.encode("utf-8", errors="replace"))
    return out


def _runs(paths: np.ndarray) -> list[list]:
    """``[[path, documents], ...]``: consecutive documents of one file."""
    runs: list[list] = []
    for p in paths:
        if runs and runs[-1][0] == p:
            runs[-1][1] += 1
        else:
            runs.append([str(p), 1])
    return runs


def _digest(content: bytes) -> bytes:
    return hashlib.blake2b(content, digest_size=16).digest()


@dataclasses.dataclass(frozen=True)
class EncodedBatch:
    """One batch of documents, tokenized: ``runs`` ``[[path, n], ...]`` of consecutive documents per
    file, each document's token count (EOS included), validation flag and blake2b-128 digest, the
    tokens of every document in order, and the documents' size in bytes."""

    runs: list[list]
    lengths: np.ndarray
    val: np.ndarray
    digests: bytes
    tokens: np.ndarray
    nbytes: int

    @classmethod
    def rows(cls, batch: dict[str, np.ndarray], dtype: np.dtype) -> Iterator[EncodedBatch]:
        """The batches packed in the rows of an `Encoder`'s output batch."""
        for i in range(len(batch["runs"])):
            yield cls(
                json.loads(str(batch["runs"][i])),
                np.frombuffer(bytes(batch["lengths"][i]), np.int64),
                np.frombuffer(bytes(batch["val"][i]), np.bool_),
                bytes(batch["digests"][i]),
                np.frombuffer(bytes(batch["tokens"][i]), dtype),
                int(batch["nbytes"][i]),
            )


class Encoder:
    """Batch function: documents → one packed `EncodedBatch` row.

    Document d goes to validation iff ``unit_hash(blake2b-128(d)) < val_fraction``, d's UTF-8 bytes
    being hashed (`dloco.data.prepare_corpus`'s rule). Its tokens are the tokenizer's ids followed by
    EOS; for bytes, its UTF-8 bytes followed by 256.

    Args:
      kind: the source's kind (`dloco.data.sources.source_files`). text_field: its text column.
      tokenizer_json: a BPE ``tokenizer.json``'s text, or None for bytes.
      val_fraction: the expected share of validation documents. dtype: the token dtype's name.
    """

    def __init__(self, kind: str, text_field: str, tokenizer_json: str | None, val_fraction: float, dtype: str):
        self.kind, self.text_field, self.val_fraction, self.dtype = kind, text_field, val_fraction, np.dtype(dtype)
        self.tokenizer: Tokenizer | None = None
        if tokenizer_json is not None:
            from tokenizers import Tokenizer as HFTokenizer

            self.tokenizer = Tokenizer("bpe", HFTokenizer.from_str(tokenizer_json))

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        docs = contents(batch, self.kind, self.text_field)
        digests = [_digest(d) for d in docs]
        val = np.array([unit_hash(d) < self.val_fraction for d in digests], dtype=np.bool_)
        if self.tokenizer is None:
            lengths = np.array([len(d) for d in docs], dtype=np.int64)
            flat = np.frombuffer(b"".join(docs), np.uint8).astype(self.dtype)
            tokens = np.insert(flat, np.cumsum(lengths), self.dtype.type(BYTE_EOS_ID))
            lengths += 1
        else:
            ids = self.tokenizer._encode_documents([d.decode("utf-8") for d in docs])
            lengths = np.array([len(i) for i in ids], dtype=np.int64)
            tokens = np.concatenate(ids).astype(self.dtype) if ids else np.zeros(0, self.dtype)

        def one(x: Any) -> np.ndarray:
            return np.array([x], dtype=object)

        return {
            "runs": one(json.dumps(_runs(batch["path"]))),
            "lengths": one(lengths.tobytes()),
            "val": one(val.tobytes()),
            "digests": one(b"".join(digests)),
            "tokens": one(tokens.tobytes()),
            "nbytes": np.array([sum(len(d) for d in docs)], dtype=np.int64),
        }


class Sampler:
    """Batch function: documents → the text (column ``text``) of the training documents whose
    ``unit_hash`` of the second half of their digest is below `rate`: each training document with
    probability `rate`, independently of the split, and the same ones on every run."""

    def __init__(self, kind: str, text_field: str, val_fraction: float, rate: float):
        self.kind, self.text_field, self.val_fraction, self.rate = kind, text_field, val_fraction, rate

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        keep = []
        for d in contents(batch, self.kind, self.text_field):
            digest = _digest(d)
            if unit_hash(digest) >= self.val_fraction and unit_hash(digest[8:]) < self.rate:
                keep.append(d.decode("utf-8"))
        return {"text": np.array(keep, dtype=object)}


def sample_texts(
    engine: Engine, kind: str, paths: list[str], fs: Any, text_field: str, val_fraction: float, rate: float, budget: int
) -> list[str]:
    """At most `budget` bytes of training text chosen by `Sampler`, in document order: the engine's
    output is consumed only until the budget is full, so no more than that is ever held."""
    texts: list[str] = []
    used = 0
    kwargs = {"kind": kind, "text_field": text_field, "val_fraction": val_fraction, "rate": rate}
    for out in engine(kind, paths, fs, text_field, Sampler, kwargs):
        for t in out["text"]:
            n = len(str(t).encode("utf-8"))
            if used + n > budget:
                return texts
            texts.append(str(t))
            used += n
    return texts
