"""Store durability and the syncer's rounds, in-process (no Ray): values, not call counts."""

import numpy as np
import pytest

from dloco import compress, config, fragments, merge, outer
from dloco.policy import ContributionMeta
from dloco.store import Commit, MergedPush, StoreCore
from dloco.syncer import SyncerCore


def initial():
    return [{"embed/embedding": np.zeros((2, 2), np.float32)}, {"w": np.ones(3, np.float32)}]


def outer_leaves():
    return [[np.zeros((2, 2), np.float32)], [np.zeros(3, np.float32)]]


def commit(p, base, value, learners=(), cid=None):
    vals = {"embed/embedding": np.full((2, 2), value, np.float32)} if p == 0 else {"w": np.full(3, value, np.float32)}
    merged = tuple(MergedPush(m, 1, step, 100, 10, {"epoch": 0, "index": step}) for m, step in learners)
    return Commit(p, base, vals, [np.full_like(next(iter(vals.values())), -value)], merged, cid or f"c{p}-{base}")


def test_commit_is_compare_and_set_and_retry_safe(tmp_path):
    s = StoreCore(tmp_path, initial(), outer_leaves(), snapshot_every=100)
    assert s.commit(commit(1, 0, 2.0)).accepted
    again = s.commit(commit(1, 0, 2.0))
    assert again.accepted and again.reason == "already committed (retry)" and s.versions == [0, 1]
    stale = s.commit(commit(1, 0, 3.0, cid="other"))
    assert not stale.accepted and "version conflict: commit from 0, store at 1" in stale.reason
    np.testing.assert_array_equal(s.fragment(1)[1]["w"], [2.0, 2.0, 2.0])


def test_restart_restores_every_committed_version(tmp_path):
    s = StoreCore(tmp_path, initial(), outer_leaves(), snapshot_every=3, keep=2)
    s.register(0)
    s.register(1)
    for v in range(7):  # snapshots after commits 3 and 6; commit 7 only in the log
        p = v % 2
        assert s.commit(commit(p, s.versions[p], float(v + 1), learners=[(0, 10 * (v + 1))])).accepted
    before = s.versions
    assert before == [4, 3]
    s.close()  # its process ends: the lock on the directory goes with it
    r = StoreCore(tmp_path, initial(), outer_leaves(), snapshot_every=3, keep=2)  # "killed" and restarted
    assert r.versions == before
    np.testing.assert_array_equal(r.fragment(0)[1]["embed/embedding"], np.full((2, 2), 7.0))
    np.testing.assert_array_equal(r.outer_state(0)[0], np.full((2, 2), -7.0))
    assert r.registry == {0: 1, 1: 1}
    assert r.register(0).incarnation == 2
    assert len(list(tmp_path.glob("snap-*"))) == 2 and not list(tmp_path.glob("tmp-*"))
    assert r.tokens_merged() == {0: [400, 300]}


def test_merged_cursor_is_the_minimum_over_fragments(tmp_path):
    s = StoreCore(tmp_path, initial(), outer_leaves())
    assert s.register(3).cursor is None
    s.commit(commit(0, 0, 1.0, learners=[(3, 48)]))
    assert s.merged_cursor(3) == (None, 0)  # fragment 1 never merged a push of learner 3
    s.commit(commit(1, 0, 1.0, learners=[(3, 24)]))
    assert s.merged_cursor(3) == ({"epoch": 0, "index": 24}, 24)
    reg = s.register(3)
    assert (reg.incarnation, reg.cursor, reg.step) == (2, {"epoch": 0, "index": 24}, 24)


def make_syncer(**overrides):
    cfg = config.load(
        overrides=(
            "learners.count=3",
            "syncer.quorum=2",
            "compression.dtype=fp32",
            "outer.lr=1.0",
            "outer.momentum=0.0",
            "merge.rule=mean",
            "syncer.norm_warmup=0",
            *[f"{k}={v}" for k, v in overrides.items()],
        )
    )
    params = {"embed": {"embedding": np.zeros((2, 2), np.float32)}, "w": np.zeros(4, np.float32)}
    plan = fragments.partition(params, 2)
    frs = [(0, f, outer.state_to_numpy(outer.init(cfg.outer, f))) for f in plan.split(params)]
    return cfg, SyncerCore(cfg, plan, fragments.embedding_names(plan.names), frs, {0: 1, 1: 1, 2: 1})


def meta(m, tokens=100, steps=10, base=0, inc=1, step=10):
    return ContributionMeta(m, inc, 1, base, tokens, steps, step, 0.1, {"epoch": 0, "index": step})


def payload(x):
    """An fp32 payload built directly (encode itself refuses non-finite values)."""
    x = np.asarray(x, np.float32)
    return {"w": compress.Payload("fp32", x.shape, x, None, 128)}


def test_round_merges_with_token_weights_and_outer_step():
    _, s = make_syncer()
    assert s.push(meta(0, tokens=200), payload([1, 0, 0, 0]), now=0.0).accept
    assert s.ready(0.0) == ([], None)  # waiting for quorum 1/2
    assert s.push(meta(1, tokens=100), payload([0, 1, 0, 0]), now=1.0).accept
    due, _ = s.ready(1.0, live_learners=2)
    assert due == [1]
    items, _ = s.take(1, 1.0)
    out = s.merge(1, items, grace_used=0.0)
    # w = tokens²/steps = 4000 and 1000 → normalized 0.8, 0.2. Learner 2 (registered) is absent and
    # not seen yet: it counts with the mean known weight 2500, so the round's share is 5000/7500.
    # Θ ← 0 − 1·share·Δ
    assert out.event["weights"] == pytest.approx([0.8, 0.2])
    assert out.event["share"] == pytest.approx(2 / 3)
    np.testing.assert_allclose(out.commit.values["w"], [-0.8 * 2 / 3, -0.2 * 2 / 3, 0, 0], rtol=1e-6)
    assert out.commit.version == 1 and [mp.learner_id for mp in out.commit.merged] == [0, 1]
    s.committed(out, sync_time=0.01)
    assert s.versions[1] == 1


def merge_alone(s, m, tokens, x, now):
    """Pushes one contribution to fragment 1, closes its round and commits it; returns the merge event."""
    step = 10 * (s.versions[1] + 1)  # a newer step each time: a merged step pushed again is a replay
    assert s.push(meta(m, tokens=tokens, base=s.versions[1], step=step), payload(x), now=now).accept
    items, _ = s.take(1, now)
    out = s.merge(1, items, grace_used=0.0)
    s.committed(out, sync_time=0.01)
    return out


def test_partial_rounds_are_scaled_by_their_share_of_the_live_weight():
    _, s = make_syncer(**{"syncer.quorum": 1})
    # learner 0 alone, nobody else seen yet: the 2 absent learners count with its weight 1000 → share 1/3
    e = merge_alone(s, 0, 100, [3, 0, 0, 0], now=0.0).event
    assert e["share"] == pytest.approx(1 / 3)
    np.testing.assert_allclose(s.values[1]["w"], [-1, 0, 0, 0], rtol=1e-6)
    # learner 1 alone with w = 200²/10 = 4000; absent: learner 0 (last 1000), learner 2 (mean 2500)
    e = merge_alone(s, 1, 200, [0, 3, 0, 0], now=1.0).event
    assert e["share"] == pytest.approx(4000 / 7500)
    np.testing.assert_allclose(s.values[1]["w"], [-1, -3 * 8 / 15, 0, 0], rtol=1e-6)
    # a round with every registered learner is applied in full
    for m in range(3):
        assert s.push(meta(m, base=s.versions[1], step=30), payload([0, 0, 3, 0]), now=2.0).accept
    items, _ = s.take(1, 2.0)
    out = s.merge(1, items, grace_used=0.0)
    assert out.event["share"] == 1.0
    np.testing.assert_allclose(out.commit.values["w"], [-1, -1.6, -3, 0], rtol=1e-6)


def test_share_scaling_off_applies_each_round_in_full():
    _, s = make_syncer(**{"syncer.quorum": 1, "merge.scale_by_share": "false"})
    assert merge_alone(s, 0, 100, [3, 0, 0, 0], now=0.0).event["share"] == 1.0
    np.testing.assert_allclose(s.values[1]["w"], [-3, 0, 0, 0])


def test_bad_contributions_are_rejected_with_reasons_and_never_absorbed():
    _, s = make_syncer()
    assert "unknown learner" in s.push(meta(7), payload([1, 1, 1, 1]), now=0).reason
    assert "future" in s.push(meta(0, base=5), payload([1, 1, 1, 1]), now=0).reason
    assert s.push(meta(0), payload([np.nan, 0, 0, 0]), now=0).accept  # values are checked at merge
    assert s.push(meta(1), payload([0, 1, 0, 0]), now=0).accept
    assert s.push(meta(2), {"w": compress.encode(np.zeros(5, np.float32), "fp32")}, now=0).accept
    items, _ = s.take(1, 0.0)
    items.append((meta(0, step=20), None))  # payload lost with its dead owner
    out = s.merge(1, items, grace_used=0.0, lost=lambda m: "payload lost: owner died")
    reasons = sorted(r["reason"] for r in out.rejections)
    assert len(reasons) == 3
    assert any("non-finite" in r for r in reasons)
    assert any("shape" in r for r in reasons)
    assert "payload lost: owner died" in reasons
    assert out.event["contributors"] == [1]
    # only learner 1's delta, applied at its share: 1 of 3 registered learners of equal weight
    assert out.event["share"] == pytest.approx(1 / 3)
    np.testing.assert_allclose(out.commit.values["w"], [0, -1 / 3, 0, 0], rtol=1e-6)
    assert np.isfinite(out.commit.values["w"]).all()


def test_old_incarnation_is_rejected_after_restart():
    _, s = make_syncer()
    s.update_registry({0: 2, 1: 1, 2: 1})
    assert "incarnation" in s.push(meta(0, inc=1), payload([1, 0, 0, 0]), now=0).reason


def test_nothing_valid_means_no_commit():
    _, s = make_syncer()
    s.push(meta(0), payload([np.inf, 0, 0, 0]), now=0)
    s.push(meta(1), payload([np.inf, 0, 0, 0]), now=0)
    items, _ = s.take(1, 0.0)
    out = s.merge(1, items, grace_used=0.0)
    assert out.commit is None and len(out.rejections) == 2 and s.versions[1] == 0


def test_a_push_overlapping_a_merged_push_is_rejected():
    """Push A (steps 0..8) is merged; push B (steps 0..16) was sent before A's merge reached the
    learner, so it contains A: merging it would apply steps 0..8 twice. C, sent after the learner
    rebased on A (steps 8..24), is merged."""
    _, s = make_syncer(**{"syncer.quorum": 1})

    def merge_round(now):
        items, _ = s.take(1, now)
        out = s.merge(1, items, grace_used=0.0)
        if out.commit is not None:
            s.committed(out, sync_time=0.01)
        return out

    assert s.push(meta(0, tokens=80, steps=8, step=8), payload([1, 0, 0, 0]), now=0.0).accept
    assert merge_round(0.0).commit.version == 1
    d = s.push(meta(0, tokens=160, steps=16, step=16, base=0), payload([2, 0, 0, 0]), now=1.0)
    assert not d.accept and d.reason == "overlap: steps 0..16 include merged step 8"
    assert s.push(meta(0, tokens=160, steps=16, step=24, base=1), payload([1, 0, 0, 0]), now=2.0).accept
    assert merge_round(2.0).commit.version == 2
    # checked again at merge time: B waits in the next round while A's commit lands
    assert s.push(meta(1, tokens=80, steps=8, step=8, base=2), payload([1, 0, 0, 0]), now=3.0).accept
    items_a, _ = s.take(1, 3.0)
    assert s.push(meta(1, tokens=160, steps=16, step=16, base=2), payload([2, 0, 0, 0]), now=3.5).accept
    s.committed(s.merge(1, items_a, grace_used=0.0), sync_time=0.01)
    out = merge_round(4.0)
    assert out.commit is None and out.rejections[0]["reason"] == "overlap: steps 0..16 include merged step 8"


def test_token_weights_are_tokens_squared_over_steps_as_computed_by_hand():
    w = merge.token_weights([300, 150], [10, 10])
    assert list(w / w.sum()) == pytest.approx([0.8, 0.2])


def test_outlier_check_compares_per_step_norms():
    """A fragment's first pushes cover few steps (its send offset); later pushes cover H steps and
    are proportionally larger. Judged by per-step norm they are normal; a push whose per-step norm
    is max_norm_ratio × the median is still rejected (regression: at M = 8 every later push of
    fragment 1 was rejected against the median of its 6-step first pushes)."""
    _, s = make_syncer(**{"syncer.quorum": 1, "syncer.norm_warmup": 3, "syncer.max_norm_ratio": 10.0})

    def push_alone(m, steps, norm, now):
        x = [norm, 0, 0, 0]
        step = 30 * (1 + int(now))  # newer each time, not overlapping its last merged step, at a plausible pace
        assert s.push(
            meta(m, tokens=10 * steps, steps=steps, base=s.versions[1], step=step), payload(x), now=now
        ).accept
        items, _ = s.take(1, now)
        out = s.merge(1, items, grace_used=0.0)
        if out.commit is not None:
            s.committed(out, sync_time=0.01)
        return out

    for i in range(3):  # first pushes: 6 steps, ‖δ‖ = 0.06 → 0.01 per step
        assert push_alone(i, 6, 0.06, float(i)).commit is not None
    # 24 steps, ‖δ‖ = 1.2: 20× the first raw norms, but 0.05 per step = 5× the median → merged
    out = push_alone(0, 24, 1.2, 10.0)
    assert out.commit is not None and out.rejections == []
    # 24 steps at 0.25 per step: 25× the per-step median (0.01, 0.01, 0.01, 0.05 → 0.01) → rejected
    out = push_alone(1, 24, 6.0, 11.0)
    assert out.commit is None
    assert out.rejections[0]["reason"].startswith("norm outlier: norm 0.25 > max_norm_ratio 10.0 × median 0.01")


def test_a_replayed_push_is_rejected_and_never_merged_twice():
    """The same contribution (learner, incarnation, step) pushed again after its merge — or while
    its round is being merged — is rejected as a replay; a newer step of it, or the same step of a
    new incarnation, is not."""
    _, s = make_syncer(**{"syncer.quorum": 1})
    merge_alone(s, 0, 100, [3, 0, 0, 0], now=0.0)  # learner 0, step 10, merged into version 1
    again = s.push(meta(0, base=1, step=10), payload([3, 0, 0, 0]), now=1.0)
    assert not again.accept and again.reason.startswith("replay: step 10 was merged already")
    assert s.push(meta(1, base=1, step=20), payload([0, 3, 0, 0]), now=1.0).accept
    items, _ = s.take(1, 1.0)  # learner 1's step 20 is now being merged
    late = s.push(meta(1, base=1, step=20), payload([0, 3, 0, 0]), now=1.5)
    assert not late.accept and "round being merged" in late.reason
    s.committed(s.merge(1, items, grace_used=0.0), sync_time=0.01)
    assert s.merged_steps[1] == {0: (1, 10), 1: (1, 20)} and s.versions[1] == 2
    s.update_registry({0: 2, 1: 1, 2: 1})  # learner 0 restarted: its steps count anew
    assert s.push(meta(0, base=2, step=10, inc=2), payload([1, 0, 0, 0]), now=2.0).accept


def test_busy_lists_the_rounds_that_commit_without_another_push():
    """What the run's wind-down waits for: a round at quorum (its grace window runs) and a taken
    round until it is committed or released; a round below quorum is not waited for."""
    _, s = make_syncer()
    assert s.push(meta(0), payload([1, 0, 0, 0]), now=0.0).accept
    assert s.busy() == []  # 1/2: the quorum needs a push that may never come
    assert s.push(meta(1), payload([0, 1, 0, 0]), now=0.1).accept
    assert s.busy() == [1]
    items, _ = s.take(1, 0.2)
    assert s.busy() == [1]  # taken: being merged
    s.committed(s.merge(1, items, grace_used=0.0), sync_time=0.01)
    assert s.busy() == []
    assert s.push(meta(0, base=1, step=20), payload([1, 0, 0, 0]), now=0.3).accept
    assert s.push(meta(2, base=1, step=20), payload([1, 0, 0, 0]), now=0.3).accept
    s.take(1, 0.4)
    s.release(1)  # e.g. the merge failed: the round is over
    assert s.busy() == []
