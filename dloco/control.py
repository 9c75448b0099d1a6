"""A running run, watched and stopped from another process through its run directory.

The driver rewrites ``status.json`` (`RunHandle.status()` plus when and by which process) every
`EVERY_S` seconds and looks for ``stop-requested`` every half second. ``dloco status RUN_DIR``
reads the status (or ``summary.json`` once the run ended); ``dloco stop RUN_DIR`` leaves the request,
and the driver ends the run as at its budget: final evaluation, ``summary.json``, actors removed.
A request older than the run's start (left by an earlier start of a resumed run) is ignored.
Under ``ray job submit`` the run dir is on the head (or a shared mount): run these there, e.g.
``ray exec CLUSTER.yaml "dloco status RUN_DIR"``, or stop the whole job with ``ray job stop``.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

STATUS, STOP, SUMMARY = "status.json", "stop-requested", "summary.json"
EVERY_S = 2.0  # how often the driver rewrites the status (`actors.observe.Observer`)


def publish(run_dir: str | os.PathLike, status: Mapping[str, Any], now: float | None = None) -> None:
    """Writes ``status.json`` atomically: `status` with when (`now`) and by which process."""
    now = time.time() if now is None else now
    path = Path(run_dir) / STATUS
    tmp = path.with_name(f".{STATUS}.{os.getpid()}.tmp")
    tmp.write_text(
        json.dumps({**status, "updated": now, "pid": os.getpid(), "host": socket.gethostname()}, default=str)
    )
    os.replace(tmp, path)


def stop_requested(run_dir: str | os.PathLike, since: float) -> bool:
    """Whether ``dloco stop`` asked this run (started at `since`, wall seconds) to stop."""
    try:
        return (Path(run_dir) / STOP).stat().st_mtime >= since
    except OSError:  # none (or the run dir unreadable: nobody could have asked)
        return False


def request_stop(run_dir: str | os.PathLike) -> None:
    """Asks the run in `run_dir` to stop. FileNotFoundError: no run there; ValueError: it has ended."""
    d = Path(run_dir)
    if not (d / STATUS).is_file():
        raise FileNotFoundError(2, "no running dloco run here (no status.json)", str(d))
    if (d / SUMMARY).is_file() and (d / SUMMARY).stat().st_mtime >= (d / STATUS).stat().st_mtime:
        raise ValueError(f"{d}: the run has ended already (summary.json)")
    (d / STOP).write_text(f"{time.time()}\n")


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
