"""`compression.publish: delta` (ALGORITHM.md §7): learners hold the syncer's shadow Θ̂_p bit for bit,
the shadow stays within one quantization step of Θ_p, the store keeps it durably, and a learner
that missed a version refuses the delta (and is given Θ̂_p in full)."""

import shutil

import numpy as np
import pytest

from dloco import compress, config
from dloco.learner import Delivery
from dloco.sim import run_local
from dloco.store import StoreCore

DELTA = ("compression.publish=delta", "compression.publish_dtype=int4", "learner.install=every")


@pytest.fixture(scope="module")
def delta_run(tiny_run, tmp_path_factory):
    cfg = config.load(overrides=(*tiny_run, *DELTA, "learners.count=3"))
    return run_local(cfg, tmp_path_factory.mktemp("delta"), steps=48, step_times=[1.0, 1.1, 1.3], sync_time=0.5)


def test_learners_hold_the_shadow_bit_for_bit(delta_run):
    run = delta_run
    assert min(run.store.versions) >= 4
    checked = 0
    for core in run.learners:
        core.apply_inbox()
        for p in range(run.blueprint.plan.count):
            version, shadow = run.store.shadow(p)
            if core.versions[p] != version:
                continue
            for n, x in shadow.items():
                np.testing.assert_array_equal(core.anchors[p][n], x)  # exactly, not approximately
                checked += 1
    assert checked >= len(run.learners) * run.blueprint.plan.count // 2


def test_shadow_is_within_one_quantization_step_of_the_global_model(delta_run):
    run = delta_run
    for p in range(run.blueprint.plan.count):
        _, theta = run.store.fragment(p)
        _, shadow = run.store.shadow(p)
        for n in theta:
            # the residual is what the last int4 publish could not represent: at most half a step
            # of a block scale, itself at most max|Θ − Θ̂_old| / 7
            gap = np.abs(theta[n] - shadow[n])
            assert gap.max() <= 0.5 * np.abs(theta[n]).max() / 7 + 1e-7, n
            assert not np.array_equal(theta[n], shadow[n]) or gap.max() == 0


def test_merge_events_count_the_published_delta_bytes(delta_run):
    run = delta_run
    merges = [e for e in run.events if e["event"] == "merge"]
    plan = run.blueprint.plan
    for e in merges:
        n_values = plan.fragments[e["fragment"]].size
        blocks = sum(-(-int(np.prod(s)) // 128) for s in plan.fragments[e["fragment"]].shapes)
        assert e["bytes_out"] == blocks * (64 + 2)  # per block of 128: 64 bytes of nibbles, a float16 scale
        assert e["bytes_out"] < 4 * n_values / 6  # int4 vs the 4 bytes per value of a full publish


def test_delta_publish_trains_like_full_publish(tiny_run, delta_run, tmp_path):
    cfg = config.load(overrides=(*tiny_run, "learners.count=3", "compression.publish=full"))
    full = run_local(cfg, tmp_path, steps=48, step_times=[1.0, 1.1, 1.3], sync_time=0.5)
    a, b = full.evaluate(), delta_run.evaluate()
    assert abs(a - b) / a < 0.02, (a, b)


def test_store_restores_the_shadow(delta_run, tmp_path):
    run = delta_run
    copy = tmp_path / "store"  # a copy: the run's own store still holds its directory's lock
    shutil.copytree(run.store.root, copy)
    again = StoreCore(copy, [dict(f) for f in run.blueprint.initial], [[] for _ in run.blueprint.initial])
    assert again.versions == run.store.versions
    for p in range(run.blueprint.plan.count):
        for n, x in run.store.shadow(p)[1].items():
            np.testing.assert_array_equal(again.shadow(p)[1][n], x)
        for n, x in run.store.fragment(p)[1].items():
            np.testing.assert_array_equal(again.fragment(p)[1][n], x)


def test_a_delta_on_top_of_a_missed_version_is_refused(delta_run):
    core = delta_run.learners[0]
    p = 0
    v = core.versions[p]
    zero = {n: compress.encode(np.zeros_like(x), "int4") for n, x in core.anchors[p].items()}
    assert not core.receive(Delivery(p, v + 2, None, None, delta=zero))  # v + 1 was never seen
    assert p not in core.inbox
    one = {n: compress.encode(np.ones_like(x), "int4") for n, x in core.anchors[p].items()}
    assert core.receive(Delivery(p, v + 1, None, None, delta=one))
    for n, x in core.anchors[p].items():
        np.testing.assert_array_equal(core.inbox[p].values[n], x + compress.decode(one[n]))
    core.inbox.pop(p)
