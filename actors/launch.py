"""Starts a run from one `RunConfig` on a Ray cluster: `start(config) -> RunHandle`.

`connect` joins the cluster named by the caller or RAY_ADDRESS (failing fast with one line if it
does not answer), or starts a local one that listens on 127.0.0.1 only; `start` checks the run
(`dloco.preflight`: before Ray starts and before anything is written), claims the run directory
(`claim_run_dir`: creates it 0700 and locks it, so that a second start on it neither writes into it
nor deletes from it), then writes its ``config.json`` and ``fingerprint.json`` and hands over to
`actors.supervisor.RunHandle`, which spawns the store, syncer and learner actors and supervises them;
its ``wait()`` returns the run's `dloco.result.Result` once it ends.
Ray's token file, which lets whoever reads it run code in the cluster, is kept private to this user
(`protect_auth_token`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import stat
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import ray
from ray._private import ray_constants

from actors.health import auth_mode
from actors.supervisor import RunHandle
from dloco import durable, preflight
from dloco.config import RunConfig

__all__ = ["RunHandle", "connect", "start"]

# How long a start waits for another start's claim on its run dir (`claim_run_dir`) before it gives up.
# Another start holds it while its actors start (a minute, compiling), and whatever it leaves, a run
# or nothing, this start would then have to refuse or redo: failing soon with who holds it is clearer.
CLAIM_WAIT_S = 2.0


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
    protect_auth_token()  # one an earlier Ray (or `ray get-auth-token --generate`) left readable
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
    # every server of the local cluster on 127.0.0.1 (tests/test_secure.py checks with `ss -ltn`).
    # Ray reads the variable when it is imported, so the constant it was read into is set too.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    # Secure by default: token authentication (Ray's default, which creates ~/.ray/auth_token if
    # missing; a client without the token, e.g. another local user, is refused) unless the user set
    # RAY_AUTH_MODE themselves, and a temp dir only this user can enter.
    chosen = os.environ.get("RAY_AUTH_MODE")
    if chosen is None or chosen.lower() == "token":
        private_token_dir()
    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        object_store_memory=object_store_mb * 1024**2,
        _node_ip_address="127.0.0.1",
        _temp_dir=private_temp_dir(),
        **quiet,
    )
    protect_auth_token()  # the token `ray.init` may just have generated
    if chosen is not None and auth_mode() != "token":
        sys.stderr.write(f"dloco: warning: RAY_AUTH_MODE={chosen}: any local user can run code in this Ray cluster\n")
    elif chosen is None and auth_mode() != "token":
        ray.shutdown()
        raise ConnectionError(
            "the local Ray cluster started without token authentication: set RAY_AUTH_MODE=token "
            "(or RAY_AUTH_MODE=disabled to accept that any local user can run code in it)"
        )
    return True


def private_token_dir() -> bool:
    """Creates ``~/.ray``, where Ray generates its token, with mode 0700 unless it exists; returns
    whether it did. Ray makes it 0755 and writes the token with a plain ``open(path, "w")`` (0644 under
    the usual umask): in a directory only this user can enter, the token is never readable by others,
    not even before `protect_auth_token` narrows its mode."""
    try:
        (Path.home() / ".ray").mkdir(mode=0o700)
    except FileExistsError:
        return False
    return True


def protect_auth_token() -> list[Path]:
    """Makes the token files Ray reads (``~/.ray/auth_token``, and the file ``RAY_AUTH_TOKEN_PATH``
    names) readable by this user only (0600); returns those it changed. Whoever can read the token
    can run code in the cluster as this user.

    Only a regular file of this user is changed: a link is never followed (a link planted there
    would have dloco change the mode of the file it names), and another user's file is theirs.
    A directory is left as it is: ``~/.ray`` is 0700 when dloco made it (`private_token_dir`), and a
    file of mode 0600 is private in any directory.
    """
    paths = [Path.home() / ".ray" / "auth_token"]
    if named := os.environ.get("RAY_AUTH_TOKEN_PATH"):
        paths.append(Path(named).expanduser())
    changed = []
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:  # none there, a link, or not ours to read
            continue
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and st.st_mode & 0o077:
                os.fchmod(fd, 0o600)
                changed.append(path)
        except OSError as e:
            sys.stderr.write(f"dloco: warning: cannot make {path} private (chmod 600 it yourself): {e}\n")
        finally:
            os.close(fd)
    return changed


class RunDirClaim:
    """This start's hold on its run directory (`claim_run_dir`): what was there before it, and what
    it made, so that a failed start removes exactly what it added and nothing else."""

    def __init__(self, path: Path, lock: durable.RunDirLock, made: bool) -> None:
        self.path, self.lock, self.made = path, lock, made
        self.before = set(os.listdir(path)) - ({lock.path.name} if lock.created else set())

    def remove_new(self) -> None:
        """Removes what this start added while it held the claim (and the directory if it made it
        and it is then empty), never what was there before: while the claim is held, no other start
        writes here, and an older run's actors write only into entries that were there before."""
        for name in set(os.listdir(self.path)) - self.before - {self.lock.path.name}:
            path = self.path / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        self.lock.release(remove=True)  # only if this start created the lock file
        if self.made:
            with contextlib.suppress(OSError):  # not empty: another start came and holds it now
                self.path.rmdir()


@contextlib.contextmanager
def claim_run_dir(path: Path, resume: bool) -> Iterator[RunDirClaim]:
    """Creates `path` (and missing parents) with mode 0700 and holds its lock (``path/LOCK``, the
    ``run`` role of `dloco.durable.RunDirLock`) until the block ends: from before this start writes
    anything there until its store holds the store's own lock, or the start failed and cleaned up.

    Two starts on one new run dir both pass the preflight before either writes; without the claim
    both wrote their config, one store lost the store's lock, and that start removed the directory
    it thought it had made, the winning run's files with it. Now the second start waits for the
    claim (`CLAIM_WAIT_S`), then fails with `RunDirLocked` naming the holder, or, once the first has
    started, finds a run there and refuses (`PreflightError`); either way it wrote and removes nothing.
    A directory this start made but could not claim is another start's now: it is left alone.
    """
    lock = durable.RunDirLock(path, role="run")
    for attempt in range(3):
        made = durable.mkdir(path)
        try:
            lock.acquire(CLAIM_WAIT_S)
            break
        except FileNotFoundError:  # a start that had made it failed and removed it as this one came: make it again
            if attempt == 2:
                raise
    try:
        if not resume and preflight.holds_run(path):  # another start got here first, after our preflight
            raise preflight.PreflightError(
                f"run dir {path} already holds a run: pass --resume to continue it or another --run-dir"
            )
        yield RunDirClaim(path, lock, made)
    finally:
        lock.release()  # idempotent: `remove_new` may have released (and removed) it already


def private_temp_dir() -> str:
    """``{tmp}/dloco-{uid}/ray``: Ray's sockets, logs and spilled objects, inside a directory of mode
    0700, so private to this user (Ray's default ``/tmp/ray`` is world-writable, and Ray makes the
    directory it is given world-writable too: the private parent is what keeps others out).
    Refuses a parent another user owns."""
    parent = Path(tempfile.gettempdir()) / f"dloco-{os.getuid()}"
    parent.mkdir(mode=0o700, exist_ok=True)
    st = parent.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise PermissionError(f"{parent} is not a directory of this user: remove it, then start the run again")
    if st.st_mode & 0o077:
        parent.chmod(0o700)
    return str(parent / "ray")


def under_job() -> bool:
    """Whether this process is a Ray job's driver (``ray job submit`` sets this variable for it)."""
    return "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ


def start(
    cfg: RunConfig,
    address: str | None = None,
    run_dir: str | os.PathLike | None = None,
    progress=None,
    resume: bool | None = False,
) -> RunHandle:
    """Starts the run described by `cfg` on Ray (a new local cluster unless `address`/RAY_ADDRESS).

    `run_dir` defaults to ``{cfg.run_dir}/{date-time}`` (under a Ray job, a relative one under
    ``~``). A directory that already holds a run is continued only with `resume` (the store
    restores its snapshot and log; None: continue if it holds a run, as a resubmitted job does), and
    only if the config's fingerprint matches the run's. Returns at once with a `RunHandle`; the run stops by itself at
    its budget. `progress` is called with `RunHandle.status()` as the run goes, and before that with
    ``{"preparing": stage, "done": n, "total": N}`` while the corpus is prepared (`dloco.data.Progress`).

    In order, so that a bad input ends with one line, nothing written and no Ray left running:
    `dloco.preflight.check` (run dir, corpus, data, model, memory, resume rules; writes nothing) →
    `connect` → `dloco.preflight.check_resources` against the cluster's nodes (on a cluster this
    call started, a learner group that fits on no node is an error and the cluster is shut down; on
    a joined cluster it is a warning on stderr, since nodes may still join: docs/CLUSTER.md) →
    `dloco.preflight.check_devices` (the driver's evaluation batch against its devices) →
    `claim_run_dir` (creates the run dir 0700 and locks it until the store holds its own lock) →
    `dloco.preflight.record` (writes the config and ``fingerprint.json``) → `RunHandle`, which spawns the actors.

    Raises:
      PreflightError: a check failed (one line naming the field or file, and the fix).
      ConnectionError: the cluster does not answer.
    """
    launched = time.time()
    local = not (address or os.environ.get("RAY_ADDRESS"))
    path = preflight.resolve_run_dir(cfg, run_dir, job=under_job())
    resume = preflight.holds_run(path) if resume is None else resume

    def preparing(stage: str, done: int, total: int) -> None:
        if progress:
            progress({"preparing": stage, "done": done, "total": total})

    pf = preflight.check(cfg, path, resume, local=local, progress=preparing)
    needed = int(sum(g.num_cpus for g in cfg.learners.expand())) + 1
    owns = connect(address, num_cpus=max(needed, os.cpu_count() or 1), object_store_mb=cfg.store.object_store_mb)
    try:
        try:
            preflight.check_resources(cfg, ray.nodes())
        except preflight.PreflightError as e:
            if owns:
                raise
            sys.stderr.write(f"dloco: warning: {e}; unless such a node joins\n")
        if cfg.learners.compile_cache_dir:  # the driver's compiles (initial model, evaluation) hit the cache too
            jax.config.update("jax_compilation_cache_dir", str(Path(cfg.learners.compile_cache_dir).expanduser()))
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        preflight.check_devices(cfg)  # starts JAX's runtime in this process: only once Ray has forked its own
        with claim_run_dir(pf.run_dir, resume) as claim:
            preflight.record(pf, cfg)
            try:
                handle = RunHandle(cfg, pf.run_dir, owns, progress, launched)
                handle.resumed = resume
                return handle
            except BaseException:
                if not resume:  # the run never started (e.g. its store could not): leave nothing behind
                    claim.remove_new()
                raise
    except BaseException:
        if owns:
            ray.shutdown()
        raise
