"""The sharded syncer and store (`syncer.shards`, `dloco.services.shards`), in process.

Two shards merge exactly what one does (fragments merge independently; the grace window's timing
EMAs are each shard's own, so the check runs where rounds close on quorum alone); each shard's
directory holds only its fragments; killing one shard's store and syncer restores that shard
alone and loses nothing merged; a learner registers once with one incarnation and resumes at the
oldest merged cursor over all shards; a foreign fragment and another shard count are refused.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from dloco import export, preflight
from dloco.config import from_dict
from dloco.ledger import MergedPush
from dloco.policy import ContributionMeta
from dloco.services import shards
from dloco.services.store import StoreService
from dloco.services.syncer import SyncerService
from dloco.sim import Sim, SimTransport, VirtualClock
from dloco.store import Commit

STEPS = 24
SMALL = {"learners": {"count": 2}, "sync": {"every": 8, "overlap": 1}, "fragments": {"count": 4}}


def config(n: int, **over):
    return from_dict({**SMALL, **over, "syncer": {**over.get("syncer", {}), "shards": n}})


def run(tmp_path, n: int, faults=(), **over) -> Sim:
    sim = Sim.start(config(n, **over), tmp_path / f"s{n}", step_times=[1.0, 1.37])
    for t, kind, arg in faults:
        sim.at(t, kind, arg)
    return sim.run(STEPS)


QUORUM = {"syncer": {"grace_factor": 0.0}, "store": {"snapshot_every": 4}}  # rounds close on quorum alone


@pytest.fixture(scope="module")
def quorum_pair(tmp_path_factory):
    """The decoupled runs with S = 1 and S = 2 (shared by the tests that read them)."""
    d = tmp_path_factory.mktemp("quorum")
    return run(d, 1, **QUORUM), run(d, 2, **QUORUM)


def merges(sim: Sim) -> list[tuple]:
    return [(e["fragment"], e["version"], tuple(e["contributors"])) for e in sim.events if e["event"] == "merge"]


@pytest.mark.parametrize("algorithm", ["decoupled", "streaming"])
def test_two_shards_merge_bit_identically_to_one(tmp_path, quorum_pair, algorithm):
    one, two = quorum_pair if algorithm == "decoupled" else (run(tmp_path, n, algorithm=algorithm) for n in (1, 2))
    a, b = jax.tree_util.tree_leaves(one.global_params()), jax.tree_util.tree_leaves(two.global_params())
    assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert merges(one) == merges(two) and len(merges(one)) >= 8
    summary = shards.ShardedStore(two.stores).summary()
    assert summary["versions"] == one.store.versions == [max(s.core.versions[p] for s in two.stores) for p in range(4)]
    assert summary["tokens_merged"] == one.store.tokens_merged()
    assert [s.core.versions for s in two.stores][0][1::2] == [0, 0]  # shard 0 never holds fragments 1, 3


def test_each_shard_directory_holds_only_its_fragments(quorum_pair):
    sim = quorum_pair[1]
    for s in (0, 1):
        root = shards.store_root(sim.run_dir, s, 2)
        assert root == sim.run_dir / "store" / f"shard-{s}-of-2"
        logged = {int(f.name[1:4]) for f in (root / "wal").glob("p*.npz")}
        assert logged and logged <= set(shards.owned(4, 2, s))
        snap = max(root.glob("snap-*"))
        for p in range(4):
            values = export.load_fragment(snap / f"p{p:03d}.npz").values
            assert bool(values) == (p % 2 == s)  # the other shard's fragments are not in it
    versions, values, source = export.read_shards(sim.run_dir, 4, 2)
    assert versions == [sim.stores[p % 2].core.versions[p] for p in range(4)] and "shard 1" in source
    for p in range(4):
        for k, x in sim.stores[p % 2].core.fragment(p)[1].items():
            np.testing.assert_array_equal(values[p][k], x)


def test_killing_one_shard_restores_only_it_and_loses_nothing_merged(tmp_path):
    over = {"syncer": {"grace_factor": 0.0}, "store": {"snapshot_every": 3}}
    sim = Sim.start(config(2, **over), tmp_path / "run", step_times=[1.0, 1.37])
    sim.run(STEPS, until=11.0)
    shard0, before = sim.stores[0], list(sim.stores[1].core.versions)
    incarnations = {m: svc.incarnation for m, svc in sim.services.items()}
    sim.at(11.5, "kill_store", 1)
    sim.at(11.5, "kill_syncer", 1)
    sim.run(STEPS)
    assert sim.stores[0] is shard0 and sim.stores[0].core.restored_from is None  # untouched
    assert sim.stores[1].core.restored_from is not None  # from its own snapshot and log
    after_kill = [e for e in sim.events if e["event"] == "merge" and e["time"] > 11.5]
    for p in (1, 3):
        restored = [e["version"] for e in after_kill if e["fragment"] == p]
        assert restored and min(restored) == before[p] + 1  # nothing merged lost, nothing merged twice
    assert {m: svc.incarnation for m, svc in sim.services.items()} == incarnations  # learners never restarted
    assert sim.stores[0].registry() == sim.stores[1].registry() == incarnations
    faults = [e["target"] for e in sim.events if e["event"] == "fault"]
    assert faults == ["store-1", "syncer-1"]


def test_a_learner_registers_once_with_one_incarnation_and_the_oldest_cursor(tmp_path):
    cfg = config(2, fragments={"count": 2}, sync={"every": 8, "overlap": 1})
    clock = VirtualClock()
    stores = [StoreService(cfg, tmp_path, SimTransport(set()), clock, shard=s) for s in (0, 1)]
    router = shards.ShardedStore(stores)
    reg = router.register(0)
    assert (reg.incarnation, reg.cursor, reg.step) == (1, None, 0)
    for p, index in ((0, 10), (1, 6)):  # fragment 1 (shard 1) merged an older push of learner 0
        version, values = stores[p].core.fragment(p)
        merged = (MergedPush(0, 1, index, 100, 4, {"epoch": 0, "index": index}),)
        c = Commit(p, version, values, stores[p].core.outer_state(p), merged, f"c{p}")
        assert stores[p].commit(c).accepted
    stores[1].register(0)  # shard 1 alone saw two more registrations (say, its registry was written last)
    stores[1].register(0)
    reg = router.register(0)
    assert reg.incarnation == 3 and stores[0].registry() == stores[1].registry() == {0: 3}
    assert (reg.cursor, reg.step) == ({"epoch": 0, "index": 6}, 6)  # the oldest over both shards
    starts = [e for e in stores[0].drain_events() if e["event"] in ("learner_start", "learner_restart")]
    assert [(e["event"], e["incarnation"]) for e in starts] == [("learner_start", 1), ("learner_restart", 3)]
    meta = ContributionMeta(
        0, 3, 1, 1, 4 * cfg.data.seq_len * cfg.inner.batch_size, 4, 20, 0.1, {"epoch": 0, "index": 20}
    )
    syncer = SyncerService(cfg, stores[0], SimTransport(set()), clock, shard=0)
    d = syncer.push(meta, None)
    assert not d.accept and d.reason == "fragment 1 is not syncer shard 0's"


def test_a_run_dir_of_another_shard_count_is_refused(tmp_path):
    StoreService(config(2), tmp_path, SimTransport(set()), VirtualClock(), shard=1).close()
    with pytest.raises(shards.ShardLayoutError) as e:
        StoreService(config(1), tmp_path, SimTransport(set()), VirtualClock())
    line = f"run dir {tmp_path} holds a store written with syncer.shards=2, not 1: resume it with that"
    assert str(e.value) == line
    with pytest.raises(shards.ShardLayoutError):
        StoreService(config(4), tmp_path, SimTransport(set()), VirtualClock(), shard=0)
    (tmp_path / "fingerprint.json").write_text("{}")
    with pytest.raises(preflight.PreflightError, match="syncer.shards=2, not 3"):
        preflight._check_run_dir(tmp_path, resume=True, n=3)
    preflight._check_run_dir(tmp_path, resume=True, n=2)  # its own count resumes


def test_a_shard_resource_no_node_has_is_refused_before_anything_starts():
    cfg = config(2, syncer={"shard_resources": ["region_a", "region_b"]})
    up = {"Alive": True, "Resources": {"CPU": 8.0, "region_a": 1.0}}
    nodes = [up, {"Alive": False, "Resources": {"region_b": 1.0}}]
    with pytest.raises(preflight.PreflightError) as e:
        preflight.check_resources(cfg, nodes)
    assert str(e.value) == (
        "syncer.shard_resources[1]='region_b': no node of the Ray cluster has it, so that store shard would "
        "wait forever: name a resource some node has"
    )
    preflight.check_resources(cfg, [{**up, "Resources": {"CPU": 8.0, "region_a": 1.0, "region_b": 1.0}}])
