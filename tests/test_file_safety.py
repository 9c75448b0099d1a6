"""What dloco writes on disk is safe from a second run and from other local users, without Ray.

- Two starts on one new run dir: the loser deletes nothing of the winner's (`actors.launch.start`
  takes the run dir's lock before it creates anything there).
- Writes into a run dir (`dloco.durable`, `dloco.control`) replace a symlink planted at their
  temporary or final path instead of writing through it into another file.
- Run dirs and what the run creates in them are this user's only (directories 0700, files 0600).
- Ray's token (``~/.ray/auth_token``), which lets whoever reads it run code in the cluster, is left
  readable by this user only.
- ``stop-requested`` stops the run only if this user wrote it since this start of the run: an old,
  future-dated or foreign one is ignored with a warning.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import threading
import time

import pytest

from dloco import config, control, durable, preflight


@pytest.fixture(autouse=True)
def usual_umask():
    """The common umask (022), so that a mode that comes out private is what the code chose."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


# ---- two starts on one run dir ------------------------------------------------------------------
class _Run:
    """Stands in for `actors.supervisor.RunHandle`: its store takes ``store/LOCK`` as the store
    actor does (at once: `RunDirLocked` if another run's store holds it) and writes a file."""

    resumed = False
    started: list[_Run] = []

    def __init__(self, cfg, run_dir, owns_ray, progress=None, launched=None) -> None:
        durable.mkdir(run_dir / "store")
        self.lock = durable.RunDirLock(run_dir / "store")
        self.lock.acquire(wait_s=0)
        self.ident = threading.get_ident()
        durable.write_json(run_dir / "store" / "registry.json", {"run": self.ident})
        _Run.started.append(self)


@pytest.fixture
def stubbed_start(monkeypatch):
    """`actors.launch.start` with Ray, the corpus checks and the actors stubbed (`_Run`): what is left
    is what `start` itself does to the run dir."""
    from actors import launch

    _Run.started = []
    monkeypatch.setattr(preflight, "check", lambda cfg, path, resume, **kw: preflight.Preflight(path, resume, None, {}))
    monkeypatch.setattr(launch, "connect", lambda *a, **k: False)
    monkeypatch.setattr(launch.ray, "nodes", lambda: [])
    monkeypatch.setattr(preflight, "check_resources", lambda *a: None)
    monkeypatch.setattr(preflight, "check_devices", lambda *a: None)
    monkeypatch.setattr(launch, "RunHandle", _Run)
    yield launch
    for run in _Run.started:
        run.lock.release()


def test_a_second_start_on_the_same_new_run_dir_leaves_the_winners_run_whole(stubbed_start, tmp_path, monkeypatch):
    """Both starts pass the preflight while the directory does not exist yet (both are fresh runs);
    the loser's store then finds the winner's holding the store lock, and the loser cleaned up by
    removing the whole directory it thought it had made, the winner's files with it."""
    launch = stubbed_start
    run_dir = tmp_path / "runs" / "one"
    monkeypatch.setattr(launch, "CLAIM_WAIT_S", 0.3, raising=False)
    checked = threading.Barrier(2, timeout=10)  # both found the run dir new
    writing = threading.Barrier(2, timeout=1.5)  # both about to write their config (if nothing keeps one out)

    def check(cfg, path, resume, **kw):
        assert not path.exists()
        checked.wait()
        return preflight.Preflight(path, resume, None, {"run": "fingerprint"})

    record = preflight.record

    def record_together(pf, cfg):
        with contextlib.suppress(threading.BrokenBarrierError):
            writing.wait()
        return record(pf, cfg)

    monkeypatch.setattr(preflight, "check", check)
    monkeypatch.setattr(preflight, "record", record_together)
    cfg = config.load()
    outcome: dict[str, object] = {}

    def train(name):
        try:
            outcome[name] = launch.start(cfg, run_dir=run_dir)
        except Exception as e:  # noqa: BLE001 - the loser's error is checked below
            outcome[name] = e

    threads = [threading.Thread(target=train, args=(name,)) for name in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    won = [v for v in outcome.values() if isinstance(v, _Run)]
    lost = [v for v in outcome.values() if not isinstance(v, _Run)]
    assert len(won) == 1 and len(lost) == 1, outcome
    assert isinstance(lost[0], (durable.RunDirLocked, preflight.PreflightError)), repr(lost[0])
    # the winner's run is whole: its config, fingerprint and store are still there
    assert json.loads((run_dir / "fingerprint.json").read_text()) == {"run": "fingerprint"}
    assert config.load(run_dir / "config.json") == cfg
    assert durable.read_json(run_dir / "store" / "registry.json") == {"run": won[0].ident}


def test_a_start_that_fails_removes_what_it_wrote_and_nothing_else(stubbed_start, tmp_path, monkeypatch):
    """A failed fresh start leaves the disk as it found it: a directory it made is gone, in one that
    was there only the entries it added (its lock file too) are removed."""
    launch = stubbed_start

    class Broken:
        def __init__(self, cfg, run_dir, *a, **k):
            (run_dir / "metrics.jsonl").write_text("{}\n")
            raise RuntimeError("the store could not start")

    monkeypatch.setattr(launch, "RunHandle", Broken)
    cfg = config.load()
    new = tmp_path / "new"
    with pytest.raises(RuntimeError, match="could not start"):
        launch.start(cfg, run_dir=new)
    assert not new.exists()
    there = tmp_path / "there"
    there.mkdir()
    (there / "mine.txt").write_text("a file of the user's")
    with pytest.raises(RuntimeError, match="could not start"):
        launch.start(cfg, run_dir=there)
    assert sorted(p.name for p in there.iterdir()) == ["mine.txt"]


def test_a_start_makes_its_run_dir_private(stubbed_start, tmp_path):
    launch = stubbed_start
    run_dir = tmp_path / "runs" / "one"
    launch.start(config.load(), run_dir=run_dir)
    assert (mode(tmp_path / "runs"), mode(run_dir), mode(run_dir / "store")) == (0o700, 0o700, 0o700)
    assert mode(run_dir / "store" / "registry.json") == 0o600 and mode(run_dir / "store" / "LOCK") == 0o600


# ---- symlinks planted at the paths we write -----------------------------------------------------
@pytest.fixture
def victim(tmp_path):
    """A file elsewhere that a planted link points at: it must come out of every write unchanged."""
    path = tmp_path / "elsewhere" / "victim"
    path.parent.mkdir()
    path.write_text("precious")
    path.chmod(0o640)
    return path


def untouched(path) -> bool:
    return path.read_text() == "precious" and mode(path) == 0o640


def test_the_status_file_replaces_links_planted_at_its_temporary_and_final_paths(tmp_path, victim):
    run = tmp_path / "run"
    run.mkdir()
    (run / f".status.json.{os.getpid()}.tmp").symlink_to(victim)
    control.publish(run, {"merges": 3}, now=100.0)
    assert untouched(victim)
    assert json.loads((run / "status.json").read_text())["merges"] == 3 and not (run / "status.json").is_symlink()
    (run / "status.json").unlink()
    (run / "status.json").symlink_to(victim)
    control.publish(run, {"merges": 4}, now=101.0)
    assert untouched(victim) and not (run / "status.json").is_symlink()
    assert control.read(run, now=102.0)["merges"] == 4


def test_a_stop_request_replaces_a_link_planted_at_its_path(tmp_path, victim):
    run = tmp_path / "run"
    run.mkdir()
    control.publish(run, {"merges": 3})
    (run / "stop-requested").symlink_to(victim)
    control.request_stop(run)
    assert untouched(victim) and not (run / "stop-requested").is_symlink()
    assert float((run / "stop-requested").read_text()) == pytest.approx(time.time(), abs=60)


def test_durable_writes_and_the_lock_do_not_follow_planted_links(tmp_path, victim):
    root = tmp_path / "store"
    durable.mkdir(root)
    for name, write in [
        ("a", lambda p: durable.write(p, b"payload")),
        ("b", lambda p: durable.replace_bytes(p, b"pay", b"load")),
        ("c", lambda p: durable.write_json(p, {"k": 1})),
        ("d", lambda p: durable.write_stream(p, lambda fh: fh.write(b"streamed"))),
    ]:
        (root / name).symlink_to(victim)
        write(root / name)
        assert untouched(victim) and not (root / name).is_symlink(), name
    assert durable.read(root / "a") == b"payload" and durable.read_json(root / "c") == {"k": 1}
    (root / "LOCK").symlink_to(victim)
    lock = durable.RunDirLock(root)
    with pytest.raises(OSError):  # refused: a lock file is never one a link names
        lock.acquire(wait_s=0)
    assert untouched(victim) and not lock.held


# ---- modes --------------------------------------------------------------------------------------
def test_what_a_run_creates_is_this_users_only(tmp_path):
    run = tmp_path / "runs" / "one"
    durable.mkdir(run / "store" / "wal")
    assert [mode(d) for d in (tmp_path / "runs", run, run / "store", run / "store" / "wal")] == [0o700] * 4
    durable.write(run / "store" / "f", b"x")
    lock = durable.RunDirLock(run / "store")
    lock.acquire(wait_s=0)
    lock.release()
    control.publish(run, {"merges": 1})
    control.request_stop(run)
    durable.quarantine(run / "store", run / "store" / "f", "test")
    assert mode(run / "store" / "quarantine") == 0o700
    files = {"LOCK": run / "store" / "LOCK", "status": run / "status.json", "stop": run / "stop-requested"}
    assert {k: oct(mode(p)) for k, p in files.items()} == {k: oct(0o600) for k in files}
    assert mode(run / "store" / "quarantine" / "f") == 0o600


# ---- Ray's token --------------------------------------------------------------------------------
@pytest.fixture
def home(tmp_path, monkeypatch):
    """A home of its own, and a user who chose no authentication settings (as `dloco train` sees them)."""
    h = tmp_path / "home"
    h.mkdir()
    monkeypatch.setenv("HOME", str(h))
    for var in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS"):
        monkeypatch.delenv(var, raising=False)
    return h


def test_a_local_cluster_leaves_rays_token_readable_by_this_user_only(home, monkeypatch):
    """`connect` starting a local cluster with token authentication: Ray writes ``~/.ray/auth_token``
    with plain ``open(path, "w")`` (0644 in a 0755 ``~/.ray``); here Ray's own token writer stands in
    for ``ray.init``, which calls it."""
    from ray._private.authentication.authentication_token_setup import generate_and_save_token

    from actors import launch

    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    monkeypatch.setattr(launch.ray_constants, "ENABLE_RAY_CLUSTER", launch.ray_constants.ENABLE_RAY_CLUSTER)
    monkeypatch.setattr(launch.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(launch.ray, "init", lambda **kw: generate_and_save_token())
    monkeypatch.setattr(launch, "auth_mode", lambda: "token")
    assert launch.connect(None, num_cpus=1) is True
    token = home / ".ray" / "auth_token"
    assert len(token.read_text()) == 64  # Ray's token, written
    assert (oct(mode(home / ".ray")), oct(mode(token))) == (oct(0o700), oct(0o600))


def test_a_token_left_readable_is_tightened_at_the_next_start_but_never_through_a_link(home, victim, monkeypatch):
    from actors import launch

    (home / ".ray").mkdir(mode=0o755)
    token = home / ".ray" / "auth_token"
    token.write_text("t" * 64)
    token.chmod(0o644)
    named = home / "token-elsewhere"
    named.write_text("u" * 64)
    named.chmod(0o644)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(named))
    launch.protect_auth_token()
    assert (mode(token), mode(named)) == (0o600, 0o600)
    assert mode(home / ".ray") == 0o755  # not made by dloco: left as the user has it
    token.unlink()
    token.symlink_to(victim)
    launch.protect_auth_token()
    assert untouched(victim)


# ---- stop-requested -----------------------------------------------------------------------------
def test_a_stop_request_counts_only_if_this_user_wrote_it_since_this_start(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    run.mkdir()
    control.publish(run, {"merges": 1})
    started = time.time() - 10
    control.request_stop(run)
    stop = run / "stop-requested"
    assert control.stop_requested(run, since=started)
    # dated in the future (a skewed clock, or on purpose): it would stop this start and every later resume
    future = time.time() + 3600
    os.utime(stop, (future, future))
    assert not control.stop_requested(run, since=started)
    assert not control.stop_requested(run, since=time.time() + 60)  # a later resume
    assert "stop-requested" in capsys.readouterr().err  # ignored, with a warning
    # older than this start of the run: a stop that ended an earlier one
    os.utime(stop, (started - 60, started - 60))
    assert not control.stop_requested(run, since=started)
    assert capsys.readouterr().err == ""  # silently: every resume of a stopped run finds one
    os.utime(stop, (future, future))
    assert not control.stop_requested(run, since=started) and capsys.readouterr().err == ""  # warned once
    # another user's request (as root: really chowned; else this user appears as another)
    os.utime(stop)
    assert control.stop_requested(run, since=started)
    if os.getuid() == 0:
        os.chown(stop, 4242, 4242)
    else:
        uid = os.getuid()
        monkeypatch.setattr(os, "getuid", lambda: uid + 1)
    assert not control.stop_requested(run, since=started)
    assert "owned by" in capsys.readouterr().err
