"""File primitives for state that must survive crashes, power loss and damaged disks (`dloco.store`).

- `write`: a file is written as a 32-byte header (magic, payload length, XXH3-128 of the payload)
  plus the payload, to a temporary ``.tmp-*`` name in the same directory, fsynced, renamed over the
  final name, and the directory is fsynced too (without that a power loss may forget the rename).
  On any error the temporary file is removed and the error propagates: the old file is untouched.
- `read`: the payload, verified: an empty, truncated, bit-flipped or missing file raises
  `CorruptFileError` (one exception type for every kind of damage, with the reason). A file without the
  magic (written before checksums existed) is returned as is only when the caller accepts legacy
  files; the caller's parser then decides (a zip's CRC-32 still guards an ``.npz``).
- `write_arrays` / `read_arrays`: named numpy arrays and a JSON meta in one such file, written in
  one streaming pass (each array's memory hashed and written as it is, never copied into a payload)
  and read back as views of one buffer. Files from before (``DLOCOv1``: blake2b-128 over an ``.npz``)
  and from before checksums (a bare ``.npz``) are still read.
- `quarantine`: moves a damaged file or snapshot directory into ``root/quarantine/`` (never deletes
  it, so a person can inspect it) and returns a record of what moved where and why.
- `RunDirLock`: one process per directory (``fcntl.flock`` on a lock file holding the holder's pid
  and host); a second store refuses to start instead of interleaving its commits with the first.
- `clean_tmp`: removes what an interrupted `write` or snapshot left behind.

Nothing here writes through a symlink: files are created under fresh random names with
``O_CREAT | O_EXCL | O_NOFOLLOW`` (`tempfile`) and renamed over the final name, which replaces a link
planted there rather than following it, and the lock file is opened with ``O_NOFOLLOW``. Directories
are created 0700 and files 0600, whatever the umask: a run's state is its user's only.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import math
import os
import re
import shutil
import socket
import struct
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import xxhash

MAGIC = b"DLOCOv2\n"  # XXH3-128 digests (11 GB/s on one core here, against blake2b's 0.65)
MAGIC_V1 = b"DLOCOv1\n"  # blake2b-128 digests: read, no longer written
_HEADER = struct.Struct("<8sQ16s")  # magic, payload length, digest of the payload
_INDEX = struct.Struct("<Q")  # `write_arrays`: the length of its JSON index
_ALIGN = 64  # `write_arrays`: each array starts at a multiple of this in the payload


class CorruptFileError(Exception):
    """A durable file that does not verify: missing, empty, truncated, or its checksum differs."""

    def __init__(self, path: str | os.PathLike, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = Path(path), reason


class RunDirLocked(RuntimeError):  # noqa: N818  (the name callers catch it by)
    """Another store (process or object) holds the directory's lock."""


def _hasher(magic: bytes) -> Any:
    """A fresh hash object of the digest that files starting with `magic` carry."""
    return hashlib.blake2b(digest_size=16) if magic == MAGIC_V1 else xxhash.xxh3_128()


def _digest(payload: bytes | memoryview, magic: bytes = MAGIC) -> bytes:
    h = _hasher(magic)
    h.update(payload)
    return h.digest()


def fsync_dir(path: str | os.PathLike) -> None:
    """Makes the directory's entries (creations, renames, removals) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write(path: str | os.PathLike, payload: bytes) -> None:
    """Atomically and durably replaces `path` with the checksummed `payload` (OSError on failure)."""
    replace_bytes(path, _HEADER.pack(MAGIC, len(payload), _digest(payload)), payload)


def replace_bytes(path: str | os.PathLike, *parts: bytes, sync: bool = True) -> None:
    """Atomically and durably replaces `path` with the concatenated `parts` as they are (a copy of a
    file `write` made keeps its header, so it verifies wherever it lands). Without `sync`, atomic but
    not fsynced: for a file rewritten every few seconds that a power loss may take back (a status)."""
    _replace(path, lambda fh: [fh.write(part) for part in parts], sync)


def _replace(path: str | os.PathLike, fill: Callable[[BinaryIO], object], sync: bool = True) -> None:
    """`fill` writes a temporary file beside `path` (open for reading too), which is fsynced and
    renamed over `path`, and the directory fsynced; on any error the temporary file is removed.

    The temporary file gets a random name, is created only if nothing (not even a link) is there
    (`tempfile.mkstemp`: ``O_EXCL | O_NOFOLLOW``, mode 0600), and the rename replaces a link at
    `path` instead of following it: a link planted at either name cannot redirect the write."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "w+b") as fh:
            fill(fh)
            fh.flush()
            if sync:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if sync:
        fsync_dir(path.parent)


def read(path: str | os.PathLike, legacy: bool = False) -> bytes:
    """The verified payload of `path`; `CorruptFileError` if it is missing or damaged.

    With `legacy`, a file that does not start with the magic is returned whole (unverified).
    """
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise CorruptFileError(path, "missing") from None
    except IsADirectoryError:
        raise CorruptFileError(path, "a directory, not a file") from None
    if not data:
        raise CorruptFileError(path, "empty (zero length)")
    if not data.startswith((MAGIC, MAGIC_V1)):
        if legacy and len(data) >= len(MAGIC):
            return data
        raise CorruptFileError(path, f"no checksum header ({len(data)} bytes)")
    return bytes(_verified(path, memoryview(data)))


def _verified(path: str | os.PathLike, data: memoryview) -> memoryview:
    """The payload of a file's bytes `data` that start with a magic, checked against its header."""
    if len(data) < _HEADER.size:
        raise CorruptFileError(path, f"truncated header ({len(data)} bytes)")
    magic, length, digest = _HEADER.unpack_from(data)
    payload = data[_HEADER.size :]
    if len(payload) != length:
        raise CorruptFileError(path, f"length {len(payload)} bytes, header says {length} (truncated or extended)")
    if _digest(payload, magic) != digest:
        raise CorruptFileError(path, "checksum mismatch (bit flip)")
    return payload


def write_dir(final: str | os.PathLike, fill: Callable[[Path], None]) -> None:
    """Creates the directory `final` complete or not at all: `fill` writes into a ``tmp-*`` sibling
    that is then renamed (replacing an older `final`); on failure the sibling is removed."""
    final = Path(final)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix="tmp-"))
    try:
        fill(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(final.parent)


def write_json(path: str | os.PathLike, obj: object) -> None:
    write(path, json.dumps(obj).encode())


def read_json(path: str | os.PathLike) -> dict:
    """A verified JSON object (legacy files without a header accepted if they parse)."""
    try:
        obj = json.loads(read(path, legacy=True))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptFileError(path, f"not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise CorruptFileError(path, f"not a JSON object: {type(obj).__name__}")
    return obj


def write_arrays(path: str | os.PathLike, arrays: dict[str, np.ndarray], meta: dict) -> None:
    """`write` of the named `arrays` and the JSON object `meta`, streamed: each array's memory is
    hashed and written as it is, in one pass (no payload is assembled, no array copied unless it is
    not contiguous). The payload: the length of a JSON index (u64), the index (``meta`` and, per
    array, name, dtype, shape, offset, bytes), zeros to a multiple of 64 bytes, then the arrays'
    bytes, each padded to a multiple of 64 (the offsets count from the first array)."""
    parts, entries, offset = [], [], 0
    for name, x in arrays.items():
        a = np.asarray(x)
        a = a if a.flags.c_contiguous else a.copy(order="C")  # (ascontiguousarray makes a 0-d array 1-d)
        if a.dtype.hasobject:
            raise ValueError(f"{name}: an array of Python objects cannot be written ({a.dtype})")
        parts.append(a)
        entries.append([name, a.dtype.name if a.dtype.kind == "V" else a.dtype.str, list(a.shape), offset, a.nbytes])
        offset += -(-a.nbytes // _ALIGN) * _ALIGN
    index = json.dumps({"meta": meta, "arrays": entries}).encode()
    head = _INDEX.pack(len(index)) + index
    head += bytes(-len(head) % _ALIGN)  # the arrays' offsets count from here

    def fill(fh: BinaryIO) -> None:
        h, length = _hasher(MAGIC), 0
        fh.write(bytes(_HEADER.size))
        pieces: list[bytes | memoryview] = [head]
        for a in parts:  # its bytes as they lie in memory, then zeros to the next multiple of 64
            pieces += [a.reshape(-1).view(np.uint8).data, bytes(-a.nbytes % _ALIGN)]
        for piece in pieces:
            h.update(piece)
            fh.write(piece)
            length += len(piece)
        fh.seek(0)
        fh.write(_HEADER.pack(MAGIC, length, h.digest()))

    _replace(path, fill)


def write_stream(path: str | os.PathLike, fill: Callable[[BinaryIO], None]) -> None:
    """`write` of the payload that `fill` writes into an open file (it may seek within what it
    wrote): the header's place is reserved, the payload hashed by reading it back, the header
    written last, then fsync and rename as `write` does."""

    def framed(fh: BinaryIO) -> None:
        fh.write(bytes(_HEADER.size))
        fill(fh)
        length = fh.seek(0, os.SEEK_END) - _HEADER.size
        fh.seek(_HEADER.size)
        h = _hasher(MAGIC)
        while chunk := fh.read(1 << 22):
            h.update(chunk)
        fh.seek(0)
        fh.write(_HEADER.pack(MAGIC, length, h.digest()))

    _replace(path, framed)


def read_arrays(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict]:
    """The arrays and meta of a `write_arrays` file, verified: the file is read into one buffer and
    the arrays are views of it. Also reads the ``.npz`` files written before (``DLOCOv1``: blake2b;
    without a header: the zip's CRC-32 only). `CorruptFileError` on any damage."""
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            buf = bytearray(size)
            got = fh.readinto(buf)
    except FileNotFoundError:
        raise CorruptFileError(path, "missing") from None
    except IsADirectoryError:
        raise CorruptFileError(path, "a directory, not a file") from None
    data = memoryview(buf)[:got]
    if not data:
        raise CorruptFileError(path, "empty (zero length)")
    magic = bytes(data[: len(MAGIC)])
    if magic != MAGIC:  # an .npz of before: checksummed (v1) or bare
        return _read_npz(path, bytes(_verified(path, data) if magic == MAGIC_V1 else data))
    payload = _verified(path, data)
    try:
        (n,) = _INDEX.unpack_from(payload)
        index = json.loads(bytes(payload[_INDEX.size : _INDEX.size + n]))
        start = -(-(_INDEX.size + n) // _ALIGN) * _ALIGN
        arrays = {
            name: np.frombuffer(payload, np.dtype(dtype), math.prod(shape), start + offset).reshape(shape)
            for name, dtype, shape, offset, _ in index["arrays"]
        }
        meta = index["meta"]
    except Exception as e:  # a file that verifies but was written wrong: any parser's error
        raise CorruptFileError(path, f"unreadable: {type(e).__name__}: {e}") from None
    if not isinstance(meta, dict):
        raise CorruptFileError(path, "meta is not a JSON object")
    return arrays, meta


def read_meta(path: str | os.PathLike) -> dict | None:
    """The meta of a `write_arrays` file read from its index alone, unverified (the payload is not
    read): a cheap look at what a file holds before reading it whole. None for a file of another
    format, or one whose index cannot be read (`read_arrays` then finds what is wrong with it)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(_HEADER.size + _INDEX.size)
            if len(head) < _HEADER.size + _INDEX.size or not head.startswith(MAGIC):
                return None
            (n,) = _INDEX.unpack_from(head, _HEADER.size)
            meta = json.loads(fh.read(min(n, 1 << 26)))["meta"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return meta if isinstance(meta, dict) else None


def _read_npz(path: str | os.PathLike, data: bytes) -> tuple[dict[str, np.ndarray], dict]:
    """The arrays and meta of an ``.npz`` payload written before `write_arrays` (meta in ``meta``)."""
    if not data.startswith(b"PK"):
        raise CorruptFileError(path, f"no checksum header ({len(data)} bytes)")
    try:
        with np.load(io.BytesIO(data)) as z:
            arrays = {k: z[k] for k in z.files}
        meta = json.loads(bytes(arrays.pop("meta")).decode())
    except Exception as e:  # a legacy file can fail in any of numpy's and zipfile's parsers
        raise CorruptFileError(path, f"unreadable: {type(e).__name__}: {e}") from None
    if not isinstance(meta, dict):
        raise CorruptFileError(path, "meta is not a JSON object")
    return arrays, meta


def quarantine(root: str | os.PathLike, path: str | os.PathLike, reason: str) -> dict:
    """Moves a damaged file or directory into ``root/quarantine/`` and returns what happened.

    The record is ``{"path", "reason", "moved_to"}``; `moved_to` is None when nothing was there.
    """
    root, path = Path(root), Path(path)
    record: dict = {"path": str(path), "reason": reason, "moved_to": None}
    if not path.exists():
        return record
    qdir = root / "quarantine"
    base = str(path.relative_to(root)).replace(os.sep, "-") if path.is_relative_to(root) else path.name
    dest, n = qdir / base, 0
    while dest.exists():
        n += 1
        dest = qdir / f"{base}.{n}"
    try:
        qdir.mkdir(mode=0o700, exist_ok=True)
        os.replace(path, dest)
    except OSError as e:  # e.g. a read-only disk: left in place, found damaged again at the next start
        return {**record, "error": f"{type(e).__name__}: {e}"}
    for d in {path.parent, qdir, root}:
        with contextlib.suppress(OSError):
            fsync_dir(d)
    return {**record, "moved_to": str(dest)}


def mkdir(d: str | os.PathLike) -> bool:
    """Creates `d` (and missing parents) durably: each new entry in its parent directory is fsynced.
    Each directory it creates has mode 0700 (a run's files are its user's only: a readable run dir
    shows the model, a writable one lets others plant links). Returns whether this call created `d`
    (False: it was there, or another process made it first)."""
    d = Path(d)
    if d.is_dir():
        return False
    mkdir(d.parent)
    try:
        d.mkdir(mode=0o700)
    except FileExistsError:
        if not d.is_dir():
            raise
        return False
    fsync_dir(d.parent)
    return True


def numbered(directory: str | os.PathLike, pattern: re.Pattern) -> list[tuple[tuple[int, ...], Path]]:
    """Entries of `directory` whose name fully matches `pattern`, with its groups as integers, in
    integer order (name order is not number order once a number outgrows its zero padding)."""
    found = []
    for p in Path(directory).iterdir():
        if m := pattern.fullmatch(p.name):
            found.append((tuple(int(g) for g in m.groups()), p))
    return sorted(found)


def clean_tmp(*dirs: str | os.PathLike) -> list[str]:
    """Removes leftover ``.tmp-*`` files and ``tmp-*`` directories in `dirs`; returns their names."""
    removed = []
    for d in map(Path, dirs):
        for p in [*d.glob(".tmp-*"), *d.glob("tmp-*")]:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(str(p))
    return removed


class RunDirLock:
    """An exclusive lock on `directory` (the file ``directory/LOCK``), held until `release`.

    `flock` locks belong to the open file, so the kernel drops it when the holder's process dies,
    however it dies; two locks from one process conflict as well. `acquire` retries for `wait_s`
    seconds, so that a store restarting while its predecessor process still exits gets the lock.
    `role` names the holder in the refusal (a ``store``, or the ``run`` that `actors.launch.start`
    claims the run dir for).

    The lock file is created 0600 and never opened through a link (one planted there would make
    the holder's pid overwrite the file it names). A holder may remove the lock file it created
    (`release(remove=True)`, a failed start cleaning up): whoever waited on it then finds that the
    name no longer leads to the file it locked, and locks the file there now instead.
    """

    def __init__(self, directory: str | os.PathLike, role: str = "store") -> None:
        self.directory = Path(directory)
        self.path = self.directory / "LOCK"
        self.role = role
        self.created = False  # whether the holder created the lock file (so it may remove it)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def _open(self) -> tuple[int, bool]:
        """A read-only descriptor of the lock file, created if missing, and whether this call created it."""
        while True:
            with contextlib.suppress(FileExistsError):
                return os.open(self.path, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), True
            with contextlib.suppress(FileNotFoundError):  # removed in between: create it
                return os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW), False

    def _names(self, fd: int) -> bool:
        """Whether the lock file's name still leads to the file open as `fd` (not removed meanwhile)."""
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)

    def acquire(self, wait_s: float = 10.0) -> None:
        """Takes the lock or raises `RunDirLocked` (one line: the directory, the holder, the fix)."""
        if self._fd is not None:
            return
        deadline = time.monotonic() + wait_s
        while True:
            # held through a read-only descriptor: flock needs no more, and a file open for writing
            # would keep the file system from being remounted read-only
            fd, created = self._open()
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        holder = self.holder()
                        os.close(fd)
                        raise RunDirLocked(
                            f"{self.role} dir {self.directory} is in use by another {self.role} (pid "
                            f"{holder.get('pid', '?')} on host {holder.get('host', '?')}): stop that run or use "
                            "another --run-dir"
                        ) from None
                    time.sleep(0.05)
            if self._names(fd):
                break
            os.close(fd)  # its holder removed it before letting go: lock the file there now
        self._fd, self.created = fd, created
        with contextlib.suppress(OSError):  # who holds it: only informative, so a full disk is no error
            info = json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode()
            wfd = os.open(self.path, os.O_WRONLY | os.O_NOFOLLOW)
            try:
                os.pwrite(wfd, info, 0)  # before truncating: a full disk may still overwrite a page
                os.ftruncate(wfd, len(info))
                os.fsync(wfd)
            finally:
                os.close(wfd)

    def probe(self) -> dict | None:
        """Whether another process holds the lock, without taking it or writing anything: None if
        it is free (or was never created), else the holder's pid and host ({} if unknown)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return self.holder()
        finally:
            os.close(fd)  # also releases the probe's lock
        return None

    def holder(self) -> dict:
        """The pid and host written by the current holder ({} if unknown)."""
        try:
            obj = json.loads(self.path.read_bytes() or b"{}")
        except (OSError, ValueError):
            return {}
        return obj if isinstance(obj, dict) else {}

    def release(self, remove: bool = False) -> None:
        """Drops the lock (idempotent). The lock file stays, so no holder ever unlinks another's; with
        `remove`, a lock file this holder created is removed first, while still locked (waiters then
        lock a new one: `acquire`)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            if remove and self.created and self._names(fd):
                with contextlib.suppress(OSError):
                    os.unlink(self.path)
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
