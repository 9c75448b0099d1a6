"""Hand-computed tests of the syncer's pure decisions (dloco.policy)."""

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dloco.policy import (
    Beat,
    ContributionMeta,
    Decision,
    Ema,
    FragmentRound,
    NormTracker,
    RoundDecision,
    SyncerTimings,
    check_meta,
    check_values,
    grace_window,
)

SHAPES = {"w": (4, 3), "b": (3,)}


def meta(**kw):
    base = {
        "learner_id": 1,
        "incarnation": 2,
        "fragment_id": 0,
        "base_version": 8,
        "tokens": 1024,
        "steps": 4,
        "step": 48,
        "step_time": 0.1,
    }
    base.update(kw)
    return ContributionMeta(**base)


def meta_check(m=None, **kw):
    args = {"registry": {0: 0, 1: 2}, "current_version": 9, "max_staleness": 4}
    args.update(kw)
    return check_meta(m or meta(), **args)


def values_check(**kw):
    args = {"expected_shapes": SHAPES, "shapes": SHAPES, "sq_norm": 4.0, "norms": None, "max_norm_ratio": 3.0}
    args.update(kw)
    return check_values(**args)


def tracker(values, window=64, warmup=3):
    t = NormTracker(window=window, warmup=warmup)
    for v in values:
        t.record(v)
    return t


# ---- contribution checks --------------------------------------------------------------------


def test_accepts_valid_contribution():
    assert meta_check() == Decision(True, "accepted")
    assert values_check() == Decision(True, "accepted")
    # Right at the staleness limit: 9 - 5 == 4.
    assert meta_check(meta(base_version=5)).accept
    assert meta_check(meta(base_version=9)).accept


def test_unknown_learner():
    d = meta_check(meta(learner_id=7))
    assert not d.accept
    assert "unknown learner 7" in d.reason and "[0, 1]" in d.reason


def test_old_incarnation():
    d = meta_check(meta(incarnation=1))
    assert not d.accept
    assert d.reason.startswith("old incarnation")
    assert "incarnation 1" in d.reason and "registry has 2" in d.reason


def test_newer_incarnation_is_unknown():
    d = meta_check(meta(incarnation=3))
    assert not d.accept
    assert d.reason.startswith("unknown incarnation")
    assert "incarnation 3" in d.reason and "registry has 2" in d.reason


def test_base_version_in_future():
    d = meta_check(meta(base_version=10))
    assert not d.accept
    assert d.reason == "base version in the future: base_version 10, current 9"


def test_stale():
    d = meta_check(meta(base_version=3), current_version=9, max_staleness=4)
    assert d == Decision(False, "stale: base_version 3, current 9, max_staleness 4")


def test_shape_mismatch_missing_extra_wrong():
    d = values_check(shapes={"w": (3, 4), "c": (1,)})
    assert not d.accept
    assert d.reason.startswith("shape mismatch")
    assert "missing ['b']" in d.reason
    assert "extra ['c']" in d.reason
    assert "w has (3, 4), expected (4, 3)" in d.reason
    # Lists compare equal to tuples (shapes that went through JSON).
    assert values_check(shapes={"w": [4, 3], "b": [3]}).accept


@pytest.mark.parametrize("tokens, steps", [(0, 4), (1024, 0), (-1, 4)])
def test_empty_contribution(tokens, steps):
    d = meta_check(meta(tokens=tokens, steps=steps))
    assert d == Decision(False, f"empty contribution: tokens {tokens}, steps {steps}")


@pytest.mark.parametrize("step_time", [math.nan, -0.5, math.inf])
def test_invalid_step_time(step_time):
    d = meta_check(meta(step_time=step_time))
    assert not d.accept
    assert d.reason.startswith("invalid step_time") and str(step_time) in d.reason


@pytest.mark.parametrize("sq_norm", [math.nan, math.inf])
def test_non_finite(sq_norm):
    d = values_check(sq_norm=sq_norm)
    assert d == Decision(False, f"non-finite: sq_norm {sq_norm}")


def test_sq_norm_none_skips_value_checks():
    assert values_check(sq_norm=None, norms=tracker([1.0, 1.0, 1.0])).accept


def test_norm_outlier_only_after_warmup():
    # Two norms, warm-up 3: not ready, a huge norm passes.
    t = tracker([1.0, 3.0], warmup=3)
    assert not t.ready()
    assert values_check(sq_norm=100.0**2, norms=t).accept
    # Third norm: median of [1, 3, 2] = 2, threshold 3 × 2 = 6.
    t.record(2.0)
    assert t.ready() and t.median() == 2.0
    assert values_check(sq_norm=6.0**2, norms=t).accept  # 6 is not > 6
    d = values_check(sq_norm=7.0**2, norms=t)
    assert d == Decision(False, "norm outlier: norm 7 > max_norm_ratio 3.0 × median 2 = 6")


def test_zero_median_disables_outlier_check():
    assert values_check(sq_norm=1.0, norms=tracker([0.0, 0.0, 0.0])).accept


def test_check_order_first_failure_wins():
    # Unknown learner beats staleness; staleness beats an empty contribution; shapes beat a non-finite norm.
    assert meta_check(meta(learner_id=9, base_version=0)).reason.startswith("unknown learner")
    assert meta_check(meta(base_version=0, tokens=0)).reason.startswith("stale")
    assert values_check(shapes={}, sq_norm=math.nan).reason.startswith("shape mismatch")


# ---- NormTracker ----------------------------------------------------------------------------


def test_norm_tracker_window_and_state():
    t = tracker([10.0, 1.0, 2.0, 3.0, 4.0], window=4, warmup=2)
    assert t.to_state() == [1.0, 2.0, 3.0, 4.0]  # 10 fell out of the window
    assert t.median() == 2.5
    r = NormTracker.from_state(json.loads(json.dumps(t.to_state())), window=4, warmup=2)
    assert r.to_state() == t.to_state() and r.median() == 2.5 and r.ready()
    r2 = NormTracker.from_state([5.0, 6.0, 7.0], window=2, warmup=1)
    assert r2.to_state() == [6.0, 7.0]


def test_norm_tracker_validation():
    with pytest.raises(ValueError):
        NormTracker(window=0)
    with pytest.raises(ValueError, match="warmup"):
        NormTracker(window=4, warmup=5)
    with pytest.raises(ValueError):
        NormTracker().median()
    with pytest.raises(ValueError):
        NormTracker().record(math.nan)


# ---- EMAs and the grace window --------------------------------------------------------------


def test_ema_hand_sequence():
    e = Ema(decay=0.5)
    assert e.value is None
    assert e.update(2.0) == 2.0
    assert e.update(4.0) == 3.0
    assert e.update(7.0) == 5.0
    assert e.value == 5.0
    with pytest.raises(ValueError):
        Ema(decay=1.0)


def test_grace_window_inside_range():
    # γ·(τ·ξ_step − ξ_quorum − ξ_sync) = 0.5·(2·1.0 − 0.3 − 0.2) = 0.75; cap 1.0·1.0.
    assert grace_window(1.0, 0.3, 0.2, overlap=2, gamma=0.5, max_grace_steps=1.0) == 0.75


def test_grace_window_clamps_at_zero():
    # 0.5·(2·1.0 − 1.5 − 1.0) = −0.25 → 0.
    assert grace_window(1.0, 1.5, 1.0, overlap=2, gamma=0.5, max_grace_steps=1.0) == 0.0


def test_grace_window_clamps_at_cap():
    # 1.0·(4·2.0 − 0 − 0) = 8 > cap 2.0·1.5 = 3.
    assert grace_window(2.0, 0.0, 0.0, overlap=4, gamma=1.0, max_grace_steps=1.5) == 3.0


def test_grace_window_gamma_zero():
    assert grace_window(1.0, 0.0, 0.0, overlap=2, gamma=0.0, max_grace_steps=1.0) == 0.0


def test_syncer_timings_median_and_grace():
    t = SyncerTimings(decay=0.5)
    assert t.grace(overlap=2, gamma=0.5, max_grace_steps=1.0) == 0.0  # no step time yet
    for m, s in [(0, 1.0), (1, 2.0), (2, 10.0)]:
        t.observe_step_time(m, s)
    assert t.step_time == 2.0
    # ξ_quorum, ξ_sync unobserved count as 0: 0.5·(2·2) = 2 > cap 2·0.75 = 1.5.
    assert t.grace(overlap=2, gamma=0.5, max_grace_steps=0.75) == 1.5
    t.observe_quorum_time(1.0)
    t.observe_quorum_time(3.0)  # EMA 2.0
    t.observe_sync_time(1.0)
    # 0.5·(2·2 − 2 − 1) = 0.5.
    assert t.grace(overlap=2, gamma=0.5, max_grace_steps=1.0) == 0.5
    # Learner 1's EMA: 2 then 6 → 4; median of (1, 4, 10) = 4.
    t.observe_step_time(1, 6.0)
    assert t.step_time == 4.0
    t.forget(2)
    assert t.step_time == 2.5  # median of (1, 4)


def test_syncer_timings_state_round_trip():
    t = SyncerTimings(decay=0.5)
    t.observe_step_time(3, 1.0)
    t.observe_step_time(0, 2.0)
    t.observe_sync_time(0.25)
    state = json.loads(json.dumps(t.to_state()))
    r = SyncerTimings.from_state(state, decay=0.5)
    assert r.to_state() == t.to_state()
    assert (r.step_time, r.quorum_time, r.sync_time) == (1.5, None, 0.25)
    r.observe_step_time(3, 3.0)  # continues the saved EMA: 0.5·1 + 0.5·3
    assert r.to_state()["step_time"] == [[0, 2.0], [3, 2.0]]


# ---- FragmentRound --------------------------------------------------------------------------


def push(rnd, m, now, step=0, incarnation=0):
    return rnd.add(meta(learner_id=m, incarnation=incarnation, step=step), f"d{m}@{step}", now)


def test_quorum_then_grace():
    rnd = FragmentRound(0, quorum=2)
    push(rnd, 0, 0.0)
    d = rnd.decide(0.5, grace=0.5)
    assert d == RoundDecision(False, "waiting for quorum 1/2", None)
    push(rnd, 1, 1.0)
    assert rnd.quorum_time == 1.0
    d = rnd.decide(1.2, grace=0.5)
    assert not d.close and "grace" in d.reason
    assert d.wait == pytest.approx(0.3)
    # The deadline was fixed at 1.0 + 0.5; a later, larger grace does not move it.
    d = rnd.decide(1.5, grace=5.0)
    assert d.close and d.reason.startswith("grace window elapsed")


def test_round_waits_for_its_beat():
    """sync.dynamic: the deadline is max(quorum + grace, the beat), fixed when first decided."""
    rnd = FragmentRound(0, quorum=1)
    push(rnd, 0, 10.0)
    d = rnd.decide(10.0, grace=0.5, live_learners=3, until=11.2)
    assert not d.close and d.wait == pytest.approx(1.2)
    push(rnd, 1, 10.9)
    assert not rnd.decide(11.1, grace=0.5, live_learners=3, until=99.0).close  # the deadline stays 11.2
    assert rnd.decide(11.2, grace=0.5, live_learners=3).close
    # a beat already past: the grace window alone
    rnd = FragmentRound(0, quorum=1)
    push(rnd, 2, 20.0)
    assert rnd.decide(20.0, grace=0.5, until=19.0).wait == pytest.approx(0.5)


def test_beat_places_pushes_and_times_the_next_by_hand():
    """T = 24 s (H = 24 at 1 s per step of the fastest learner); floor-before-the-beat steps."""
    b = Beat(every=24)
    assert b.place(100.0, 24.0) == 0.0 and b.at == 100.0  # the first push sets the phase
    assert b.next_push(0.0, 24.0, 1.0) == 23  # 23 steps of 1 s: 1 s before beat 124
    assert b.next_push(0.0, 24.0, 1.2) == 19  # ⌈20⌉ − 1 = 19 steps of 1.2 s: 22.8 s, before 124
    assert b.next_push(-1.0, 24.0, 1.0) == 24  # 1 s early: ⌈25⌉ − 1 = 24, lands at 124 − 1 again
    assert b.place(101.5, 24.0) == pytest.approx(1.5)  # late on beat 100
    assert b.next_push(1.5, 24.0, 1.2) == 18  # ⌈22.5 / 1.2 = 18.75⌉ − 1 = 18: 21.6 s, at 123.1
    assert b.place(123.1, 24.0) == pytest.approx(-0.9) and b.at == 124.0  # the next beat
    assert b.place(112.0, 24.0) == pytest.approx(-12.0) and b.at == 124.0  # half way: the nearer (later) beat
    assert b.place(130.0, 24.0) == pytest.approx(6.0) and b.at == 124.0  # late on 124, not moved back
    assert b.place(200.0, 24.0) == pytest.approx(4.0) and b.at == 196.0  # a learner back after 3 periods
    assert b.next_push(-11.0, 24.0, 1.0) == 34  # far early: one long period brings it back into phase
    assert b.next_push(0.0, 24.0, 0.01) == 48 and b.next_push(30.0, 24.0, 1.0) == 1  # clamped to [1, 2H]
    assert b.next_push(0.0, 24.0, 0.0) == 24  # no step time known: H
    with pytest.raises(ValueError, match="period"):
        b.place(1.0, 0.0)


def test_syncer_timings_cycle_times_fastest_and_forgotten():
    t = SyncerTimings(decay=0.5)
    assert t.fastest_cycle_time is None and t.cycle_time(0) is None
    for m, x in ((0, 1.2), (1, 1.0), (2, 1.1), (1, 2.0)):
        t.observe_cycle_time(m, x)
    assert t.cycle_time(1) == pytest.approx(1.5)  # 0.5·1.0 + 0.5·2.0
    assert t.fastest_cycle_time == pytest.approx(1.1)
    t.forget(2)
    assert t.fastest_cycle_time == pytest.approx(1.2) and t.step_time is None


def test_supersede_keeps_newer():
    rnd = FragmentRound(0, quorum=2)
    assert push(rnd, 2, 0.0, step=48) is None
    reason = push(rnd, 2, 0.4, step=72)
    assert reason == "superseded push of learner 2 (step 48 -> 72)"
    assert len(rnd.pending) == 1
    assert rnd.pending[2][0].step == 72 and rnd.pending[2][1] == "d2@72"
    # One learner twice is not a quorum of 2.
    assert not rnd.decide(1.0, grace=0.0).close


def test_out_of_order_push_does_not_replace_newer():
    rnd = FragmentRound(0, quorum=1)
    push(rnd, 2, 0.0, step=72)
    reason = push(rnd, 2, 0.1, step=48)
    assert "out-of-order" in reason and "48" in reason and "72" in reason
    assert rnd.pending[2][1] == "d2@72"
    # A new incarnation supersedes regardless of its (restarted) step counter.
    push(rnd, 2, 0.2, step=5, incarnation=1)
    assert rnd.pending[2][1] == "d2@5"


def test_synchronous_diloco_closes_at_mth_push():
    m_learners = 3
    rnd = FragmentRound(0, quorum=m_learners)
    timings = SyncerTimings()
    timings.observe_step_time(0, 1.0)
    grace = timings.grace(overlap=2, gamma=0.0, max_grace_steps=1.0)
    assert grace == 0.0
    for m, t in enumerate([0.0, 0.7, 2.0]):
        assert not rnd.decide(t, grace).close
        push(rnd, m, t)
    assert rnd.decide(2.0, grace).close


def test_live_learners_early_close():
    rnd = FragmentRound(0, quorum=2)
    push(rnd, 0, 0.0)
    push(rnd, 1, 0.1)
    assert not rnd.decide(0.2, grace=10.0, live_learners=3).close
    d = rnd.decide(0.2, grace=10.0, live_learners=2)
    assert d.close and d.reason.startswith("all live learners contributed")
    # Never below the quorum, even if fewer learners are alive.
    rnd2 = FragmentRound(0, quorum=2)
    push(rnd2, 0, 0.0)
    assert not rnd2.decide(0.1, grace=0.0, live_learners=1).close


def test_take_resets():
    rnd = FragmentRound(0, quorum=1)
    push(rnd, 3, 0.0)
    push(rnd, 1, 0.5)
    taken = rnd.take()
    assert [(mt.learner_id, item) for mt, item in taken] == [(1, "d1@0"), (3, "d3@0")]
    assert dict(rnd.pending) == {} and rnd.quorum_time is None
    assert rnd.decide(9.0, grace=0.0).reason == "waiting for quorum 0/1"
    push(rnd, 2, 10.0)
    assert rnd.quorum_time == 0.0  # a fresh round: first push and quorum both at 10.0


def test_round_validation():
    with pytest.raises(ValueError, match="quorum"):
        FragmentRound(0, quorum=0)
    with pytest.raises(ValueError, match="fragment"):
        FragmentRound(1, quorum=1).add(meta(fragment_id=0), None, 0.0)
    with pytest.raises(TypeError):
        FragmentRound(0, quorum=1).pending[0] = None


@given(
    quorum=st.integers(1, 4),
    pushes=st.lists(st.tuples(st.integers(0, 5), st.floats(0.0, 1.0)), max_size=30),
    grace=st.floats(0.0, 2.0),
)
def test_round_property(quorum, pushes, grace):
    rnd = FragmentRound(0, quorum=quorum)
    now, latest, steps = 0.0, {}, {}
    for m, dt in pushes:
        now += dt
        steps[m] = steps.get(m, 0) + 1
        push(rnd, m, now, step=steps[m])
        latest[m] = f"d{m}@{steps[m]}"
        d = rnd.decide(now, grace)
        if len(latest) < quorum:
            assert not d.close
        # Polling later can only close once the quorum is there.
        assert rnd.decide(now + 10.0, grace).close == (len(latest) >= quorum)
    taken = rnd.take()
    assert [mt.learner_id for mt, _ in taken] == sorted(latest)
    assert {mt.learner_id: item for mt, item in taken} == latest
    assert len(rnd.pending) == 0
