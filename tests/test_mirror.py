"""The store mirrored to a `pyarrow.fs` URI (`dloco.mirror`), here a ``file://`` one: the run's state
survives losing the store's disk, a stale disk is refused, one store holds a URI at a time, and an
unreachable URI fails no commit. Same scenario and expected values as `test_durability`."""

import shutil
from pathlib import Path

import numpy as np
import pytest
from test_durability import REGISTRY, assert_state, commit, damage, open_store, play

from dloco import config, durable
from dloco.durable import RunDirLocked
from dloco.mirror import HOLDER, IDENTITY, Mirror, StaleStoreDir, horizon
from dloco.store import StoreCore


def files(d: Path) -> dict[str, bytes]:
    return {
        p.relative_to(d).as_posix(): p.read_bytes()
        for p in sorted(d.rglob("*"))
        if p.is_file() and p.name not in ("LOCK", HOLDER, IDENTITY) and "quarantine" not in p.parts
    }


def scenario(root: Path, uri: str, upto: int = 7, **kw):
    """`test_durability`'s scenario (7 commits, snap-3 and snap-6, registry as REGISTRY) on a
    mirrored store, left open."""
    s = open_store(root, mirror=Mirror(uri, **kw))
    play(s, upto)
    return s


def test_the_mirror_holds_what_the_store_dir_holds_and_a_lost_disk_restores_from_it(tmp_path):
    root, bucket = tmp_path / "store", tmp_path / "bucket"
    s = scenario(root, bucket.as_uri())
    # the same files, byte for byte, pruned alike (snap-3, snap-6; the log from p0 v3 and p1 v2 on)
    assert files(bucket) == files(root) and "registry.json" in files(bucket)
    assert sorted(files(bucket)) == [
        "registry.json",
        *(f"snap-0000000{n}/{f}" for n in (3, 6) for f in ("meta.json", "p000.npz", "p001.npz")),
        "wal/p000-v00000003.npz",
        "wal/p000-v00000004.npz",
        "wal/p001-v00000002.npz",
        "wal/p001-v00000003.npz",
    ]
    assert s.summary()["mirror"]["pending"] == 0 and s.errors == []
    s.close()
    shutil.rmtree(root)  # the head node and its disk are gone
    r = open_store(root, mirror=Mirror(bucket.as_uri(), host="another-head", lease_s=0.2))
    assert_state(r, [4, 3])
    assert r.commits == 7 and r.registry == REGISTRY and r.retired == {3}
    assert r.restored_from == f"snap-00000006 (pulled from {bucket.as_uri()})"
    assert r.mirror is not None and r.mirror.pulled == 11
    assert r.tokens_merged() == {0: [400, 300], 2: [100, 0]}
    assert commit(r, 1, 8.0).reason == "committed"  # and it goes on, mirrored
    assert files(bucket)["wal/p001-v00000004.npz"] == (root / "wal/p001-v00000004.npz").read_bytes()


def test_a_torn_upload_is_set_aside_at_restore_like_any_damaged_file(tmp_path):
    root, bucket = tmp_path / "store", tmp_path / "bucket"
    scenario(root, bucket.as_uri()).close()
    shutil.rmtree(root)
    damage(bucket / "wal/p000-v00000004.npz", "truncated")
    r = open_store(root, mirror=Mirror(bucket.as_uri()))
    assert_state(r, [3, 3])  # p0 v4 lost with its file; everything else intact
    assert [q["moved_to"] for q in r.quarantined] == [str(root / "quarantine" / "wal-p000-v00000004.npz")]
    assert "wal/p000-v00000004.npz" not in files(bucket)  # the mirror follows the store dir


def test_a_stale_store_dir_is_refused_and_nothing_is_overwritten(tmp_path):
    root, bucket, old = tmp_path / "store", tmp_path / "bucket", tmp_path / "old"
    s = scenario(root, bucket.as_uri(), upto=4)
    shutil.copytree(root, old, ignore=shutil.ignore_patterns("LOCK"))  # the disk as it was after 4 commits
    for i in (5, 6, 7):
        commit(s, (i - 1) % 2, float(i))
    s.close()
    before = files(bucket)
    shutil.rmtree(root)
    old.rename(root)  # that old disk comes back
    with pytest.raises(StaleStoreDir) as e:
        open_store(root, mirror=Mirror(bucket.as_uri()))
    assert str(e.value) == (
        f"store dir {root} is older than store.mirror={bucket.as_uri()} (snapshot 3 and versions {{0: 2, 1: 2}} "
        f"here; snapshot 6 and versions {{0: 4, 1: 3}} there): move {root} aside to restore from the mirror"
    )
    assert files(bucket) == before
    open_store(root).close()  # the lock was released: without the mirror the old dir opens as it is


def test_a_mirror_of_another_run_is_refused(tmp_path):
    bucket = (tmp_path / "bucket").as_uri()
    scenario(tmp_path / "a", bucket, upto=2).close()
    assert not (tmp_path / "bucket" / HOLDER).exists()  # closed cleanly: its lease given up
    with pytest.raises(StaleStoreDir, match="holds another run .a model of other shapes.: use another URI"):
        StoreCore(tmp_path / "b", [{"a": np.zeros(5, np.float32)}], [[np.zeros(5, np.float32)]], mirror=Mirror(bucket))


def test_horizon_counts_quarantined_state_and_snapshot_versions():
    names = ["wal/p000-v00000009.npz", "quarantine/wal-p001-v00000012.npz.1", "quarantine/snap-00000020", "x"]
    assert horizon(names, [3, 15]) == (20, {0: 9, 1: 15})
    assert horizon(["snap-00000008/meta.json", "wal/p002-v00000001.npz"]) == (8, {2: 1})


def test_one_store_holds_a_mirror_and_a_silent_holder_is_taken_over(tmp_path):
    bucket = (tmp_path / "bucket").as_uri()
    a = open_store(tmp_path / "a", mirror=Mirror(bucket, host="head-a"))
    assert a.mirror is not None
    renew = a.mirror._renew  # run a's renewal while b waits out the lease: a is alive
    with pytest.raises(RunDirLocked, match="in use by the store of another run .host head-a"):
        open_store(tmp_path / "b", mirror=Mirror(bucket, host="head-b", lease_s=0.3, sleep=lambda s: renew()))
    # a goes silent (its head lost, say): b waits the lease out, then takes the mirror over
    b = open_store(tmp_path / "b", mirror=Mirror(bucket, host="head-b", lease_s=0.3))
    assert b.mirror is not None and b.mirror.holder()["host"] == "head-b"
    assert commit(b, 0, 5.0).accepted
    # a's next commit stands (it is durable in a's dir) but is no longer mirrored, and says why
    assert commit(a, 0, 9.0).accepted and a.versions == [1, 0]
    assert a.errors[-1]["op"] == "mirror" and "taken over by the store on host head-b" in a.errors[-1]["error"]
    assert a.summary()["mirror"]["lost"]
    np.testing.assert_array_equal(durable.read_arrays(tmp_path / "bucket/wal/p000-v00000001.npz")[0]["v/a"], 5.0)


def test_an_unreachable_mirror_fails_no_commit_and_catches_up(tmp_path):
    root, bucket = tmp_path / "store", tmp_path / "bucket"
    s = open_store(root, mirror=Mirror(bucket.as_uri()))
    assert commit(s, 0, 1.0).accepted
    shutil.rmtree(bucket)
    bucket.write_bytes(b"")  # the URI cannot be written (a file where its directory was)
    assert commit(s, 1, 2.0).accepted and commit(s, 0, 3.0).accepted
    assert [e["op"] for e in s.errors] == ["mirror", "mirror"]
    bucket.unlink()  # reachable again (and empty): the next write uploads everything
    assert commit(s, 1, 4.0).accepted and len(s.errors) == 2
    assert files(bucket) == files(root) and s.summary()["mirror"]["pending"] == 0
    snap = [f"snap-00000003/{f}" for f in ("meta.json", "p000.npz", "p001.npz")]
    assert sorted(files(bucket)) == [*snap, "wal/p001-v00000002.npz"]  # snap-3 holds the rest of the log


def test_a_store_whose_dir_vanishes_deletes_nothing_from_the_mirror(tmp_path):
    root, bucket = tmp_path / "store", tmp_path / "bucket"
    s = scenario(root, bucket.as_uri())
    before = files(bucket)
    root.rename(tmp_path / "lost")  # the disk goes while the store runs
    with pytest.raises(OSError):
        commit(s, 1, 8.0)  # its log file cannot be written: refused, nothing applied
    assert s.versions == [4, 3] and s.mirror is not None
    with pytest.raises(FileNotFoundError, match="is gone: not mirrored"):
        s.mirror.sync()  # a sync in the instant after the dir went does not read it as "all deleted"
    assert files(bucket) == before


def test_store_mirror_config_is_checked_in_one_line():
    with pytest.raises(ValueError, match=r"store.mirror='bucket/run' is invalid: must be empty or a URI"):
        config.load(overrides=("store.mirror=bucket/run",))
    assert config.load(overrides=("store.mirror=gs://bucket/run",)).store.mirror == "gs://bucket/run"
