"""The store's log of steps (`dloco.commitlog`, `dloco.recipe`): a commit logged as what it merged is
replayed at a restart to the very bits that were committed; what cannot be replayed is set aside."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dloco import commitlog, durable, export, recipe
from dloco.commitlog import WAL_NAME, LogStep
from dloco.services.store import StoreService
from dloco.sim import SimTransport, VirtualClock


@pytest.fixture
def run(store_run):
    """`store_run` (conftest): its store wrote steps; the state it ended with."""
    cfg, run_dir, final, _ = store_run
    return cfg, run_dir, final


def entries(run_dir, p=None):
    """(version, kind, bytes) of the log entries, oldest first."""
    got = []
    for (q, v), path in durable.numbered(run_dir / "store" / "wal", WAL_NAME):
        if p in (None, q):
            got.append((q, v, "step" if commitlog.is_step(path) else "state", path.stat().st_size))
    return got


def reopen(cfg, run_dir):
    return StoreService(cfg, run_dir, SimTransport(set()), VirtualClock())


def same_state(a, b):
    assert a.version == b.version and a.commit_id == b.commit_id and a.ledger == b.ledger and a.norms == b.norms
    for x, y in [(a.values, b.values), (dict(enumerate(a.outer_state)), dict(enumerate(b.outer_state)))]:
        assert x.keys() == y.keys()
        for k in x:
            assert x[k].dtype == y[k].dtype and np.array_equal(x[k], y[k]), k  # bit for bit
    assert (a.shadow is None) == (b.shadow is None)
    for k in a.shadow or {}:
        assert np.array_equal(a.shadow[k], b.shadow[k]), k


def test_the_first_commit_of_each_fragment_is_its_state_then_steps_a_sixth_of_its_size(run):
    cfg, run_dir, final = run
    log = entries(run_dir)
    for p in range(2):
        mine = [e for e in log if e[0] == p]
        assert [v for _, v, _, _ in mine] == list(range(1, final[p].version + 1)) and len(mine) >= 5
        assert mine[0][2] == "state" and {k for _, _, k, _ in mine[1:]} == {"step"}, mine
        state, steps = mine[0][3], [b for _, _, _, b in mine[1:]]
        # two int4 pushes and the int4 q (half a byte per parameter and a float16 per 128 each:
        # 1.55 bytes), against Θ_p, momentum, delay buffer and shadow in float32 (16 bytes); the
        # micro model's small tensors add their index and padding to both
        assert max(steps) < state / 6, (state, steps)


def test_a_restart_replays_the_steps_to_the_committed_bits(run):
    cfg, run_dir, final = run
    s = reopen(cfg, run_dir)
    assert s.core.restored_from == "log" and s.core.quarantined == []
    for p in range(2):
        same_state(s.core.fragments[p], final[p])
        assert s.core.fragments[p].chain == final[p].chain == final[p].version - 1
    s.close()


def test_an_export_reads_the_replayed_state(run):
    cfg, run_dir, final = run
    versions, values, source = export.read_global(run_dir / "store", 2)
    assert versions == [f.version for f in final] and source == "log"
    for p in range(2):
        assert all(np.array_equal(values[p][k], final[p].values[k]) for k in final[p].values)


def test_a_damaged_step_keeps_the_state_under_it_and_sets_aside_the_steps_it_carried(run, tmp_path):
    cfg, run_dir, final = run
    copy = tmp_path / "run"
    (copy / "store" / "wal").mkdir(parents=True)
    for q, v, _, _ in entries(run_dir):
        name = f"p{q:03d}-v{v:08d}.npz"
        (copy / "store" / "wal" / name).write_bytes((run_dir / "store" / "wal" / name).read_bytes())
    (copy / "store" / "registry.json").write_bytes((run_dir / "store" / "registry.json").read_bytes())
    top = final[0].version
    # the state at version 3 of fragment 0: replayed from a log that ends there
    for v in range(4, top + 1):
        (copy / "store" / "wal" / f"p000-v{v:08d}.npz").rename(copy / f"held-{v}")
    s = reopen(cfg, copy)
    at3 = dataclasses.replace(s.core.fragments[0])
    s.close()
    for v in range(4, top + 1):
        (copy / f"held-{v}").rename(copy / "store" / "wal" / f"p000-v{v:08d}.npz")
    flipped = copy / "store" / "wal" / "p000-v00000004.npz"
    data = bytearray(flipped.read_bytes())
    data[-7] ^= 1
    flipped.write_bytes(data)
    s = reopen(cfg, copy)
    assert s.core.versions == [3, final[1].version]
    same_state(s.core.fragments[0], at3)
    same_state(s.core.fragments[1], final[1])
    reasons = {r["path"].rsplit("/", 1)[1]: r["reason"] for r in s.core.quarantined}
    assert reasons.pop("p000-v00000004.npz") == "checksum mismatch (bit flip)"
    assert sorted(reasons) == [f"p000-v{v:08d}.npz" for v in range(5, top + 1)]
    for name, r in reasons.items():  # each in turn: the one under it was not restored either
        assert r == f"unreachable: no state of version {int(name[6:14]) - 1} to replay it on", reasons
    s.close()


def test_a_step_that_replays_to_other_bits_is_set_aside(run, tmp_path):
    cfg, run_dir, final = run
    wal = tmp_path / "store" / "wal"
    wal.mkdir(parents=True)
    for q, v, _, _ in entries(run_dir, p=1):
        name = f"p{q:03d}-v{v:08d}.npz"
        (wal / name).write_bytes((run_dir / "store" / "wal" / name).read_bytes())
    (tmp_path / "store" / "registry.json").write_bytes((run_dir / "store" / "registry.json").read_bytes())
    top = final[1].version
    path = wal / f"p001-v{top:08d}.npz"
    step = commitlog.load_entry(path)
    assert isinstance(step, LogStep)
    # a valid file (checksummed) whose recipe no longer gives the committed state: one code of one
    # contribution one level off
    d = dict(step.recipe.deltas[0])
    name, x = next(iter(d.items()))
    data = x.data.copy()
    data[0] ^= 1
    d[name] = dataclasses.replace(x, data=data)
    tampered = dataclasses.replace(step.recipe, deltas=(d, *step.recipe.deltas[1:]))
    commitlog.save_step(path, dataclasses.replace(step, recipe=tampered))
    s = reopen(cfg, tmp_path)
    assert s.core.versions == [0, top - 1]
    ((q),) = s.core.quarantined
    assert q["path"].endswith(path.name) and q["reason"].startswith("replay gives state "), q
    assert q["reason"].endswith(f"the commit recorded {step.recipe.digest}")
    s.close()


def test_a_recipe_round_trips_through_its_arrays():
    from dloco import compress

    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 200)).astype(np.float32)
    r = recipe.Recipe(
        deltas=({"a": compress.encode(x, "int4", 64), "b": x[0]}, {"a": compress.encode(-x, "int8", 64), "b": x[1]}),
        weights=(0.1, 1 / 3),
        share=0.75,
        norms=({"a": 1.5, "b": 2.0}, {"a": 0.1, "b": 1e-30}),
        rule="rda",
        embedding=("b",),
        outer={"kind": "outer", "lr": 0.7, "momentum": 0.9, "nesterov": True, "delay": 2},
        published={"a": compress.pack(compress.encode(np.repeat(x[:, :8], 25, axis=1), "int4", 64), "zstd")},
        digest="00ff",
    )
    arrays, meta = recipe.to_arrays(r)
    back = recipe.from_arrays(arrays, meta)
    assert back.weights == r.weights and back.norms == r.norms and back.share == r.share and back.outer == r.outer
    assert back.embedding == ("b",) and back.digest == "00ff" and back.nbytes == r.nbytes
    q, q0 = back.published["a"], r.published["a"]
    assert q0.entropy == "zstd" and q.entropy == "zstd" and np.array_equal(q.data, q0.data)  # logged as it travelled
    assert np.array_equal(compress.decode(q), compress.decode(q0))
    for got, want in zip(back.deltas, r.deltas, strict=True):
        assert np.array_equal(got["b"], want["b"])
        assert got["a"].dtype == want["a"].dtype and np.array_equal(got["a"].data, want["a"].data)
        assert np.array_equal(got["a"].scales, want["a"].scales) and got["a"].shape == want["a"].shape
