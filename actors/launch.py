"""Starts a run from one `RunConfig` on a Ray cluster: `start(config) -> RunHandle`.

`connect` joins the cluster named by the caller or RAY_ADDRESS (failing fast with one line if it
does not answer), or starts a local one that listens on 127.0.0.1 only; `start` prepares the data
once, writes the run directory's ``config.json`` and hands over to `actors.supervisor.RunHandle`,
which spawns the store, syncer and learner actors and supervises them.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import ray

from actors.supervisor import RunHandle
from dloco import build
from dloco.config import RunConfig

__all__ = ["RunHandle", "connect", "start"]


def _check_reachable(address: str, timeout: float = 5.0) -> None:
    """Fails fast with one line if a ``host:port`` GCS address does not answer (Ray would retry for minutes)."""
    if address == "auto" or "://" in address or ":" not in address:
        return
    host, _, port = address.rpartition(":")
    if host in ("127.0.0.1", "localhost"):
        # a single-machine cluster: keep Ray from rewriting loopback to the host's interface address
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except (OSError, ValueError) as e:
        raise ConnectionError(f"cannot reach the Ray cluster at {address}: {e}") from None


def connect(address: str | None, num_cpus: int | None = None, object_store_mb: int = 512) -> bool:
    """Connects to Ray; returns True if this call started a local cluster (which `stop` shuts down).

    `address` None: a cluster named by RAY_ADDRESS (e.g. inside ``ray job submit``), else a new
    local one listening on 127.0.0.1 only.
    """
    if ray.is_initialized():
        return False
    quiet: dict[str, Any] = {"log_to_driver": False, "logging_level": "ERROR"}
    if address or os.environ.get("RAY_ADDRESS"):
        target = address or os.environ["RAY_ADDRESS"]
        _check_reachable(target)
        try:
            ray.init(address=address or None, **quiet)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise ConnectionError(
                f"cannot reach the Ray cluster at {address or os.environ['RAY_ADDRESS']}: {e}"
            ) from None
        return False
    # Ray binds its servers to all interfaces unless told it is a single-machine cluster: this keeps
    # every server of the local cluster on 127.0.0.1 (checked with `ss -ltn`).
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        object_store_memory=object_store_mb * 1024**2,
        _node_ip_address="127.0.0.1",
        **quiet,
    )
    return True


def start(
    cfg: RunConfig,
    address: str | None = None,
    run_dir: str | os.PathLike | None = None,
    progress=None,
    resume: bool = False,
) -> RunHandle:
    """Starts the run described by `cfg` on Ray (a new local cluster unless `address`/RAY_ADDRESS).

    `run_dir` defaults to ``{cfg.run_dir}/{date-time}``. A directory that already holds a run is
    continued only with `resume` (the store restores its snapshot and log). Returns at once with a
    `RunHandle`; the run stops by itself at its budget.
    """
    run_dir = Path(run_dir or Path(cfg.run_dir) / time.strftime("%Y%m%d-%H%M%S"))
    if (run_dir / "store").exists() and not resume:
        raise FileExistsError(
            f"run dir {run_dir} already holds a run: pass --resume to continue it, or another --run-dir"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(asdict(cfg), indent=2))
    build.corpus(cfg)  # prepare (and cache) the data once, before any actor starts
    needed = int(sum(g.num_cpus for g in cfg.learners.expand())) + 1
    owns = connect(address, num_cpus=max(needed, os.cpu_count() or 1), object_store_mb=cfg.store.object_store_mb)
    try:
        return RunHandle(cfg, run_dir, owns, progress)
    except BaseException:
        if owns:
            ray.shutdown()
        raise
