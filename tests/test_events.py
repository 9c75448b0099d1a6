"""`dloco.events`: one dataclass per event kind, and its JSON form, round trip and checks."""

import json

import pytest

from dloco import events


def test_every_kind_round_trips_through_json():
    samples = [
        events.StoreStart(time=1.0, versions=[0, 2], restored_from="snap-00000008"),
        events.SyncerStart(time=1.0, versions=[0, 2]),
        events.LearnerStart(time=2.0, learner=0, incarnation=1, cursor=None, step=0),
        events.LearnerRestart(time=3.0, learner=0, incarnation=2, cursor={"epoch": 0, "index": 8}, step=24),
        events.LearnerStop(time=4.0, learner=0),
        events.Rejection(time=5.0, fragment=1, learner=0, incarnation=1, step=8, base_version=0, reason="stale"),
        events.Merge(
            time=6.0,
            t=1.5,
            fragment=1,
            version=3,
            contributors=[0, 2],
            incarnations=[1, 1],
            steps=[8, 9],
            tokens=[512, 640],
            inner_steps=[8, 10],
            weights=[0.4, 0.6],
            share=1.0,
            staleness=[0, 1],
            cycle_s=[0.1, 0.1],
            grace_s=0.0,
            grace_window_s=0.2,
            slack_s=0.1,
            bytes_in=10,
            bytes_out=40,
            rejected=0,
            sync_s=0.01,
            push_age_s=[0.02, 0.03],
        ),
        events.RoundEmpty(time=7.0, fragment=0, version=3),
        events.CommitRejected(time=7.5, fragment=0, reason="version conflict"),
        events.SyncerError(time=8.0, error="RuntimeError()", trace="..."),
        events.StoreError(time=8.1, error="snapshot failed: OSError(28, 'No space left on device')"),
        events.ActorError(time=8.2, target="learner-2", error="ValueError: corpus key differs"),
        events.RunFailed(time=8.3, error="the store failed and cannot restart: RunDirLocked"),
        events.PayloadLost(time=9.0, learner=1, fragment=0, step=16, bytes=1024),
        events.PayloadResent(time=10.0, learner=1, fragment=0, step=16),
        events.Fault(time=11.0, target="learner-1", kind="freeze", source="manual", duration=5.0),
        events.Eval(time=12.0, loss=3.25, tokens=4096),
        events.Goodput(time=13.0, goodput=0.9, uptime=1.0),
        events.Chaos(time=0.0, seed=3, faults=2, stragglers=[1]),
        events.LearnerDrain(time=4.5, learner=0, incarnation=2, step=29, pushed=2, merged=True, seconds=0.8),
        events.SpareStart(time=0.5, spare=0),
        events.SpareTakeover(time=4.6, spare=0, learner=1),
    ]
    assert {type(e) for e in samples} == set(events.KINDS.values())  # one sample per kind
    for e in samples:
        line = json.dumps(e.to_dict())
        back = events.parse(json.loads(line))
        assert back == e and back.to_dict()["event"] == e.EVENT
    merge = samples[6].to_dict()
    assert "dropped" not in merge and merge["sync_s"] == 0.01  # optional fields appear when set
    fault = samples[15].to_dict()
    assert fault["kind"] == "freeze" and "skipped" not in fault and "at" not in fault


def test_parse_names_the_kind_and_the_field_that_do_not_match():
    with pytest.raises(ValueError, match="unknown event kind 'merged'"):
        events.parse({"event": "merged", "time": 1.0})
    with pytest.raises(ValueError, match="eval event: .*'tokens'"):
        events.parse({"event": "eval", "time": 1.0, "loss": 2.0})
    with pytest.raises(ValueError, match=r"eval event: unknown field\(s\) \['toks'\]"):
        events.parse({"event": "eval", "time": 1.0, "loss": 2.0, "tokens": 1, "toks": 1})
