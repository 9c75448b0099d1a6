"""A running run, watched and stopped from another process through its run directory.

The driver rewrites ``status.json`` (`RunHandle.status()` plus when and by which process) every
`EVERY_S` seconds and looks for ``stop-requested`` every half second. ``dloco status RUN_DIR``
reads the status (or ``summary.json`` once the run ended); ``dloco stop RUN_DIR`` leaves the request,
and the driver ends the run as at its budget: final evaluation, ``summary.json``, actors removed.
The driver honours a request only from a regular file of its own user written since this start of
the run (`stop_requested`): one left by an earlier start of a resumed run, one dated in the future
(which would otherwise stop every later resume too) or one of another user is ignored with a warning.
Both files are written through a fresh temporary file renamed over them (`dloco.durable.replace_bytes`),
so a link planted at either name is replaced, not written through, and they are this user's only (0600).
Under ``ray job submit`` the run dir is on the head (or a shared mount): run these there, e.g.
``ray exec CLUSTER.yaml "dloco status RUN_DIR"``, or stop the whole job with ``ray job stop``.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dloco import durable

STATUS, STOP, SUMMARY = "status.json", "stop-requested", "summary.json"
EVERY_S = 2.0  # how often the driver rewrites the status (`actors.observe.Observer`)
# A stop request dated up to this far ahead of the driver's clock still counts: the file's time
# comes from the file system (the clock of an NFS server, say), which may run a little ahead.
AHEAD_S = 5.0
_warned: set[tuple[int, int, int, str]] = set()  # (device, inode, mtime, why) of requests ignored aloud


def publish(run_dir: str | os.PathLike, status: Mapping[str, Any], now: float | None = None) -> None:
    """Writes ``status.json`` atomically: `status` with when (`now`) and by which process."""
    now = time.time() if now is None else now
    body = json.dumps({**status, "updated": now, "pid": os.getpid(), "host": socket.gethostname()}, default=str)
    # not fsynced: rewritten every `EVERY_S` seconds, and an fsync queued behind a snapshot's would
    # stall the driver's supervision, which calls this
    durable.replace_bytes(Path(run_dir) / STATUS, body.encode(), sync=False)


def stop_requested(run_dir: str | os.PathLike, since: float, now: float | None = None) -> bool:
    """Whether ``dloco stop`` asked this run (this start of it, at `since`, wall seconds) to stop.

    Only a regular file of this process's user dated from `since` to `AHEAD_S` past `now` counts:
    another user's file (in a run dir others can write) is nobody's request to us; an older one
    ended an earlier start of the run; a future-dated one would end this start and every resume
    until its date passed. Each ignored request but an earlier start's is reported once on stderr,
    and left in place.
    """
    path = Path(run_dir) / STOP
    try:
        st = path.lstat()
    except OSError:  # none (or the run dir unreadable: nobody could have asked)
        return False
    now = time.time() if now is None else now
    if not stat.S_ISREG(st.st_mode):
        why = "not a regular file"
    elif st.st_uid != os.getuid():
        why = f"owned by uid {st.st_uid}, not by this run's user (uid {os.getuid()})"
    elif st.st_mtime > now + AHEAD_S:
        why = f"dated {st.st_mtime - now:.0f} s in the future"
    else:  # older than this start: an earlier start's request, which ended that one (a resume's usual case)
        return st.st_mtime >= since
    if (key := (st.st_dev, st.st_ino, st.st_mtime_ns, why)) not in _warned:
        _warned.add(key)
        sys.stderr.write(f"dloco: warning: ignoring {path}: {why}\n")
    return False


def request_stop(run_dir: str | os.PathLike) -> None:
    """Asks the run in `run_dir` to stop. FileNotFoundError: no run there; ValueError: it has ended."""
    d = Path(run_dir)
    if not (d / STATUS).is_file():
        raise FileNotFoundError(2, "no running dloco run here (no status.json)", str(d))
    if (d / SUMMARY).is_file() and (d / SUMMARY).stat().st_mtime >= (d / STATUS).stat().st_mtime:
        raise ValueError(f"{d}: the run has ended already (summary.json)")
    durable.replace_bytes(d / STOP, f"{time.time()}\n".encode())


def read(run_dir: str | os.PathLike, stale_s: float = 30.0, now: float | None = None) -> dict[str, Any]:
    """The run's state: ``{"state": "running" | "ended" | "not answering", ...}`` with its status (or,
    ended, its summary). "not answering": the driver has not written its status for `stale_s` seconds
    and left no summary (it was killed, or its machine went away). FileNotFoundError: no run there."""
    d, now = Path(run_dir), time.time() if now is None else now
    status = json.loads((d / STATUS).read_text()) if (d / STATUS).is_file() else None
    summary = json.loads((d / SUMMARY).read_text()) if (d / SUMMARY).is_file() else None
    if summary is not None and (status is None or (d / SUMMARY).stat().st_mtime >= (d / STATUS).stat().st_mtime):
        return {"state": "ended", **summary}
    if status is None:
        raise FileNotFoundError(2, "no dloco run here (no status.json or summary.json)", str(d))
    return {"state": "running" if now - float(status["updated"]) < stale_s else "not answering", **status}
