"""What ends a run early, and how errors are counted: `dloco.tally` and `actors.health` on
hand-written event traces (no Ray cluster needed)."""

from actors import health
from dloco import config
from dloco.tally import Tally, summarize


def _merge(t, fragment=0):
    return {
        "event": "merge",
        "time": t,
        "fragment": fragment,
        "version": 1,
        "contributors": [0],
        "incarnations": [1],
        "steps": [4],
        "inner_steps": [4],
        "tokens": [64],
        "cycle_s": [0.1],
    }


def test_commit_failures_start_a_clock_that_a_merge_stops():
    tally = Tally(fragments=1, stall_threshold=30.0, start=0.0)
    tally.add({"event": "learner_start", "time": 0.0, "learner": 0, "incarnation": 1})
    tally.add({"event": "syncer_error", "time": 10.0, "error": "OSError(28, 'No space left on device')"})
    tally.add({"event": "syncer_error", "time": 20.0, "error": "OSError(28, 'No space left on device')"})
    assert tally.failing_for(30.0) == 20.0  # since the first error, not the newest
    tally.add(_merge(25.0))
    assert tally.failing_for(30.0) == 0.0
    tally.add({"event": "store_error", "time": 35.0, "error": "snapshot failed"})
    tally.add(_merge(36.0))  # commits still succeed: a failing snapshot alone never adds up
    assert tally.failing_for(50.0) == 0.0
    tally.add({"event": "syncer_error", "time": 40.0, "error": "OSError(30, 'Read-only file system')"})
    assert tally.failing_for(100.0) == 60.0
    assert tally.error_counts() == {"syncer_error": 3, "store_error": 1}
    assert tally.last_error is not None and "Read-only" in tally.last_error["error"]

    cfg = config.load(None, ["store.fail_after_s=50"])
    assert health.fatal(tally, cfg, now=80.0, learners_left=True) is None  # failing 40 s < 50 s
    msg = health.fatal(tally, cfg, now=100.0, learners_left=True)
    assert msg is not None and "failed for 60 s" in msg and "store.fail_after_s=50" in msg and "Read-only" in msg
    assert "\n" not in msg
    gone = health.fatal(tally, cfg, now=81.0, learners_left=False)
    assert gone == "every learner failed: OSError(30, 'Read-only file system')"


def test_a_kill_during_start_up_is_a_restart():
    tally = Tally(fragments=1, stall_threshold=30.0, start=0.0)
    tally.add({"event": "learner_start", "time": 0.5, "learner": 0, "incarnation": 1})
    tally.add({"event": "fault", "time": 1.0, "target": "learner-1", "kind": "kill", "source": "manual"})
    tally.add({"event": "learner_start", "time": 4.0, "learner": 1, "incarnation": 1})  # never registered before
    tally.add({"event": "fault", "time": 6.0, "target": "learner-0", "kind": "kill", "source": "manual"})
    tally.add({"event": "learner_restart", "time": 9.0, "learner": 0, "incarnation": 2})
    s = summarize(
        tally,
        config={},
        stop_at=10.0,
        end=10.0,
        eval_loss_start=5.0,
        eval_loss_end=None,
        tokens_trained=0,
        statuses={},
        store={"versions": [0]},
        learners=2,
        run_dir="r",
    )
    assert s["restarts"] == 2 and s["downtime_s"] == [3.0, 3.0]
    assert s["error"] is None and s["errors"] == {}


def test_a_registration_from_before_a_kill_that_arrives_after_it_is_not_the_restart():
    """The driver records its kill at once and drains the store's events later: learner 1's first
    registration (at 0.9 s, before the kill at 1.0 s) reaches the tally after the kill. Only the
    registration after the kill ends its downtime, and it is one restart, not two (seen in CI: 6
    restarts for 5 kills)."""
    tally = Tally(fragments=1, stall_threshold=30.0, start=0.0)
    tally.add({"event": "fault", "time": 1.0, "target": "learner-1", "kind": "kill", "source": "manual"})
    tally.add({"event": "learner_start", "time": 0.9, "learner": 1, "incarnation": 1})  # arrives late
    tally.add({"event": "learner_restart", "time": 5.0, "learner": 1, "incarnation": 2})
    s = summarize(
        tally,
        config={},
        stop_at=10.0,
        end=10.0,
        eval_loss_start=5.0,
        eval_loss_end=None,
        tokens_trained=0,
        statuses={},
        store={"versions": [0]},
        learners=2,
        run_dir="r",
    )
    assert s["restarts"] == 1 and s["downtime_s"] == [4.0]


def test_one_line_keeps_the_remote_exception_line():
    err = RuntimeError(
        "The actor died because of an error raised in its creation task, ray::FragmentStore.__init__()\n"
        '  File "x.py", line 3, in __init__\n    raise RunDirLocked(...)\n           ^^^^^^^^^\n'
        "dloco.durable.RunDirLocked: run dir /r/store is in use by another store (pid 12 on host h)\n"
    )
    assert (
        health.one_line(err)
        == "dloco.durable.RunDirLocked: run dir /r/store is in use by another store (pid 12 on host h)"
    )
    assert health.one_line(ValueError()) == "ValueError"


def test_a_learner_that_left_and_registers_again_is_provisioned_again():
    """A drained learner (SIGTERM: `learner_stop` when it deregisters) that Ray restarts is provisioned
    from its first start to the end, the gap included, as a killed one is: goodput never gains by a drain."""
    t = Tally(2, 30.0, 0.0)
    t.add({"event": "learner_start", "time": 0.0, "learner": 1, "incarnation": 1, "cursor": None, "step": 0})
    t.add({"event": "learner_stop", "time": 40.0, "learner": 1})
    assert t.learner_time(100.0)[1]["provisioned"] == 40.0  # left for good: provisioned until then
    t.add({"event": "learner_restart", "time": 55.0, "learner": 1, "incarnation": 2, "cursor": None, "step": 96})
    assert t.learner_time(100.0)[1]["provisioned"] == 100.0  # back: 0 → 100 s, the 15 s gap included


def test_start_up_is_measured_from_the_launch_to_the_first_registration_and_the_first_merge():
    """`startup_s`: `start` called at 100 s, learner 1 registers first at 112.5 s (events may arrive
    out of order); `first_merge_s`: the first commit at 115 s. A run with no registration yet has
    neither (and `budget.seconds` has not begun counting: `Tally.first_start` is None)."""
    tally = Tally(fragments=1, stall_threshold=30.0, start=101.0)
    args = dict(config={}, stop_at=120.0, end=120.0, eval_loss_start=5.0, eval_loss_end=None, tokens_trained=0)
    rest = dict(statuses={}, store={"versions": [0]}, learners=2, run_dir="r", launched=100.0)
    s = summarize(tally, **args, **rest)
    assert tally.first_start is None and s["startup_s"] is None and s["first_merge_s"] is None
    tally.add({"event": "learner_start", "time": 113.0, "learner": 0, "incarnation": 1})
    tally.add({"event": "learner_start", "time": 112.5, "learner": 1, "incarnation": 1})
    tally.add(_merge(115.0))
    tally.add(_merge(116.0))
    s = summarize(tally, **args, **rest)
    assert tally.first_start == 112.5
    assert s["startup_s"] == 12.5 and s["first_merge_s"] == 15.0
    assert summarize(tally, **args, **{**rest, "launched": None})["startup_s"] == 11.5  # from the tally's start


def test_a_registration_tallied_after_the_learners_first_merge_still_starts_its_provisioning():
    """The driver drains the syncer's and the store's events separately: learner 0's first merge
    (at 10 s) can reach the tally before its registration (at 4 s). Provisioning starts at the
    registration, so goodput stays at most 1: 6 merged seconds of 16 provisioned, not of 10 (a
    two-node run printed goodput 1.233 this way)."""
    tally = Tally(fragments=1, stall_threshold=30.0, start=0.0)
    tally.add({**_merge(10.0), "steps": [6], "inner_steps": [6], "cycle_s": [1.0]})
    tally.add({"event": "learner_start", "time": 4.0, "learner": 0, "incarnation": 1})
    t = tally.learner_time(20.0)[0]
    assert t["provisioned"] == 16.0 and t["merged"] == 6.0
    assert tally.goodput(20.0) == 6.0 / 16.0
