"""The token ledger counts each trained step once, and a damaged ledger entry never blocks a
learner's registration: `dloco.ledger` by hand, then through `StoreCore` across a restart."""

import numpy as np

from dloco import ledger
from dloco.ledger import MergedPush
from dloco.store import Commit, StoreCore

T = 64  # tokens per inner step


def push(step, steps=8, incarnation=1, learner=0):
    return MergedPush(learner, incarnation, step, steps * T, steps, {"epoch": 0, "index": step})


def test_fresh_tokens_by_hand():
    assert ledger.fresh_tokens(push(48), high=0) == 8 * T
    assert ledger.fresh_tokens(push(48), high=44) == 4 * T  # steps 45..48 are new
    assert ledger.fresh_tokens(push(48), high=48) == 0
    assert ledger.fresh_tokens(push(48), high=60) == 0
    assert ledger.fresh_tokens(MergedPush(0, 1, 5, 0, 0, None), high=0) == 0  # no steps, no tokens


def test_an_entry_from_before_high_reads_its_step_as_high():
    old = {0: {"tokens": 48 * T, "cursor": {"epoch": 0, "index": 48}, "step": 48, "incarnation": 1}}
    new = ledger.record(old, [push(56, incarnation=2), push(8, learner=1)])
    assert new[0] == {"tokens": 56 * T, "cursor": {"epoch": 0, "index": 56}, "step": 56, "incarnation": 2, "high": 56}
    assert new[1]["tokens"] == 8 * T and new[1]["high"] == 8
    assert "high" not in old[0]  # the old ledger is left as it was


def _store(root):
    frags = [{"a": np.zeros(2, np.float32)}, {"b": np.zeros(2, np.float32)}]
    return StoreCore(root, frags, [[np.zeros(2, np.float32)], [np.zeros(2, np.float32)]], snapshot_every=2)


def _commit(s, p, pushes, value):
    name = "a" if p == 0 else "b"
    v = s.versions[p]
    c = Commit(p, v, {name: np.full(2, value, np.float32)}, [np.zeros(2, np.float32)], tuple(pushes), f"{p}-{v}")
    assert s.commit(c).accepted


def test_a_restarted_learner_retraining_merged_steps_is_counted_once(tmp_path):
    """The probe of the issue: fragment 0 merged learner 0 up to step 48, fragment 1 up to step 40.
    Restarted, it resumes at step 40 (the oldest merged cursor) and pushes fragment 0 at steps 48
    and 56 again: the ledger counts 56 steps of fragment 0, not 64 (nor 72 for a second retrain)."""
    s = _store(tmp_path)
    s.register(0)
    for step in (8, 16, 24, 32, 40, 48):
        _commit(s, 0, [push(step)], step)
        if step <= 40:
            _commit(s, 1, [push(step)], step)
    assert s.tokens_merged() == {0: [48 * T, 40 * T]}
    s.close()
    r = _store(tmp_path)  # restarted store: the ledger comes back from snapshot + WAL
    reg = r.register(0)
    assert (reg.incarnation, reg.step, reg.cursor) == (2, 40, {"epoch": 0, "index": 40})
    _commit(r, 0, [push(48, incarnation=2)], 1.0)  # retrained: steps 41..48 merged already
    _commit(r, 1, [push(48, incarnation=2)], 1.0)  # new for fragment 1
    _commit(r, 0, [push(56, incarnation=2)], 2.0)
    assert r.tokens_merged() == {0: [56 * T, 48 * T]}
    e = r.last_merged(0)[0]
    assert (e["step"], e["incarnation"], e["high"]) == (56, 2, 56)


def test_a_malformed_cursor_in_an_old_ledger_resumes_at_the_start_instead_of_failing(tmp_path):
    """A ledger written before pushes' cursors were validated can hold a cursor that is not one:
    registration used to raise for ever; now the learner starts its stream again (and the
    ledger's `high` keeps it from counting the retrained steps twice)."""
    s = _store(tmp_path)
    s.register(0)
    bad = MergedPush(0, 1, 16, 8 * T, 8, {"epoch": "x"})
    _commit(s, 0, [bad], 1.0)
    _commit(s, 1, [push(16)], 1.0)
    reg = s.register(0)
    assert (reg.incarnation, reg.cursor, reg.step) == (2, None, 0)
    _commit(s, 0, [push(8, incarnation=2)], 2.0)
    assert s.tokens_merged()[0][0] == 8 * T  # steps 1..8 were merged as part of the bad push
    for c in ({"index": 3}, {"epoch": 0, "index": -1}, "not a dict", {"epoch": None, "index": 1}):
        assert ledger.cursor_key(c) is None
