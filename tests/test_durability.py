"""The store's durability under damage (`dloco.store`, `dloco.durable`): values restored, not call counts.

The scenario (`_scenario`): 2 fragments, `snapshot_every=3`, `keep=2`, 7 commits alternating
fragments, commit i holding the value i (outer state −i):

  commit   1   2   3        4   5   6        7
  fragment 0   1   0        1   0   1        0
  version  1   1   2        2   3   3        4
                   snap-3 [2, 1]    snap-6 [3, 3]   (log only: p0 v4)

After pruning the log holds p0 v3, v4 and p1 v2, v3. Registry: learner 0 incarnation 2, 1 → 2
(after snap-3), 2 → 2 (after snap-6, its push merged in commit 7), 3 retired.
"""

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from dloco import durable, events
from dloco.store import Commit, MergedPush, RunDirLocked, StoreCore

ROOT = Path(__file__).resolve().parent.parent
VALUES = {0: {0: 0.0, 1: 1.0, 2: 3.0, 3: 5.0, 4: 7.0}, 1: {0: 0.0, 1: 2.0, 2: 4.0, 3: 6.0}}  # p → v → value
NAMES = ("a", "b")
REGISTRY = {0: 2, 1: 2, 2: 2, 3: 1}


def initial():
    return [{"a": np.zeros((2, 2), np.float32)}, {"b": np.zeros(3, np.float32)}]


def outer():
    return [[np.zeros((2, 2), np.float32)], [np.zeros(3, np.float32)]]


def open_store(root, **kw) -> StoreCore:
    return StoreCore(root, initial(), outer(), **{"snapshot_every": 3, "keep": 2, "lock_wait_s": 0, **kw})


def commit(s, p, value, pushes=((0, 2, 10),), cid=None):
    x = np.full((2, 2) if p == 0 else 3, value, np.float32)
    merged = tuple(MergedPush(m, inc, step, 100, 10, {"epoch": 0, "index": step}) for m, inc, step in pushes)
    return s.commit(Commit(p, s.versions[p], {NAMES[p]: x}, [-x], merged, cid or f"c{p}-{s.versions[p]}-{value}"))


def play(s, upto: int = 7) -> None:
    """The scenario's registrations and its first `upto` commits, on the open store `s`."""
    for m in (0, 0, 1, 2, 3):
        s.register(m)
    s.retire(3)
    for i in range(1, upto + 1):
        if i == 5:
            s.register(1)
        if i == 7:
            s.register(2)
        pushes = ((0, 2, 10 * i), (2, 2, 10)) if i == 7 else ((0, 2, 10 * i),)
        assert commit(s, (i - 1) % 2, float(i), pushes).reason == "committed"


def _scenario(root) -> None:
    s = open_store(root)
    play(s)
    assert s.versions == [4, 3] and s.registry == REGISTRY
    assert sorted(p.name for p in (root / "wal").iterdir()) == [
        "p000-v00000003.npz",
        "p000-v00000004.npz",
        "p001-v00000002.npz",
        "p001-v00000003.npz",
    ]
    assert sorted(p.name for p in root.glob("snap-*")) == ["snap-00000003", "snap-00000006"]
    s.close()


def assert_state(s, versions):
    assert s.versions == versions
    for p, v in enumerate(versions):
        expected = VALUES[p][v]
        np.testing.assert_array_equal(s.fragment(p)[1][NAMES[p]], np.full((2, 2) if p == 0 else 3, expected))
        np.testing.assert_array_equal(s.outer_state(p)[0], -s.fragment(p)[1][NAMES[p]])
        assert s.fragments[p].commit_id == (f"c{p}-{v - 1}-{expected}" if v else "")


def damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "zero_length":
        path.write_bytes(b"")
    elif how == "bit_flip":
        i = 32 + (len(data) - 32) // 2  # in the payload, past the 32-byte header
        path.write_bytes(data[:i] + bytes([data[i] ^ 0x10]) + data[i + 1 :])
    else:
        path.unlink()


FILES = {
    "wal": "wal/p000-v00000004.npz",
    "snap_fragment": "snap-00000006/p001.npz",
    "snap_meta": "snap-00000006/meta.json",
    "registry": "registry.json",
}


@pytest.mark.parametrize("how", ["truncated", "zero_length", "bit_flip", "missing"])
@pytest.mark.parametrize("kind", list(FILES))
def test_a_damaged_file_is_quarantined_and_the_newest_intact_state_restored(tmp_path, kind, how):
    _scenario(tmp_path)
    damage(tmp_path / FILES[kind], how)
    r = open_store(tmp_path)
    # only the log's p0 v4 is lost when that file is; a damaged snap-6 falls back to snap-3 + the log
    versions = [3, 3] if kind == "wal" else [4, 3]
    assert_state(r, versions)
    assert r.commits == sum(versions)
    assert r.restored_from == ("snap-00000003" if kind.startswith("snap") else "snap-00000006")
    assert r.registry == REGISTRY and r.retired == {3}
    assert r.tokens_merged() == ({0: [400, 300], 2: [100, 0]} if kind != "wal" else {0: [300, 300]})
    q = r.quarantined
    if kind == "wal" and how == "missing":
        assert q == []  # nothing to set aside: the commit is simply not on disk
    elif kind == "wal":
        assert [(x["path"], x["moved_to"]) for x in q] == [
            (str(tmp_path / FILES[kind]), str(tmp_path / "quarantine" / "wal-p000-v00000004.npz"))
        ]
        assert (tmp_path / "quarantine" / "wal-p000-v00000004.npz").is_file()
    elif kind.startswith("snap"):
        assert [(x["path"], x["moved_to"]) for x in q] == [
            (str(tmp_path / "snap-00000006"), str(tmp_path / "quarantine" / "snap-00000006"))
        ]
        assert Path(FILES[kind]).name in q[0]["reason"] and (tmp_path / "quarantine" / "snap-00000006").is_dir()
        assert not (tmp_path / "snap-00000006").exists()
    else:
        moved = None if how == "missing" else str(tmp_path / "quarantine" / "registry.json")
        assert [(x["path"], x["moved_to"]) for x in q] == [(str(tmp_path / "registry.json"), moved)]
        assert durable.read_json(tmp_path / "registry.json")["registry"] == {str(k): v for k, v in REGISTRY.items()}
    if how == "missing":
        assert all("missing" in x["reason"] for x in q)
    # it goes on: two more commits, and a restart restores them without finding anything damaged
    assert commit(r, 0, 100.0).accepted and commit(r, 1, 101.0).accepted
    r.close()
    again = open_store(tmp_path)
    assert again.versions == [versions[0] + 1, versions[1] + 1] and again.quarantined == []
    np.testing.assert_array_equal(again.fragment(0)[1]["a"], np.full((2, 2), 100.0))
    np.testing.assert_array_equal(again.fragment(1)[1]["b"], np.full(3, 101.0))
    again.close()


def _full_state(s):
    frs = [(f.version, f.commit_id, f.ledger, f.values, f.outer_state) for f in s.fragments]
    return frs, s.registry, s.retired, s.commits


def test_a_damaged_newest_snapshot_falls_back_to_the_previous_one_plus_the_log(tmp_path):
    _scenario(tmp_path)
    ref = open_store(tmp_path)
    expected = _full_state(ref)
    ref.close()
    damage(tmp_path / "snap-00000006/p000.npz", "bit_flip")
    r = open_store(tmp_path)
    frs, registry, retired, commits = _full_state(r)
    assert (registry, retired, commits) == expected[1:] and r.restored_from == "snap-00000003"
    for (v, cid, ledger, values, state), (v0, cid0, ledger0, values0, state0) in zip(frs, expected[0], strict=True):
        assert (v, cid, ledger) == (v0, cid0, ledger0)
        assert values.keys() == values0.keys() and all(np.array_equal(values[k], values0[k]) for k in values)
        assert all(np.array_equal(a, b) for a, b in zip(state, state0, strict=True))
    r.close()
    # and a damaged newest log file too: the next older one (p0 v3) is used
    shutil.copytree(tmp_path / "quarantine" / "snap-00000006", tmp_path / "snap-00000006")
    damage(tmp_path / "snap-00000006/meta.json", "truncated")
    damage(tmp_path / "wal/p000-v00000004.npz", "bit_flip")
    r = open_store(tmp_path)
    assert_state(r, [3, 3])
    assert [Path(x["path"]).name for x in r.quarantined] == ["snap-00000006", "p000-v00000004.npz"]
    assert sorted(p.name for p in (tmp_path / "quarantine").iterdir()) == [
        "snap-00000006",
        "snap-00000006.1",
        "wal-p000-v00000004.npz",
    ]
    r.close()


def test_without_snapshots_a_damaged_log_file_falls_back_to_the_previous_version(tmp_path):
    s = open_store(tmp_path, snapshot_every=100)
    s.register(0)
    for v in (1, 2, 3):
        commit(s, 0, float(v))
    s.close()
    damage(tmp_path / "wal/p000-v00000003.npz", "truncated")
    r = open_store(tmp_path, snapshot_every=100)
    assert r.versions == [2, 0] and r.restored_from == "log" and len(r.quarantined) == 1
    np.testing.assert_array_equal(r.fragment(0)[1]["a"], np.full((2, 2), 2.0))
    r.close()


@pytest.mark.parametrize("snapshot_every", [1, 1000])
def test_versions_past_ten_to_the_eighth_are_compared_as_numbers(tmp_path, snapshot_every):
    s = open_store(tmp_path, snapshot_every=snapshot_every, keep=2)
    s.fragments[0].version = 99_999_998  # as if that many commits had happened
    s.commits = 99_999_998 if snapshot_every == 1 else 1  # snapshot names cross 10^8 too (or no snapshot)
    for value in (1.0, 2.0, 3.0):  # versions 99_999_999, 100_000_000, 100_000_001
        assert commit(s, 0, value).reason == "committed"
    s.close()
    r = open_store(tmp_path, snapshot_every=snapshot_every, keep=2)
    assert r.versions == [100_000_001, 0]
    np.testing.assert_array_equal(r.fragment(0)[1]["a"], np.full((2, 2), 3.0))
    wal = sorted(p.name for p in (tmp_path / "wal").iterdir())
    if snapshot_every == 1:  # pruning kept the newest two snapshots and the log from the oldest kept on
        assert r.restored_from == "snap-100000001" and r.commits == 100_000_001
        assert sorted(p.name for p in tmp_path.glob("snap-*")) == ["snap-100000000", "snap-100000001"]
        assert wal == ["p000-v100000001.npz"]
    else:
        assert r.restored_from == "log"
        assert wal == ["p000-v100000000.npz", "p000-v100000001.npz", "p000-v99999999.npz"]
    assert commit(r, 0, 4.0).reason == "committed" and r.versions == [100_000_002, 0]
    r.close()


def test_a_second_store_on_the_directory_is_refused_until_the_first_closes(tmp_path):
    first = open_store(tmp_path)
    with pytest.raises(RunDirLocked) as e:
        open_store(tmp_path, lock_wait_s=0.1)
    msg = str(e.value)
    assert "\n" not in msg and str(tmp_path) in msg and f"pid {os.getpid()}" in msg and "--run-dir" in msg
    assert isinstance(e.value, RuntimeError)
    first.close()
    first.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        commit(first, 0, 1.0)
    second = open_store(tmp_path)
    assert commit(second, 0, 1.0).accepted
    second.close()


def test_a_lock_held_by_another_process_is_refused_and_waited_for(tmp_path):
    code = textwrap.dedent(f"""
        import sys, time
        from dloco.durable import RunDirLock
        RunDirLock({str(tmp_path)!r}).acquire(0)
        print("locked", flush=True)
        time.sleep(float(sys.argv[1]))
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    holder = subprocess.Popen([sys.executable, "-c", code, "60"], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirLocked, match=f"pid {holder.pid} on host"):
            open_store(tmp_path, lock_wait_s=0.2)
    finally:
        holder.kill()
        holder.wait()
    # a predecessor still exiting: the lock is taken once it is gone, within lock_wait_s
    holder = subprocess.Popen([sys.executable, "-c", code, "0.5"], stdout=subprocess.PIPE, text=True, env=env)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
    t0 = time.monotonic()
    s = open_store(tmp_path, lock_wait_s=30)
    assert time.monotonic() - t0 < 20 and holder.wait(timeout=30) == 0
    s.close()


def test_leftover_temporary_files_are_removed_and_legacy_files_read(tmp_path):
    s = open_store(tmp_path, snapshot_every=100)
    s.register(0)
    commit(s, 1, 5.0)
    s.close()
    (tmp_path / ".tmp-x").write_bytes(b"partial")
    (tmp_path / "wal" / ".tmp-y").write_bytes(b"partial")
    (tmp_path / "tmp-snap").mkdir()
    # files from before checksums: a plain .npz log file and a plain JSON registry
    arrays, meta = durable.read_arrays(tmp_path / "wal" / "p001-v00000001.npz")
    (tmp_path / "wal" / "p001-v00000001.npz").write_bytes(legacy_npz(arrays, meta))
    (tmp_path / "registry.json").write_text(json.dumps({"registry": {"0": 4}, "retired": []}))
    r = open_store(tmp_path, snapshot_every=100)
    assert sorted(p.name for p in tmp_path.rglob("*tmp-*")) == [] and r.quarantined == []
    assert r.versions == [0, 1] and r.registry == {0: 4}
    np.testing.assert_array_equal(r.fragment(1)[1]["b"], np.full(3, 5.0))
    r.close()


def legacy_npz(arrays: dict, meta: dict) -> bytes:
    """A log file's payload as it was written before `durable.write_arrays`: an ``.npz``, meta in ``meta``."""
    buf = io.BytesIO()
    np.savez(buf, **arrays, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8))
    return buf.getvalue()


def test_log_files_of_the_blake2b_format_are_read_and_verified(tmp_path):
    s = open_store(tmp_path, snapshot_every=100)
    s.register(0)
    commit(s, 1, 5.0)
    commit(s, 1, 6.0)
    s.close()
    for v in (1, 2):  # as DLOCOv1 wrote them: the .npz behind a blake2b-128 header
        path = tmp_path / "wal" / f"p001-v{v:08d}.npz"
        payload = legacy_npz(*durable.read_arrays(path))
        digest = hashlib.blake2b(payload, digest_size=16).digest()
        path.write_bytes(b"DLOCOv1\n" + len(payload).to_bytes(8, "little") + digest + payload)
    flipped = bytearray((tmp_path / "wal" / "p001-v00000002.npz").read_bytes())
    flipped[-40] ^= 1
    (tmp_path / "wal" / "p001-v00000002.npz").write_bytes(flipped)
    r = open_store(tmp_path, snapshot_every=100)
    assert r.versions == [0, 1], "the flipped v1 file is refused, the intact one restored"
    assert [(Path(q["path"]).name, q["reason"]) for q in r.quarantined] == [
        ("p001-v00000002.npz", "checksum mismatch (bit flip)")
    ]
    np.testing.assert_array_equal(r.fragment(1)[1]["b"], np.full(3, 5.0))
    r.close()


def test_array_files_round_trip_views_of_one_buffer(tmp_path):
    arrays = {
        "f": np.arange(7, dtype=np.float32).reshape(7, 1),
        "t": np.arange(12, dtype=np.int64).reshape(3, 4).T,  # not contiguous: written as its contiguous copy
        "e": np.zeros((0, 3), np.float16),
        "s": np.float32(2.5).reshape(()),
    }
    durable.write_arrays(tmp_path / "a", arrays, {"k": [1, "x"]})
    got, meta = durable.read_arrays(tmp_path / "a")
    assert meta == {"k": [1, "x"]} and list(got) == ["f", "t", "e", "s"]
    for k, x in arrays.items():
        assert got[k].dtype == x.dtype and got[k].shape == x.shape and np.array_equal(got[k], x), k
    assert all(x.ctypes.data % 64 == got["f"].ctypes.data % 64 for x in got.values() if x.size)
    data = bytearray((tmp_path / "a").read_bytes())
    data[-100] ^= 4
    (tmp_path / "a").write_bytes(data)
    with pytest.raises(durable.CorruptFileError, match="checksum mismatch"):
        durable.read_arrays(tmp_path / "a")


def test_a_failed_snapshot_does_not_fail_its_durable_commit(tmp_path, monkeypatch):
    s = open_store(tmp_path, snapshot_every=2)
    commit(s, 0, 1.0)

    def full(final, fill):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(durable, "write_dir", full)
        result = commit(s, 1, 2.0)
    assert result.reason == "committed" and s.versions == [1, 1] and not list(tmp_path.glob("snap-*"))
    assert [e["op"] for e in s.errors] == ["snapshot"] and "No space" in s.errors[0]["error"]
    commit(s, 0, 3.0)
    commit(s, 1, 4.0)  # the next due snapshot is written
    assert [p.name for p in tmp_path.glob("snap-*")] == ["snap-00000004"] and len(s.errors) == 1
    s.close()
    r = open_store(tmp_path, snapshot_every=2)
    assert r.versions == [2, 2] and r.restored_from == "snap-00000004"
    r.close()


def test_the_service_reports_quarantined_files_and_holds_the_lock(tmp_path, data_cache):
    from dloco import config
    from dloco.services.store import StoreService
    from dloco.sim import SimTransport, VirtualClock

    cfg = config.load(None, ["preset=micro", f"data.cache_dir={data_cache}"])
    svc = StoreService(cfg, tmp_path, SimTransport(set()), VirtualClock())
    svc.register(0)
    with pytest.raises(RunDirLocked):
        StoreService(cfg, tmp_path, SimTransport(set()), VirtualClock(), lock_wait_s=0)
    svc.close()
    damage(tmp_path / "store" / "registry.json", "bit_flip")
    again = StoreService(cfg, tmp_path, SimTransport(set()), VirtualClock(), lock_wait_s=0)
    (start,) = again.drain_events()
    parsed = events.parse(start)
    assert isinstance(parsed, events.StoreStart) and len(parsed.quarantined) == 1
    assert parsed.quarantined[0]["path"] == str(tmp_path / "store" / "registry.json")
    assert "checksum" in parsed.quarantined[0]["reason"]
    again.close()


# ---- a real full and read-only disk: a 1 MiB tmpfs in a private mount namespace -----------------
DISK_SCRIPT = """
import errno, json, os, shutil, subprocess, sys
from pathlib import Path
import numpy as np
from dloco.store import Commit, StoreCore

mnt = Path(sys.argv[1])
N = 4096  # float32: 16 KiB per array, two arrays per fragment file
out = {}


def open_store(root, every):
    init = [{"a": np.zeros(N, np.float32)}, {"b": np.zeros(N, np.float32)}]
    return StoreCore(root, init, [[np.zeros(N, np.float32)], [np.zeros(N, np.float32)]], every, 2, lock_wait_s=0)


def commit(s, p, value):
    x = np.full(N, value, np.float32)
    return s.commit(Commit(p, s.versions[p], {"ab"[p]: x}, [-x], (), f"c{p}-{s.versions[p]}-{value}"))


def state(s):
    return [s.versions, [float(s.fragment(p)[1]["ab"[p]][0]) for p in range(2)], s.registry]


def leftovers(root):
    return sorted(str(p) for p in root.rglob("*") if p.name.startswith((".tmp-", "tmp-")))


def errno_of(f):
    try:
        f()
    except OSError as e:
        return errno.errorcode[e.errno]
    return None


def fill(path, nbytes):
    with open(path, "wb") as fh:
        fh.write(b"x" * nbytes)


def free():
    st = os.statvfs(mnt)
    return st.f_bavail * st.f_frsize


# 1. disk full at a commit's log write: not acknowledged, nothing changed, nothing left over
root = mnt / "full"
fill(mnt / "filler", 128 * 1024)
s = open_store(root, 1000)
s.register(0)
acked, i, failed = None, 0, None
while failed is None and i < 200:
    i += 1
    before = state(s)
    failed = errno_of(lambda: commit(s, i % 2, float(i)))
    acked = before if failed else state(s)
out["full"] = {"errno": failed, "commits": i - 1, "state_ok": state(s) == acked, "leftovers": leftovers(root)}
s.close()
r = open_store(root, 1000)
out["full"]["restored_ok"] = state(r) == acked
(mnt / "filler").unlink()
out["full"]["retry"] = commit(r, i % 2, float(i)).reason
out["full"]["more"] = commit(r, (i + 1) % 2, float(i + 1)).reason
final = state(r)
r.close()
r = open_store(root, 1000)
# commits 1..i+1 went to fragment j % 2: the last even one to fragment 0, the last odd one to 1
expected = [[(i + 1) // 2, (i + 2) // 2], [float(j) for j in sorted((i, i + 1), key=lambda j: j % 2)], {0: 1}]
out["full"]["final_ok"] = state(r) == final == expected
r.close()
shutil.rmtree(root)

# 2. the log write fits, the snapshot after it does not: the commit stands, the snapshot comes later
root = mnt / "snap"
s = open_store(root, 2)
commit(s, 0, 1.0)
wal_pages = -(-max(p.stat().st_size for p in (root / "wal").iterdir()) // 4096)
fill(mnt / "filler", free() - (wal_pages + 1) * 4096)  # room for one log file and a page
res = commit(s, 1, 2.0)
out["snap"] = {
    "reason": res.reason,
    "versions": s.versions,
    "errors": s.errors,
    "snaps": sorted(p.name for p in root.glob("snap-*")),
    "leftovers": leftovers(root),
}
(mnt / "filler").unlink()
commit(s, 0, 3.0)
commit(s, 1, 4.0)
out["snap"]["snaps_after"] = sorted(p.name for p in root.glob("snap-*"))
out["snap"]["errors_after"] = len(s.errors)
final = state(s)
s.close()
r = open_store(root, 2)
out["snap"]["restored_ok"] = state(r) == final and r.restored_from == "snap-00000004"

# 3. read-only: commits and registrations fail unacknowledged, then go on once writable again
before = state(r)
subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
out["ro"] = {
    "commit": errno_of(lambda: commit(r, 0, 5.0)),
    "register": errno_of(lambda: r.register(7)),
    "state_ok": state(r) == before,
}
subprocess.run(["mount", "-o", "remount,rw", str(mnt)], check=True)
out["ro"]["commit_after"] = commit(r, 0, 5.0).reason
out["ro"]["incarnation_after"] = r.register(7).incarnation
final = state(r)
r.close()
r = open_store(root, 2)
out["ro"]["restored_ok"] = state(r) == final and r.versions == [3, 2] and r.registry == {7: 1}
out["ro"]["leftovers"] = leftovers(mnt)
r.close()
print(json.dumps(out))
"""


def _can_mount_tmpfs(mnt: Path) -> str | None:
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return "unshare or mount not installed"
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {mnt}"], capture_output=True, text=True
    )
    return None if probe.returncode == 0 else f"cannot mount a tmpfs in a private mount namespace: {probe.stderr}"


def test_a_full_or_read_only_disk_fails_commits_cleanly_and_loses_nothing(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    reason = _can_mount_tmpfs(mnt)
    if reason:
        pytest.skip(reason)
    script = tmp_path / "disk.py"
    script.write_text(DISK_SCRIPT)
    cmd = f"mount -t tmpfs -o size=1m tmpfs {mnt} && exec {sys.executable} {script} {mnt}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(["unshare", "-m", "sh", "-c", cmd], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    full = out["full"]
    assert full["errno"] == "ENOSPC" and full["commits"] > 5, full
    assert full["state_ok"] and full["restored_ok"] and full["leftovers"] == []
    assert full["retry"] == "committed" and full["more"] == "committed" and full["final_ok"], full
    snap = out["snap"]
    assert snap["reason"] == "committed" and snap["versions"] == [1, 1] and snap["snaps"] == [], snap
    assert [e["op"] for e in snap["errors"]] == ["snapshot"] and "No space" in snap["errors"][0]["error"]
    assert snap["leftovers"] == [] and snap["snaps_after"] == ["snap-00000004"] and snap["errors_after"] == 1
    assert snap["restored_ok"]
    ro = out["ro"]
    assert ro["commit"] == "EROFS" and ro["register"] == "EROFS" and ro["state_ok"], ro
    assert ro["commit_after"] == "committed" and ro["incarnation_after"] == 1 and ro["restored_ok"], ro
    assert ro["leftovers"] == []


@pytest.mark.parametrize("bad", [np.nan, 1e30, -np.inf])
@pytest.mark.parametrize("where", ["wal", "snap_fragment"])
def test_a_file_with_a_valid_checksum_but_implausible_values_is_quarantined(tmp_path, where, bad):
    """A file that verifies may still hold values no commit can make (NaN, ±inf, 1e30: past
    ~1.8e19 its square overflows float32 and every later commit's norm with it): it is set aside
    as a damaged file is, and the newest plausible state restored."""
    _scenario(tmp_path)
    path = tmp_path / FILES[where]
    z, meta = durable.read_arrays(path)
    key = next(k for k in z if k.startswith("v/"))
    z[key] = np.full_like(z[key], bad)
    durable.write_arrays(path, z, meta)  # a valid checksum over the bad values
    r = open_store(tmp_path)
    assert_state(r, [3, 3] if where == "wal" else [4, 3])
    (q,) = r.quarantined
    assert q["reason"].startswith(("implausible values", "p001.npz: implausible values")), q
    assert all(np.isfinite(x).all() for f in r.fragments for x in f.values.values())
    r.close()


def test_a_store_whose_every_file_is_damaged_refuses_to_start_over_unless_told(tmp_path):
    """Every snapshot and log file damaged: starting again from the initial model would silently
    lose every commit, so the store's start fails naming what it set aside; `fresh_if_lost` (the
    user's `store.fresh_if_lost=true`) starts over instead."""
    from dloco.store import StateLostError

    _scenario(tmp_path)
    for path in [*tmp_path.glob("snap-*/p000.npz"), *(tmp_path / "wal").iterdir()]:
        damage(path, "bit_flip")
    for _ in range(2):  # and again: the first start set them aside, the second must not find a new run
        with pytest.raises(StateLostError, match=r"every snapshot and log file is damaged .*fresh_if_lost=true"):
            open_store(tmp_path)
    r = open_store(tmp_path, fresh_if_lost=True)  # what the first start set aside stays in quarantine/
    assert r.versions == [0, 0] and r.restored_from is None and (tmp_path / "quarantine").is_dir()
    r.close()
