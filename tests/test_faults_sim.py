"""Faults in process, one event at a time on the virtual clock (`dloco.sim`), for every algorithm.

The run: 2 learners of the `micro` model (1 and 1.3 virtual seconds per step), 24 steps each; one
fault at t = 6.75 s (while a dp round waits for the slower learner). Blocking algorithms (dp,
elastic_dp, diloco, streaming: K = M) must end with exactly S / H versions of every fragment
whatever the fault — no round lost, none merged twice: a restarted syncer forgets its open rounds
and the learners' resends recover them — and stop merging while a learner is silent; decoupled
(K = 1) must keep merging through it, and so must elastic_dp once it drops the silent learner.
"""

import pytest

from dloco import config
from dloco.services.wire import PayloadLostError
from dloco.sim import Sim, SimTransport

S, T_FAULT = 24, 6.75
ALGORITHMS = {
    "dp": ("algorithm=dp",),
    "elastic_dp": ("algorithm=elastic_dp",),
    "diloco": ("algorithm=diloco", "sync.every=8"),
    "streaming": ("algorithm=streaming", "sync.every=8", "fragments.count=2", "sync.overlap=1"),
    "decoupled": ("algorithm=decoupled", "sync.every=8", "fragments.count=2", "sync.overlap=1"),
}
FAULTS = ("kill_learner", "kill_syncer", "kill_store", "freeze", "payload_loss")


def _run(tmp_path, data_cache, algorithm, fault):
    extra = ("chaos.payload_loss=0.3", "chaos.seed=3") if fault == "payload_loss" else ()
    cfg = config.load(
        None,
        ["preset=micro", f"data.cache_dir={data_cache}", "learners.count=2", *ALGORITHMS[algorithm], *extra],
    )
    sim = Sim.start(cfg, tmp_path, step_times=[1.0, 1.3], restart_s=3.0, sync_time=0.1)
    if fault == "freeze":
        sim.at(T_FAULT, "freeze", (1, 5.0))
    elif fault != "payload_loss":
        sim.at(T_FAULT, fault, 1 if fault == "kill_learner" else None)
    sim.run(S, until=T_FAULT - 0.01)
    before = list(sim.store.versions)
    sim.run(S)
    return cfg, sim, before


def _events(sim, kind):
    return [e for e in sim.events if e["event"] == kind]


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_fault(tmp_path, data_cache, algorithm, fault):
    cfg, sim, before = _run(tmp_path, data_cache, algorithm, fault)
    merges = _events(sim, "merge")
    assert not _events(sim, "syncer_error")
    assert all(s.core.step_count == S for s in sim.services.values()) and len(sim.services) == 2
    assert all(a >= b for a, b in zip(sim.store.versions, before, strict=True))  # nothing merged is lost
    blocking = algorithm != "decoupled"
    # elastic_dp runs without a silent learner once syncer.elastic_timeout_s has passed: its rounds
    # are then not lock step, and the learner's late pushes merge on their own
    lock_step = blocking and not (algorithm == "elastic_dp" and fault in ("kill_learner", "freeze"))
    H = cfg.sync.every
    if lock_step:  # every round completes exactly once
        assert sim.store.versions == [S // H] * cfg.fragments.count, sim.store.versions
    assert [e for e in merges if e["time"] > T_FAULT], "merging resumed after the fault"

    if fault == "kill_learner":
        (restart,) = [e for e in _events(sim, "learner_restart") if e["learner"] == 1]
        assert restart["incarnation"] == 2 and restart["time"] == pytest.approx(T_FAULT + 3.0)
        after = [e for e in merges if 1 in e["contributors"] and e["time"] > restart["time"]]
        assert after and all(e["incarnations"][e["contributors"].index(1)] == 2 for e in after)
        down = [e for e in merges if T_FAULT + 1.5 < e["time"] < restart["time"]]
        assert (len(down) > 0) == (not lock_step), down  # the others go on only without lock step
    elif fault == "kill_syncer":
        assert len(_events(sim, "syncer_start")) == 2
        if algorithm == "dp":  # the forgotten round's pushes are resent, never lost
            assert _events(sim, "payload_resent")
    elif fault == "kill_store":
        starts = _events(sim, "store_start")
        assert len(starts) == 2 and starts[1]["versions"] == before
    elif fault == "freeze":
        silent = [e for e in merges if T_FAULT + 1.5 < e["time"] < T_FAULT + 5.0]
        assert (len(silent) > 0) == (not lock_step), silent
        if not lock_step:
            assert all(e["contributors"] == [0] for e in silent)
    else:  # payload_loss
        lost = {(e["learner"], e["fragment"], e["step"]) for e in _events(sim, "payload_lost")}
        merged = {(m, e["fragment"], s) for e in merges for m, s in zip(e["contributors"], e["steps"], strict=True)}
        assert lost
        if blocking:  # resent after chaos.resend_s and merged
            assert lost <= merged and _events(sim, "payload_resent")
        else:  # a lost push is never merged; the next one carries its progress
            assert not lost & merged


def test_a_transport_made_after_a_kill_is_never_taken_for_the_killed_one():
    """A killed transport's payloads are lost; a new one's (a restarted learner's) are not, even
    where it is allocated at the killed one's address (CPython reuses it at once: with `id()` as
    the owner, 998 of 1000 new transports here read as dead, and a restarted blocking learner
    resent its lost pushes forever)."""
    dead: set[int] = set()
    for i in range(1000):
        t = SimTransport(dead)
        assert t.get(t.put(i)) == i
        ref = t.put(-i)
        dead.add(t.owner)
        with pytest.raises(PayloadLostError):
            t.get(ref)
        del t


@pytest.mark.parametrize("algorithm", ["diloco", "dp"])
def test_waiting_for_a_straggler_costs_no_payload(tmp_path, data_cache, algorithm):
    """Synchronous DiLoCo (and dp) with a straggler 3× slower and `chaos.resend_s` = 1 s: every
    round waits ~16 virtual seconds for it, and each fast learner asks the syncer every second
    whether it has its push. It has: nothing is resent, and the bytes sent are one payload per
    learner per round (before the syncer could be asked, each wait resent every waiting push
    once a second). A push lost on the wire (`test_fault[payload_loss]`) or forgotten by a
    restarted syncer (`test_fault[kill_syncer]`) is still resent."""
    cfg = config.load(
        None,
        [
            "preset=micro",
            f"data.cache_dir={data_cache}",
            "learners.count=3",
            "chaos.resend_s=1.0",
            *ALGORITHMS[algorithm],
        ],
    )
    sim = Sim.start(cfg, tmp_path, step_times=[1.0, 1.0, 3.0], sync_time=0.1)
    steps = 24
    sim.run(steps)
    rounds = steps // cfg.sync.every * cfg.fragments.count
    assert _events(sim, "payload_resent") == []
    assert not [e for e in _events(sim, "rejection") if "replay" in e["reason"]]
    assert sum(svc.pushes for svc in sim.services.values()) == 3 * rounds
    per_push = {svc.bytes_out // svc.pushes for svc in sim.services.values()}
    assert len(per_push) == 1  # equal payloads: the bytes are 3 × rounds payloads, nothing more
    assert sim.store.versions == [steps // cfg.sync.every] * cfg.fragments.count
