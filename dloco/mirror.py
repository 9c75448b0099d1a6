"""A copy of the store's directory on a `pyarrow.fs` URI (``gs://``, ``s3://``, ``file://`` for a
shared mount), so that a run survives losing its head node and that node's disk (`store.mirror`).

The local directory stays the primary: every write there is atomic, fsynced and locked
(`dloco.durable`). After each write the store calls `sync`, which brings the URI to the same files
before the store answers: new and changed files are uploaded (the commit log first, a snapshot's
``meta.json`` after its fragments, the registry last), then what is gone locally (pruned) is
deleted there. Names are write-once but for ``registry.json``; every file carries its checksum
header, so a torn upload (a head lost mid-copy) is found damaged at restore and set aside like any
damaged file. A sync that fails (the URI unreachable) does not fail the commit, which is durable
locally: the store records the error and the next sync uploads what is `pending`.

`open`, at the store's start:

- the local directory holds no committed state (a new head node, an empty disk) and the URI does:
  every file is downloaded, then the store restores as from its own disk, verifying everything;
- both hold state and the URI holds a commit or snapshot the local directory never had (a stale
  disk came back): `StaleStoreDir`, one line naming both; nothing is overwritten;
- else the URI is brought up to the local state.

One store writes to a URI at a time: ``holder.json`` there names it (token, host, run dir, time) and
each sync renews it. A holder on another host (or another run dir) is waited out: `open` watches it
for `lease_s` and takes over if it stays unchanged, or refuses (`RunDirLocked`) if it is renewed.
A `sync` that finds another holder stops mirroring and says so in the store's errors; one that finds
none (the URI emptied) takes the lease again and uploads everything. Object stores
offer no compare-and-set through pyarrow, so this is a lease, not a lock: two stores opening within
the same instant could both take it; the holder check at every sync bounds the damage to one sync.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pyarrow.fs as pafs

from dloco import durable
from dloco.durable import RunDirLocked

HOLDER, IDENTITY = "holder.json", "identity.json"
_WAL = re.compile(r"(?:wal/|quarantine/wal-)p(\d+)-v(\d+)\.npz(?:\.\d+)?")
_SNAP = re.compile(r"(?:quarantine/)?snap-(\d+)(?:\.\d+)?(?:/.*)?")


class StaleStoreDir(RuntimeError):  # noqa: N818  (the name callers catch it by)
    """The local store directory is older than its mirror: restoring from it would lose commits."""


def horizon(names: list[str], snapshot_versions: list[int] | None = None) -> tuple[int, dict[int, int]]:
    """(newest snapshot count, fragment → newest version) that the file names (relative to the
    store dir, quarantined ones included: they once were there) and a snapshot's versions show."""
    snap, newest = -1, dict(enumerate(snapshot_versions or []))
    for name in names:
        if m := _WAL.fullmatch(name):
            p, v = int(m[1]), int(m[2])
            newest[p] = max(newest.get(p, -1), v)
        elif m := _SNAP.fullmatch(name):
            snap = max(snap, int(m[1]))
    return snap, newest


def _local_files(root: Path) -> dict[str, tuple[int, int]]:
    """Relative POSIX path → (size, mtime_ns) of what the mirror copies: all but the lock,
    temporary files and the quarantine."""
    if not root.is_dir():  # its disk lost under a running store: never read as "everything deleted"
        raise FileNotFoundError(f"store dir {root} is gone: not mirrored (the mirror keeps the last state)")
    out = {}

    def fail(e: OSError) -> None:
        raise e

    for dirpath, dirnames, filenames in os.walk(root, onerror=fail):
        dirnames[:] = [d for d in dirnames if d != "quarantine" and not d.startswith("tmp-")]
        for name in filenames:
            if name == "LOCK" or name.startswith(".tmp-"):
                continue
            path = Path(dirpath) / name
            st = path.stat()
            out[path.relative_to(root).as_posix()] = (st.st_size, st.st_mtime_ns)
    return out


def _order(rel: str) -> tuple:
    return (0 if rel.startswith("wal/") else 1 if rel.startswith("snap-") else 2, rel.endswith("meta.json"), rel)


class Mirror:
    """The mirror of one store directory at `uri` (see the module docstring)."""

    def __init__(
        self,
        uri: str,
        lease_s: float = 120.0,
        host: str | None = None,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.uri = uri
        self.fs, self.base = pafs.FileSystem.from_uri(uri)
        self.base = self.base.rstrip("/")
        self.lease_s, self.host, self.clock, self.sleep = lease_s, host or socket.gethostname(), clock, sleep
        self.token = uuid.uuid4().hex
        self._sent: dict[str, tuple[int, int]] = {}  # what the URI holds: local signature when uploaded
        self._renewed = -1.0
        self.root: Path | None = None
        self.pulled = self.uploaded = self.deleted = self.pending = 0
        self.lost: str | None = None  # why this store no longer mirrors (another holder took over)

    def _path(self, rel: str) -> str:
        return f"{self.base}/{rel}"

    def _remote_files(self) -> dict[str, int]:
        sel = pafs.FileSelector(self.base, recursive=True, allow_not_found=True)
        n = len(self.base) + 1
        return {i.path[n:]: i.size for i in self.fs.get_file_info(sel) if i.type == pafs.FileType.File}

    def _read(self, rel: str) -> bytes:
        with self.fs.open_input_stream(self._path(rel)) as f:
            return f.read()

    def _write(self, rel: str, data: bytes) -> None:
        parent = self._path(rel).rsplit("/", 1)[0]
        self.fs.create_dir(parent, recursive=True)
        with self.fs.open_output_stream(self._path(rel)) as out:
            out.write(data)

    # ---- the lease ---------------------------------------------------------------------------
    def _exists(self, rel: str) -> bool:
        return self.fs.get_file_info(self._path(rel)).type == pafs.FileType.File

    def holder(self) -> dict | None:
        """The holder record at the URI (None: none; {}: unreadable)."""
        if not self._exists(HOLDER):
            return None
        try:
            obj = json.loads(self._read(HOLDER))
        except (OSError, ValueError):
            return {}
        return obj if isinstance(obj, dict) else {}

    def _mine(self, h: dict | None) -> bool:
        return (h or {}).get("token") == self.token

    def _renew(self) -> None:
        record = {"token": self.token, "host": self.host, "root": str(self.root), "pid": os.getpid()}
        self._write(HOLDER, json.dumps({**record, "time": self.clock()}).encode())
        self._renewed = self.clock()

    def _take(self) -> None:
        h = self.holder() or {}
        # our own predecessor (same host and dir: the local lock, now ours, says it is gone) is replaced at once
        if h and (h.get("host"), h.get("root")) != (self.host, str(self.root)):
            waited, last = 0.0, h
            while waited < self.lease_s:
                step = min(1.0, self.lease_s / 10)
                self.sleep(step)
                waited += step
                now = self.holder()
                if now != last:
                    who = (now or {}).get("host", "?")
                    raise RunDirLocked(
                        f"store.mirror={self.uri} is in use by the store of another run (host {who}, renewed "
                        f"within {self.lease_s:g} s): stop that run or use another store.mirror"
                    )
        self._renew()

    # ---- open and sync -----------------------------------------------------------------------
    def open(self, root: Path, identity: dict | None = None) -> None:
        """Takes the lease, then pulls into an empty `root`, refuses a stale one, or pushes `root`.
        `identity` (what the store's files must fit: its fragments' shapes) is kept at the URI as
        ``identity.json``; a URI holding another run's is refused (`StaleStoreDir`)."""
        self.root = Path(root)
        self._take()
        remote = {k: v for k, v in self._remote_files().items() if k not in (HOLDER, IDENTITY)}
        if identity is not None:
            there = json.loads(self._read(IDENTITY)) if self._exists(IDENTITY) else None
            if there not in (None, identity):
                raise StaleStoreDir(
                    f"store.mirror={self.uri} holds another run (a model of other shapes): use another URI for this run"
                )
            if there is None:
                self._write(IDENTITY, json.dumps(identity).encode())
        local = _local_files(self.root)
        names = [*local, *(p.relative_to(self.root).as_posix() for p in self.root.glob("quarantine/*"))]
        committed = [n for n in names if n != "registry.json"]
        if remote and not committed:
            for rel in sorted(remote, key=_order):
                durable.mkdir((self.root / rel).parent)
                durable.replace_bytes(self.root / rel, self._read(rel))
                self.pulled += 1
            local = _local_files(self.root)
        elif remote:
            snaps = sorted(self.root.glob("snap-*/meta.json"), key=lambda p: int(p.parent.name[5:]))
            try:
                versions = [int(v) for v in durable.read_json(snaps[-1])["versions"]] if snaps else []
            except (durable.CorruptFileError, KeyError, TypeError, ValueError):
                versions = []
            here, there = horizon(names, versions), horizon(list(remote))
            newer = [p for p, v in there[1].items() if v > here[1].get(p, -1)]
            if there[0] > here[0] or newer:
                raise StaleStoreDir(
                    f"store dir {self.root} is older than store.mirror={self.uri} (snapshot {here[0]} and "
                    f"versions {dict(sorted(here[1].items()))} here; snapshot {there[0]} and versions "
                    f"{dict(sorted(there[1].items()))} there): move {self.root} aside to restore from the mirror"
                )
        self._sent = {k: sig for k, sig in local.items() if remote.get(k) == sig[0] and k != "registry.json"}
        self.sync()

    def sync(self) -> None:
        """Brings the URI to the local directory's files (OSError/RunDirLocked when it cannot)."""
        if self.root is None:
            raise RuntimeError("Mirror.sync before open")
        if self.lost:
            raise RunDirLocked(self.lost)
        h = self.holder()
        if h is None:  # the URI was emptied or is new (after an outage): take it and upload everything
            self._sent = {}
            self._renew()
        elif not self._mine(h):
            self.lost = (
                f"store.mirror={self.uri} was taken over by the store on host {(h or {}).get('host', '?')}: "
                "this run's commits are no longer mirrored"
            )
            raise RunDirLocked(self.lost)
        local = _local_files(self.root)
        todo = [k for k in sorted(local, key=_order) if self._sent.get(k) != local[k]]
        gone = sorted(set(self._sent) - set(local))
        self.pending = len(todo) + len(gone)
        for rel in todo:
            sig = local[rel]
            self._write(rel, (self.root / rel).read_bytes())
            self._sent[rel] = sig
            self.uploaded += 1
            self.pending -= 1
        for rel in gone:  # (holder and identity are never among them: they are not in the store dir)
            with contextlib.suppress(FileNotFoundError):
                self.fs.delete_file(self._path(rel))
            del self._sent[rel]
            self.deleted += 1
            self.pending -= 1
        for d in {rel.split("/")[0] for rel in gone if rel.startswith("snap-")} - {k.split("/")[0] for k in local}:
            self.fs.delete_dir(self._path(d))  # a pruned snapshot's (empty) directory
        if self.clock() - self._renewed >= self.lease_s / 4:
            self._renew()

    def close(self) -> None:
        """Gives the lease up (a store closing cleanly): the next store takes the URI at once."""
        if self.root is not None and not self.lost and self._mine(self.holder()):
            self.fs.delete_file(self._path(HOLDER))

    def summary(self) -> dict:
        return {
            "uri": self.uri,
            "pulled": self.pulled,
            "uploaded": self.uploaded,
            "deleted": self.deleted,
            "pending": self.pending,
            "lost": self.lost,
        }
