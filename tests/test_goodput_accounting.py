"""Goodput, uptime and downtime from a hand-made event trace (dloco.metrics, ALGORITHM.md §8)."""

import pytest

from dloco import metrics


def merge(t, fragment, contributors, steps, inner_steps, tokens, cycles):
    return {
        "event": "merge",
        "time": t,
        "fragment": fragment,
        "contributors": contributors,
        "steps": steps,
        "inner_steps": inner_steps,
        "tokens": tokens,
        "cycle_s": cycles,
    }


# Two learners, P = 2, the run spans [0, 100]. Learner 1 joins at 10, is killed at 50, back at 58
# and leaves for good at 80. Its second kill at 60 is skipped (not carried out).
TRACE = [
    {"event": "learner_start", "time": 0.0, "learner": 0},
    {"event": "learner_start", "time": 10.0, "learner": 1},
    merge(20.0, 0, [0, 1], [10, 5], [10, 5], [1000, 500], [1.0, 2.0]),
    merge(30.0, 1, [0], [10], [10], [1000], [1.0]),
    # steps 6..25 of learner 0; 6..10 already reached fragment 0 at t=20: 15 new steps
    merge(40.0, 0, [0], [25], [20], [2000], [1.0]),
    {"event": "fault", "time": 50.0, "kind": "kill", "target": "learner-1"},
    {"event": "learner_restart", "time": 58.0, "learner": 1, "incarnation": 2},
    {"event": "fault", "time": 60.0, "kind": "kill", "target": "learner-0", "skipped": "learner still down"},
    {"event": "learner_stop", "time": 80.0, "learner": 1},
]


def test_learner_time_by_hand():
    lt = metrics.learner_time(TRACE, end=100.0, fragments=2)
    # provisioned: learner 0 from 0 to 100, learner 1 from 10 to its stop at 80
    assert lt[0]["provisioned"] == pytest.approx(100.0)
    assert lt[1]["provisioned"] == pytest.approx(70.0)
    # merged: learner 0 = (10 + 15 new steps of fragment 0 + 10 of fragment 1) × 1.0 s / P
    assert lt[0]["merged"] == pytest.approx((10 + 15 + 10) * 1.0 / 2)
    assert lt[1]["merged"] == pytest.approx(5 * 2.0 / 2)
    # tokens: new steps × the push's tokens per step / P
    assert lt[0]["merged_tokens"] == pytest.approx((10 * 100 + 15 * 100 + 10 * 100) / 2)
    assert lt[1]["merged_tokens"] == pytest.approx(5 * 100 / 2)
    assert metrics.goodput(TRACE, end=100.0, fragments=2) == pytest.approx((17.5 + 5.0) / 170.0)


def test_a_restarted_learner_retraining_merged_steps_counts_them_once():
    trace = [
        {"event": "learner_start", "time": 0.0, "learner": 0},
        merge(10.0, 0, [0], [8], [8], [800], [1.0]),
        merge(11.0, 0, [0], [12], [4], [400], [1.0]),  # killed at step 14, resumed from its merged step 12
        merge(20.0, 0, [0], [16], [4], [400], [1.0]),
    ]
    lt = metrics.learner_time(trace, end=20.0, fragments=1)
    assert lt[0]["merged"] == pytest.approx(16.0)
    # the same push merged twice (duplicate events) adds nothing the second time
    lt = metrics.learner_time([*trace, merge(21.0, 0, [0], [16], [4], [400], [1.0])], end=21.0, fragments=1)
    assert lt[0]["merged"] == pytest.approx(16.0)


def test_downtimes_pair_each_carried_out_kill_with_the_restart():
    rejoined = {**merge(64.0, 0, [0, 1], [30, 9], [5, 3], [500, 300], [1.0, 2.0]), "incarnations": [1, 2]}
    d = metrics.downtimes([*TRACE, rejoined])
    assert d == [
        {"learner": 1, "killed": 50.0, "back": 58.0, "downtime_s": 8.0, "merged_again": 64.0, "rejoin_s": 14.0}
    ]
    unfinished = metrics.downtimes([{"event": "fault", "time": 5.0, "kind": "kill", "target": "learner-2"}])
    assert unfinished == [
        {"learner": 2, "killed": 5.0, "back": None, "downtime_s": None, "merged_again": None, "rejoin_s": None}
    ]


def test_uptime_with_quorum_one_stays_one_while_a_learner_is_dead():
    # decoupled, K = 1: both fragments keep committing every 2 s while learner 1 is dead (50..58)
    commits = {p: [t + p for t in range(2, 100, 2)] for p in (0, 1)}
    assert metrics.uptime(commits, 0.0, 100.0, stall_threshold=5.0, fragments=2) == 1.0


def test_uptime_of_a_lock_step_run_that_stalls_while_a_learner_is_down():
    # dp: a commit every second, none between 50 and 58; threshold 2 s → stalled during [52, 58]
    commits = {0: [float(t) for t in range(1, 51)] + [float(t) for t in range(58, 100)]}
    assert metrics.uptime(commits, 0.0, 100.0, stall_threshold=2.0) == pytest.approx(1 - 6 / 100)
    # a fragment that never committed waits from the start: stalled during [2, 100] of [0, 100]
    assert metrics.uptime({}, 0.0, 100.0, stall_threshold=2.0, fragments=1) == pytest.approx(0.02)
    assert metrics.longest_commit_gaps([{"event": "merge", "time": t, "fragment": 0} for t in commits[0]], 0, 100)[
        0
    ] == pytest.approx(8.0)


def test_typical_cycle_leaves_out_stalled_waits_but_keeps_slow_work():
    # decoupled: no waits; a slow step (a busy machine) is work and counts as it is
    assert metrics.typical_cycle([1.0, 1.0, 1.0, 1.0, 6.0]) == pytest.approx(2.0)
    # lock-step: the normal wait (the exchange) counts; the 9 s wait behind a dead peer does not
    assert metrics.typical_cycle([1.0] * 5, [0.5, 0.5, 0.5, 0.5, 9.0]) == pytest.approx(1.5)
    assert metrics.typical_cycle([1.0, 2.0, 3.0], [0.0, 0.0, 0.0]) == pytest.approx(2.0)
    assert metrics.typical_cycle([]) == 0.0


def test_the_running_tally_equals_the_batch_functions_on_the_same_events():
    """The driver keeps a `Tally` instead of every event: its numbers are `metrics`' numbers."""
    from dloco.tally import Tally

    rejoined = {**merge(64.0, 0, [0, 1], [30, 9], [5, 3], [500, 300], [1.0, 2.0]), "incarnations": [1, 2]}
    events = [*TRACE[:8], rejoined, TRACE[8]]
    t = Tally(fragments=2, stall_threshold=5.0, start=0.0, ring=4)
    for e in events:
        t.add(e)
    assert t.learner_time(100.0) == metrics.learner_time(events, 100.0, 2)
    assert t.goodput(100.0) == pytest.approx(metrics.goodput(events, 100.0, 2))
    assert t.downtimes() == metrics.downtimes(events)
    first = 20.0  # uptime counts from the first commit
    assert t.uptime(100.0) == pytest.approx(metrics.uptime(metrics.commit_times(events), first, 100.0, 5.0, 2))
    assert t.longest_commit_gaps(100.0) == pytest.approx(metrics.longest_commit_gaps(events, 0.0, 100.0))
    assert t.counts["merge"] == 4 and len(t.recent) == 4 and t.recent[-1]["event"] == "learner_stop"
    # a lock-step run: a commit every second, none between 50 and 58
    lock = [
        {
            "event": "merge",
            "time": float(s),
            "fragment": 0,
            "contributors": [],
            "steps": [],
            "inner_steps": [],
            "tokens": [],
        }
        for s in [*range(1, 51), *range(58, 100)]
    ]
    t = Tally(fragments=1, stall_threshold=2.0, start=0.0)
    for e in lock:
        t.add(e)
    assert t.uptime(100.0) == pytest.approx(metrics.uptime(metrics.commit_times(lock), 1.0, 100.0, 2.0, 1))
    assert t.uptime(100.0) == pytest.approx(1 - 6 / 99)
    assert t.longest_commit_gaps(100.0, n=1) == [pytest.approx(8.0)]


def test_driver_memory_benchmark_runs_and_the_tally_holds_far_less(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "dm.json"
    script = Path(__file__).parents[1] / "benchmarks" / "driver_memory.py"
    subprocess.run([sys.executable, str(script), "--events", "20000", "--out", str(out)], check=True, timeout=120)
    r = json.loads(out.read_text())
    a, b = r["rows"]["all events"], r["rows"]["tally"]
    assert a["merges"] == b["merges"] > 19000 and a["goodput"] == pytest.approx(b["goodput"])
    assert b["memory_mib"] < a["memory_mib"] / 5  # the ring and the accounts, not every event


def test_an_idle_spare_is_provisioned_time_until_it_takes_over():
    """Spare 0 waits from 0 to 50, when it takes over learner 1 (killed at 48); spare 1, started in
    its place at 50, waits to the end (100). Learners: 0 over [0, 100], 1 over [0, 100] (its
    identity continues in the spare). Merged: 40 s of learner 0, 30 s of learner 1.
    goodput = 70 / (100 + 100 + 50 + 50) = 0.2333…"""
    trace = [
        {"event": "learner_start", "time": 0.0, "learner": 0},
        {"event": "learner_start", "time": 0.0, "learner": 1},
        {"event": "spare_start", "time": 0.0, "spare": 0},
        merge(40.0, 0, [0, 1], [40, 30], [40, 30], [4000, 3000], [1.0, 1.0]),
        {"event": "fault", "time": 48.0, "kind": "kill", "target": "learner-1"},
        {"event": "spare_takeover", "time": 50.0, "spare": 0, "learner": 1, "cold": False},
        {"event": "spare_start", "time": 50.0, "spare": 1},
        {"event": "learner_restart", "time": 50.5, "learner": 1, "incarnation": 2},
    ]
    from dloco.tally import Tally

    t = Tally(fragments=1, stall_threshold=100.0, start=0.0)
    for e in trace:
        t.add(e)
    assert t.spare_time(100.0) == 100.0  # 50 + 50
    assert t.goodput(100.0) == pytest.approx(70 / 300)
    assert metrics.goodput(trace, 100.0, 1) == pytest.approx(70 / 300)
    assert t.downtimes()[0]["downtime_s"] == pytest.approx(2.5)  # kill → the spare registered as learner 1
