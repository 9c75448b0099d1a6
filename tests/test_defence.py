"""Nothing bad reaches the global model (`dloco.defence`, ALGORITHM.md §5, §6): the merged result is
checked before it is committed, the outlier check has an absolute bound during its warm-up and keeps
its history across restarts, a replayed push is never merged twice, malformed metadata is rejected
alone at push time, and the merge reads only what `take` fixed.

Each test fails with its fix reverted, but the replay test, which guards `SyncerCore._check_replay`
(in place before these tests). The rig is the real store and syncer services of a `micro` run on
the virtual clock, driven by hand.
"""

import dataclasses
import json
import math

import numpy as np
import pytest
from conftest import P

from dloco import config, durable
from dloco.services.store import StoreService
from dloco.sim import run_local


def kinds(events, kind):
    return [e for e in events if e["event"] == kind]


# ---- 1. the merged result is checked before it is committed --------------------------------------


@pytest.mark.parametrize(
    "overrides, values, steps, reason",
    [
        # outer.lr huge: Θ_p overflows to ±inf
        (("outer.lr=1.0e+30",), 1e9, 8, "non-finite Θ_p"),
        # outer.lr large, Θ_p finite but moved 1000× what the round brought
        (("outer.lr=1000.0",), None, 8, "implausible change"),
        # a finite but enormous δ that claims 10^9 steps: its per-step norm looks honest
        ((), 1e3, 10**9, "implausible change"),
    ],
)
def test_a_non_finite_or_implausible_merge_is_never_committed(rig, overrides, values, steps, reason):
    r = rig("syncer.norm_warmup=0", *overrides)  # no warm-up bound: the commit check is the last line
    before, files = r.theta(), sorted((r.run_dir / "store" / "wal").iterdir())
    norm = r.honest() * 8 if values is None else values * math.sqrt(r.plan.fragments[P].size)
    # 10^9 steps at once fail the pace check at push time (`test_hostile`); a learner that sends no
    # step time cannot be judged by pace, and then the commit check is the last line
    unjudged = {"step_time": 0.0} if steps > 100 else {}
    assert r.push(r.meta(0, steps=steps, **unjudged), r.payload(norm)).accept  # the metadata is fine
    events = r.close()
    refused = kinds(events, "commit_rejected")
    assert len(refused) == 1 and refused[0]["fragment"] == P and refused[0]["reason"].startswith(reason)
    (rej,) = kinds(events, "rejection")  # the learner's push: rejected, with the reason
    assert (rej["learner"], rej["step"]) == (0, steps) and rej["reason"].startswith(f"commit refused: {reason}")
    assert not kinds(events, "merge")
    # nothing absorbed: not in the store, not on disk, not in the syncer
    assert r.store.core.versions[P] == 0 and r.syncer.core.versions[P] == 0
    assert sorted((r.run_dir / "store" / "wal").iterdir()) == files
    for n, x in r.theta().items():
        np.testing.assert_array_equal(x, before[n])
    assert r.store.core.last_merged(P) == {} and len(r.syncer.core.norms[P]) == 0
    json.dumps(events, allow_nan=False)
    # the learner's next push merges once the cause is gone (here: a sane size, where η is sane)
    if not overrides:
        assert r.push(r.meta(0), r.payload(r.honest() * 8)).accept
        assert kinds(r.close(), "merge") and r.store.core.versions[P] == 1


def test_a_restored_store_holds_no_refused_round(rig):
    r = rig("syncer.norm_warmup=0", "outer.lr=1.0e+30")
    assert r.push(r.meta(0), r.payload(1e9 * math.sqrt(r.plan.fragments[P].size))).accept
    assert kinds(r.close(), "commit_rejected")
    r.restart_store()
    assert r.store.core.versions == [0, 0]
    assert all(np.isfinite(x).all() for x in r.theta().values())


# ---- 2. the warm-up bound and the persisted norm history -----------------------------------------


def test_the_warm_up_bound_rejects_a_huge_contribution_before_any_history(rig):
    r = rig()  # syncer.norm_warmup: 8, no norm recorded yet
    big, good = r.meta(0), r.meta(1)
    assert r.push(big, r.payload(1e5 * 8 * r.honest())).accept and r.push(good, r.payload(8 * r.honest())).accept
    events = r.close()
    (rej,) = kinds(events, "rejection")
    assert rej["learner"] == 0 and rej["reason"].startswith("norm over the warm-up bound")
    (merge,) = kinds(events, "merge")
    assert merge["contributors"] == [1]  # the good peer of the round is merged
    assert max(abs(x).max() for x in r.theta().values()) < 10  # merged, it moved values to ~1500


def test_honest_early_pushes_pass_the_warm_up_bound(tiny_run, tmp_path):
    """From a fresh init, with the settings that made the largest early pushes measured (int2 error
    feedback, blending): nothing is rejected, every round merges."""
    cfg = config.load(
        overrides=(*tiny_run, "compression.dtype=int2", "learner.receive=blend", "learners.count=3", "seed=2")
    )
    run = run_local(cfg, tmp_path, steps=24)
    assert [e["reason"] for e in run.events if e["event"] in ("rejection", "commit_rejected")] == []
    assert len([e for e in run.events if e["event"] == "merge"]) >= 6


def test_the_norm_history_survives_syncer_and_store_restarts(rig):
    r = rig("syncer.norm_warmup=3", "store.snapshot_every=2")
    for k in range(4):
        m = k % 2
        assert r.push(r.meta(m), r.payload(8 * r.honest() * (1 + 0.1 * k))).accept
        assert kinds(r.close(), "merge")
    history = r.syncer.core.norms[P].to_state()
    assert len(history) == 4
    assert r.store.core.fragments[P].norms == history  # travelled with the commits
    for restart in (r.restart_syncer, r.restart_store):
        restart()
        r.restart_syncer()
        assert r.syncer.core.norms[P].to_state() == history
    # 30× the median: inside the warm-up bound (10 × an AdamW step ≈ 33× these pushes), so a syncer
    # that forgot its history took it; with the history it is an outlier
    assert r.push(r.meta(0), r.payload(30 * 8 * r.honest())).accept
    (rej,) = kinds(r.close(), "rejection")
    assert rej["reason"].startswith("norm outlier")


def test_a_run_dir_from_before_the_norm_history_reads_as_empty(rig):
    r = rig("syncer.norm_warmup=3")
    assert r.push(r.meta(0), r.payload(8 * r.honest())).accept
    assert kinds(r.close(), "merge")
    r.store.close()
    (path,) = (r.run_dir / "store" / "wal").glob(f"p{P:03d}-v*.npz")
    arrays, meta = durable.read_arrays(path)
    del meta["norms"]  # the form written before the history was kept
    durable.write_arrays(path, dict(arrays), meta)
    r.store = StoreService(r.cfg, r.run_dir, r.transport, r.clock)
    assert r.store.core.fragments[P].norms == [] and r.store.core.versions[P] == 1
    r.restart_syncer()
    assert len(r.syncer.core.norms[P]) == 0


# ---- 3. a replayed push ---------------------------------------------------------------------------


def test_a_replayed_push_is_merged_once_even_after_a_syncer_restart(rig):
    r = rig()
    meta, payload = r.meta(0), r.payload(8 * r.honest())
    assert r.push(meta, payload).accept and kinds(r.close(), "merge")
    after = r.theta()
    for again in (meta, dataclasses.replace(meta, base_version=1)):  # as sent, and rebased on the merge
        d = r.push(again, payload)
        assert not d.accept and d.reason.startswith("replay")
    r.restart_syncer()
    d = r.push(dataclasses.replace(meta, base_version=1), payload)
    assert not d.accept and d.reason.startswith("replay")
    r.close()
    assert r.store.core.versions[P] == 1 and r.store.core.tokens_merged()[0][P] == meta.tokens
    for n, x in r.theta().items():
        np.testing.assert_array_equal(x, after[n])


# ---- 4. malformed metadata -----------------------------------------------------------------------

MALFORMED = {
    "cursor not ints": {"cursor": {"epoch": "x", "index": 3}},
    "cursor a list": {"cursor": [1, 2]},
    "cursor not JSON-able": {"cursor": {"epoch": 0, "index": object()}},
    "cursor NaN": {"cursor": {"epoch": 0, "index": math.nan}},
    "cursor key missing": {"cursor": {"epoch": 0}},
    "cursor negative": {"cursor": {"epoch": 0, "index": -1}},
    "tokens 10**200": {"tokens": 10**200},
    "tokens over steps × batch × seq_len": {"tokens": 8 * 4 * 32 + 1},
    "tokens a float": {"tokens": 1024.0},
    "steps a float": {"steps": 2.5},
    "steps a bool": {"steps": True},
    "step before its steps": {"step": 3},
    "step_time a string": {"step_time": "fast"},
    "step_time NaN": {"step_time": math.nan},
    "cycle_time inf": {"cycle_time": math.inf},
    "incarnation a string": {"incarnation": "1"},
    "learner unhashable": {"learner_id": [0]},
    "fragment a float": {"fragment_id": 1.0},
    "base_version None": {"base_version": None},
}


@pytest.mark.parametrize("bad", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_metadata_is_rejected_alone_at_push_time(rig, bad):
    r = rig()
    d = r.push(r.meta(0, **bad), r.payload(8 * r.honest()))
    assert not d.accept and d.reason  # rejected with a reason, nothing raised
    assert r.push(r.meta(1), r.payload(8 * r.honest())).accept
    events = r.close()
    assert kinds(events, "merge")[0]["contributors"] == [1]  # the good peer's round merges
    json.dumps(events)  # the rejection event of a malformed push is still valid JSON
    assert r.store.core.versions[P] == 1
    for m in (0, 1):  # the ledger holds nothing that breaks a registration, now or after a restart
        assert r.store.register(m).incarnation == 2
    r.restart_store()
    assert r.store.register(1).incarnation == 3


def test_a_malformed_push_that_reaches_a_merge_is_rejected_alone(rig):
    """The checks at close run the same metadata checks: one bad push does not drop the round."""
    r = rig()
    core = r.syncer.core
    good = r.meta(1)
    assert core.push(good, r.payload(8 * r.honest()), now=0.0).accept
    items, _ = core.take(P, 0.0)
    items.append((r.meta(0, tokens=10**200), r.payload(8 * r.honest())))
    out = core.merge(P, items, grace_used=0.0)
    assert out.commit is not None and [mp.learner_id for mp in out.commit.merged] == [1]
    assert [x["reason"].split(":")[0] for x in out.rejections] == ["malformed metadata"]


# ---- 5. the merge and push() on different threads -------------------------------------------------


class _Untouchable:
    """Stands in for state that `push` changes under the lock: the merge must not read it."""

    def __getattr__(self, name):
        raise AssertionError(f"the merge read .{name} of state push() changes")

    def __iter__(self):
        raise AssertionError("the merge iterated state push() changes")


def test_the_merge_reads_only_what_take_fixed(rig):
    r = rig()
    core = r.syncer.core
    assert core.push(r.meta(0), r.payload(8 * r.honest()), now=0.0).accept
    items, grace = core.take(P, 0.0)
    kept = core.timings, core.registry, core.rounds, core.dropped
    core.timings = core.registry = core.rounds = core.dropped = _Untouchable()  # what push() changes
    out = core.merge(P, items, grace_used=grace)
    core.timings, core.registry, core.rounds, core.dropped = kept
    assert out.commit is not None and out.event["contributors"] == [0]
