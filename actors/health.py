"""What the driver watches for besides events: actors that failed for good, and errors that end a run.

A learner whose `run` call failed for good (its constructor raised on a restart, or Ray gave up
on it) is reported and the run goes on with the others; the store or the syncer failing for good,
every learner failing, or commits failing for longer than `store.fail_after_s` end the run with
that error (`RunHandle.fatal`, the summary's ``error``, exit code 1 from ``dloco train``).
"""

from __future__ import annotations

import os
from typing import Any

import ray

from dloco.config import RunConfig
from dloco.tally import Tally


def one_line(err: BaseException) -> str:
    """The gist of an error on one line: for a Ray error, the remote exception's last line."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip() and not set(ln.strip()) <= set("^~ ")]
    return lines[-1] if lines else type(err).__name__


class ActorStartError(RuntimeError):
    """The store or syncer could not start (one line: its own error)."""


def started(actor: Any, name: str, timeout: float = 600.0) -> None:
    """Waits for `actor` to be constructed; one line if it cannot start (its error, e.g. the run
    dir is locked by another run, or its state cannot be restored)."""
    try:
        ray.get(actor.ping.remote(), timeout=timeout)
    except ray.exceptions.RayError as e:
        raise ActorStartError(f"the {name} could not start: {one_line(e)}") from None


def auth_mode() -> str:
    """The connected Ray cluster's authentication mode (``token`` or ``disabled``), as Ray reports it."""
    try:
        from ray._private.authentication.authentication_utils import is_token_auth_enabled

        return "token" if is_token_auth_enabled() else "disabled"
    except ImportError:  # another Ray version: what this process was told
        return os.environ.get("RAY_AUTH_MODE", "unknown")


def failed_runs(runs: dict[int, Any]) -> list[tuple[int, BaseException]]:
    """Learners whose `run` reference has failed (not merely returned), with the error."""
    out: list[tuple[int, BaseException]] = []
    for m, ref in runs.items():
        if ray.wait([ref], timeout=0)[0]:
            try:
                ray.get(ref)
            except ray.exceptions.RayError as e:
                out.append((m, e))
    return out


def fatal(tally: Tally, cfg: RunConfig, now: float, learners_left: bool) -> str | None:
    """Why the run must end now, or None: no learner left, or commits failing for too long."""
    last = tally.last_error["error"] if tally.last_error else None
    if not learners_left:
        return f"every learner failed: {last or 'no error reported'}"
    failing, limit = tally.failing_for(now), cfg.store.fail_after_s
    if failing > limit:
        return (
            f"commits have failed for {failing:.0f} s (store.fail_after_s={limit:g}): {last}; "
            "make the run dir writable (free its disk) and continue with --resume"
        )
    return None


def process_age() -> float:
    """Seconds since this process started (``/proc/self/stat``'s start time, Linux): how long a
    restarted store or syncer spent in Ray's restart and its imports before its constructor ran."""
    with open("/proc/self/stat") as fh:
        started_ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as fh:
        uptime = float(fh.read().split()[0])
    return max(0.0, uptime - started_ticks / os.sysconf("SC_CLK_TCK"))


def process_memory(pid: int | None = None) -> dict[str, int]:
    """A process's (this one's by default) pid, resident set and peak resident set in bytes, from
    ``/proc`` (Linux): what `memory()` of the store and the syncer report, for soak runs."""
    pid = pid or os.getpid()
    fields = {}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024
    return {"pid": pid, "rss_bytes": fields.get("VmRSS", 0), "peak_rss_bytes": fields.get("VmHWM", 0)}
