"""`dloco export` and `dloco eval` on what goes wrong around them (`dloco.export`): a damaged export
ends in one line naming the file, exit 2, nothing written; an export that fails midway leaves no
directory behind (it is written beside the target and renamed into place); and reading a run's
global model while its store prunes the snapshot and log files being read (``store.keep=1``)
re-lists and reads the newest committed Θ, never Θ_p⁰ of a fragment that has commits."""

import json
import shutil
import struct

import numpy as np
import pytest

from actors.cli import main
from dloco import config, export, preflight
from dloco.services import shards
from dloco.sim import run_local
from dloco.store import Commit, StoreCore


@pytest.fixture(scope="module")
def run_and_export(tiny_run, tmp_path_factory):
    """A finished 2-learner run directory and a safetensors export of it."""
    root = tmp_path_factory.mktemp("robust")
    cfg = config.load(overrides=(*tiny_run, "learners.count=2", "store.snapshot_every=2"))
    preflight.record(preflight.check(cfg, root / "run"), cfg)
    run_local(cfg, root / "run", steps=16).store.close()
    export.export(root / "run", root / "export", "safetensors")
    return root / "run", root / "export"


def tree(d):
    """Every file under `d` with its bytes: what a command must leave as it was."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _truncated(d):
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])


def _huge_header(d):  # the 8-byte length says 2**62 bytes of JSON follow: must not be allocated
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", 2**62) + data[8:])


def _meta_without(key):
    def damage(d):
        meta = json.loads((d / "dloco.json").read_text())
        del meta[key]
        (d / "dloco.json").write_text(json.dumps(meta))

    return damage


@pytest.mark.parametrize(
    "damage, file, message",
    [
        (_truncated, "model.safetensors", "truncated"),
        (lambda d: (d / "model.safetensors").write_bytes(b""), "model.safetensors", "0 bytes"),
        (lambda d: (d / "model.safetensors").write_bytes(b"\x01\x02\x03"), "model.safetensors", "3 bytes"),
        (_huge_header, "model.safetensors", f"header of {2**62:,} bytes"),
        (lambda d: (d / "model.safetensors").write_bytes(struct.pack("<Q", 5) + b"{nope"), "model.safetensors", "JSON"),
        (_meta_without("format"), "dloco.json", 'no "format"'),
        (_meta_without("versions"), "dloco.json", 'no "versions"'),
        (lambda d: (d / "dloco.json").write_text("[]"), "dloco.json", "not a JSON object"),
        (lambda d: (d / "config.json").write_text("{"), "config.json", "not JSON"),
        (lambda d: (d / "config.json").write_text('{"modle": {}}'), "config.json", "config error: modle={} is invalid"),
    ],
    ids=[
        "truncated",
        "empty",
        "shorter-than-header",
        "huge-header",
        "bad-header",
        "no-format",
        "no-versions",
        "meta-list",
        "config-not-json",
        "config-bad-key",
    ],
)
def test_a_damaged_export_is_one_line_naming_the_file(run_and_export, tmp_path, capsys, damage, file, message):
    shutil.copytree(run_and_export[1], tmp_path / "x")
    damage(tmp_path / "x")
    before = tree(tmp_path)
    assert main(["eval", str(tmp_path / "x"), "--batches", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"dloco: {tmp_path / 'x' / file}: ") and message in err, err
    assert tree(tmp_path) == before  # nothing written


def test_a_damaged_orbax_export_is_one_line_naming_it(run_and_export, tmp_path, capsys):
    export.export(run_and_export[0], tmp_path / "x", "orbax")
    for f in (tmp_path / "x" / "orbax").rglob("*"):
        if f.is_file():
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    before = tree(tmp_path)
    assert main(["eval", str(tmp_path / "x"), "--batches", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"dloco: {tmp_path / 'x' / 'orbax'}: not a readable Orbax"), (
        err
    )
    assert tree(tmp_path) == before


def test_an_export_that_fails_midway_leaves_nothing_and_can_be_retried(run_and_export, tmp_path, monkeypatch, capsys):
    import safetensors.numpy

    real = safetensors.numpy.save_file

    def disk_full(tensors, filename, metadata=None):  # half a file written, then the disk is full
        real(tensors, filename, metadata)
        with open(filename, "r+b") as fh:
            fh.truncate(fh.seek(0, 2) // 2)
        raise OSError(28, "No space left on device", filename)

    run_dir = run_and_export[0]
    monkeypatch.setattr(safetensors.numpy, "save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        export.export(run_dir, tmp_path / "new", "safetensors")
    (tmp_path / "empty").mkdir()  # an empty --out the user made: still there, still empty
    assert main(["export", str(run_dir), "--out", str(tmp_path / "empty")]) == 2
    assert "No space left on device" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]  # no half export, no temporary directory
    assert not any((tmp_path / "empty").iterdir())
    assert main(["eval", str(tmp_path / "new"), "--batches", "1"]) == 2  # nothing there to evaluate
    capsys.readouterr()
    monkeypatch.setattr(safetensors.numpy, "save_file", real)
    for out in ("new", "empty"):  # the same --out again: complete this time
        assert main(["export", str(run_dir), "--out", str(tmp_path / out)]) == 0
        assert export.load(tmp_path / out).versions == export.read_run(run_dir).versions
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "new"]
    (tmp_path / "mine").mkdir()  # readable by others as a directory made here is, not private as a temporary one
    assert {(tmp_path / d).stat().st_mode for d in ("new", "empty")} == {(tmp_path / "mine").stat().st_mode}


# ---- reading a store that prunes what is being read -------------------------------------------

N = 3


def open_store(root):
    """A 2-fragment store that snapshots every 2 commits and keeps one snapshot (``store.keep=1``):
    each snapshot removes the one before it and the log files it covers."""
    init = [{"a": np.zeros(N, np.float32)}, {"b": np.zeros(N, np.float32)}]
    return StoreCore(root, init, [[np.zeros(N, np.float32)], [np.zeros(N, np.float32)]], 2, 1, lock_wait_s=0)


def commit(s, *fragments):
    """One commit to each of `fragments` in turn; Θ_p at version v is 10·(p+1) + v everywhere, so
    any value read names the state it came from."""
    for p in fragments:
        x = np.full(N, 10 * (p + 1) + s.versions[p] + 1, np.float32)
        assert s.commit(Commit(p, s.versions[p], {"ab"[p]: x}, [-x], (), f"c{p}-{s.versions[p]}")).accepted


def newest(s):
    return s.versions, [s.fragment(p)[1]["ab"[p]] for p in range(2)]


def pruning_between_listing_and_reading(monkeypatch, when, then):
    """Runs `then` (commits: the store snapshots and prunes) just before the first file read that
    `when(path)` selects, as a store running beside the exporter does; once, or every time if `then`
    says so by returning True."""
    fired: list = []

    def wrapped(real):
        def load(path):
            if when(path) and (not fired or fired[-1]):
                fired.append(then())
            return real(path)

        return load

    for name in ("load_fragment", "load_entry"):  # a snapshot's files, the log's
        monkeypatch.setattr(export, name, wrapped(getattr(export, name)))
    return fired


def test_a_snapshot_pruned_as_it_is_read_is_read_again_not_replaced_by_initial_theta(tmp_path, monkeypatch):
    s = open_store(tmp_path)
    commit(s, 0, 1)  # snap-2 at versions [1, 1]; the log up to there pruned
    assert sorted(p.name for p in tmp_path.glob("snap-*")) == ["snap-00000002"] and not any(
        (tmp_path / "wal").iterdir()
    )

    def store_goes_on():  # snap-4 at [2, 2] replaces snap-2, then fragment 0 commits again (in the log only)
        commit(s, 0, 1, 0)

    fired = pruning_between_listing_and_reading(monkeypatch, lambda p: p.parent.name.startswith("snap-"), store_goes_on)
    versions, values, _ = export.read_global(tmp_path, 2)
    assert fired and not (tmp_path / "snap-00000002").exists()
    want_versions, want = newest(s)
    assert versions == want_versions == [3, 2]  # not fragment 1 at version 0, Θ_1⁰
    for p in range(2):
        np.testing.assert_array_equal(values[p]["ab"[p]], want[p])
    s.close()


def test_a_log_file_pruned_as_it_is_read_is_not_replaced_by_an_older_state(tmp_path, monkeypatch):
    s = open_store(tmp_path)
    commit(s, 0, 1, 0)  # snap-2 at [1, 1], fragment 0 at version 2 in the log

    def store_goes_on():  # snap-4 at [2, 2] prunes the log file being read; fragment 1 commits again
        commit(s, 1, 1)

    fired = pruning_between_listing_and_reading(monkeypatch, lambda p: p.parent.name == "wal", store_goes_on)
    versions, values, _ = export.read_global(tmp_path, 2)
    assert fired
    want_versions, want = newest(s)
    assert versions == want_versions == [2, 3]  # not fragment 0 at version 1 from snap-2
    for p in range(2):
        np.testing.assert_array_equal(values[p]["ab"[p]], want[p])
    s.close()


def test_a_store_that_prunes_under_every_read_is_an_error_not_initial_theta(tmp_path, monkeypatch):
    """Shard 0 of 2 (`read_shards`): the error reaches the caller, not taken for a shard that has
    not merged yet (whose fragments are Θ_p⁰)."""
    s = open_store(shards.store_root(tmp_path, 0, 2))
    commit(s, 0, 1)

    def store_goes_on():  # a new snapshot, and the one being read removed, before every read
        commit(s, 0, 1)
        return True

    fired = pruning_between_listing_and_reading(monkeypatch, lambda p: p.parent.name.startswith("snap-"), store_goes_on)
    with pytest.raises(export.ModelReadError, match=r"shard-0-of-2: .* pruned .* as they were read, \d+ times"):
        export.read_shards(tmp_path, 2, 2)
    assert len(fired) == export.READ_ATTEMPTS
    s.close()
