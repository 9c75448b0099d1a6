"""Emulated hosts on one machine: cap a learner process's CPU with a Linux cgroup (`learners.cpu_limit`).

On a real fleet every learner has its own host, so a learner restarting (process start, JAX
import, compile) does not slow the others and is not slowed by them. Many learners sharing the
cores of one test machine break that: a restart competes with every learner still training. A
CPU quota per learner process (CFS bandwidth: `cores` × period per period) gives each learner a
fixed share, as its own host would, whatever the others do.

The emulated hosts yield to everything else: the parent group ``dloco`` has the least CPU weight
(v1 ``cpu.shares`` 2, v2 ``cpu.weight`` 1), so under contention the processes outside it (the store,
the syncer, the driver, Raylet) run first, as they would on hosts of their own. Without it the
learners' groups took their full quotas (all of a 2-core machine) at the weight of a process of
niceness 0, and a restarted store or syncer spent 4–15 s importing before its constructor ran
(`benchmarks/soak.py --quick`, decoupled, whose learners never wait), against 2.3–2.8 s beside dp's
learners, which wait for every merge.

Needs write access to the cgroup ``cpu`` controller (v1 ``/sys/fs/cgroup/cpu`` or v2 with
``cpu.max``), which a root process in most containers has; otherwise `limit_cpu` raises with a
clear message. A testing aid, off by default.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

_V1 = Path("/sys/fs/cgroup/cpu")
_V2 = Path("/sys/fs/cgroup")
_PERIOD_US = 100_000


def cgroup_root() -> tuple[Path, int]:
    if (_V1 / "cpu.cfs_quota_us").exists():
        return _V1 / "dloco", 1
    if (_V2 / "cgroup.controllers").exists() and "cpu" in (_V2 / "cgroup.controllers").read_text().split():
        return _V2 / "dloco", 2
    raise RuntimeError("learners.cpu_limit needs the cgroup cpu controller, which this machine does not offer")


def limit_cpu(name: str, cores: float) -> Path:
    """Moves this process into cgroup ``dloco/<name>`` capped at `cores` CPU cores; returns its path."""
    root, version = cgroup_root()
    group = root / name
    try:
        group.mkdir(parents=True, exist_ok=True)
        (root / ("cpu.shares" if version == 1 else "cpu.weight")).write_text("2" if version == 1 else "1")
        quota = max(1000, int(cores * _PERIOD_US))
        if version == 1:
            (group / "cpu.cfs_period_us").write_text(str(_PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (group / "cpu.max").write_text(f"{quota} {_PERIOD_US}")
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as e:
        raise RuntimeError(f"learners.cpu_limit={cores}: cannot use cgroup {group} ({e}); set it to 0") from None
    return group


def release(prefix: str) -> None:
    """Removes the (empty) cgroups ``dloco/<prefix>*`` left by a finished run."""
    try:
        root, _ = cgroup_root()
    except RuntimeError:
        return
    for group in root.glob(f"{prefix}*"):
        with contextlib.suppress(OSError):  # a cgroup goes with rmdir once no process is left in it
            group.rmdir()
