"""The in-process run (dloco/sim.py): determinism and token weighting across unequal learners."""

import numpy as np
import pytest

from dloco import config
from dloco.sim import run_local


def test_batch_sizes_set_the_weights(tiny_run, tmp_path):
    # group b trains twice the tokens per step: w = tokens²/steps is 4× group a's.
    cfg = config.load(
        overrides=(
            *tiny_run,
            "algorithm=streaming",
            "syncer.quorum=2",
            "learners.groups=[{name: a, count: 1, batch_size: 4}, {name: b, count: 1, batch_size: 8}]",
        )
    )
    run = run_local(cfg, tmp_path, steps=16, step_times=[1.0, 1.0])
    merges = [e for e in run.events if e["event"] == "merge"]
    assert len(merges) == 4
    for e in merges:
        assert e["contributors"] == [0, 1]
        assert e["tokens"][1] == 2 * e["tokens"][0]
        assert e["weights"] == pytest.approx([0.2, 0.8])


def test_speeds_set_the_weights_and_runs_are_deterministic(tiny_run, tmp_path):
    cfg = config.load(
        overrides=(
            *tiny_run,
            "learners.count=2",
            "syncer.quorum=2",
            "syncer.grace_factor=0",
            "learner.receive=rebase",
        )
    )
    a = run_local(cfg, tmp_path / "a", steps=24, step_times=[1.0, 1.7])
    b = run_local(cfg, tmp_path / "b", steps=24, step_times=[1.0, 1.7])
    merges = [e for e in a.events if e["event"] == "merge"]
    assert merges == [e for e in b.events if e["event"] == "merge"]  # bit-for-bit reproducible
    both = [e for e in merges if e["contributors"] == [0, 1]]
    assert both
    for e in merges:
        w = np.array(e["tokens"], float) ** 2 / np.array(e["inner_steps"], float)
        assert e["weights"] == pytest.approx(list(w / w.sum()))
    # the faster learner has trained more since its anchor by the time the round closes
    assert any(e["weights"][0] > e["weights"][1] for e in both)
    for p in range(2):
        for n, x in a.store.fragment(p)[1].items():
            np.testing.assert_array_equal(x, b.store.fragment(p)[1][n])


def test_a_round_trip_longer_than_h_steps_merges_no_step_twice(tiny_run, tmp_path):
    """Each merge reaches its learner 20 steps after the push (H = 8): every learner has two more
    pushes of the fragment in flight, each containing the merged one. No step is merged twice
    (a merged push starts at or after its learner's last merged step), and the global model learns.
    Without the overlap rule 14 of 30 merged pushes here overlapped (104 steps merged twice)."""
    cfg = config.load(overrides=(*tiny_run, "learners.count=2", "seed=1"))
    run = run_local(cfg, tmp_path, steps=60, sync_time=10.0)
    last = {}
    merges = [e for e in run.events if e["event"] == "merge"]
    assert len(merges) >= 8
    for e in merges:
        for m, step, steps in zip(e["contributors"], e["steps"], e["inner_steps"], strict=True):
            assert step - steps >= last.get((e["fragment"], m), 0)
            last[e["fragment"], m] = step
    assert run.evaluate() < 4.2  # start 5.55; 3.66 measured (seed 0: 3.70)


@pytest.mark.parametrize("dynamic", [True, False])
def test_dynamic_local_updates_merge_a_fleet_of_unequal_speeds_in_whole_rounds(tiny_run, tmp_path, dynamic):
    """sync.dynamic (DyLU): after one period in which the beats lock, every round of each fragment
    holds every learner's push, each covering the steps its speed fits into T = H × 1.0 s, and
    the rounds are T apart. On the fixed schedule the same fleet drifts apart and nearly every
    push is merged alone (its peers' progress reaches it a round late: the asynchrony cost)."""
    cfg = config.load(
        overrides=(*tiny_run, "learners.count=4", "data.shards=4", f"sync.dynamic={str(dynamic).lower()}")
    )
    speeds = [1.0, 1.1, 1.2, 1.3]
    run = run_local(cfg, tmp_path, steps=64, step_times=speeds)
    H, T = cfg.sync.every, cfg.sync.every * 1.0
    steady = [e for e in run.events if e["event"] == "merge" and 2 * T < e["time"] < 64.0]  # learner 0 ends at 64 s
    sizes = [len(e["contributors"]) for e in steady]
    if not dynamic:
        assert sum(sizes) / len(sizes) < 1.6
        return
    assert len(steady) >= 8 and sizes == [4] * len(steady)
    for e in steady:  # each learner's steps: the most that fit before the beat (⌈(T − lateness)/ξ⌉ − 1)
        for m, n in zip(e["contributors"], e["inner_steps"], strict=True):
            assert abs(n * speeds[m] - T) <= speeds[m] + 1e-9, (m, n)
        assert e["inner_steps"][0] in (H - 1, H)  # the fastest learner: H steps (H − 1 the first time)
    for p in (0, 1):
        times = [e["time"] for e in steady if e["fragment"] == p]
        assert all(abs(b - a - T) < 1.0 for a, b in zip(times, times[1:], strict=False))


def test_decoupled_at_equal_speeds_is_synchronous_diloco_bit_for_bit(tiny_run, tmp_path):
    """One fragment, K = 1, plain averaging, learners of one speed: every push of a period reaches
    the syncer together, the round closes with all of them (no grace needed), and each merge is
    installed before the next step — so decoupled computes exactly synchronous DiLoCo (η 1, μ 0),
    whatever its overlap τ and install rule. What decoupled loses on unequal speeds is therefore
    the drift between learners' schedules, which `sync.dynamic` removes (docs/RESULTS.md, ladder)."""
    base = (*(o for o in tiny_run if not o.startswith(("fragments.", "sync.overlap"))), "learners.count=3")
    base += ("data.shards=3",)  # diloco: τ = 0, overwrite (its defaults); decoupled: τ = 2, rebase
    # (diloco's outer step and schedule; and its float32 install: decoupled publishes int4 deltas by default)
    plain = ("outer.lr=1.0", "outer.momentum=0.0", "sync.dynamic=false", "compression.publish=full")
    runs = {}
    for algorithm in ("diloco", "decoupled"):
        cfg = config.load(overrides=(*base, *plain, f"algorithm={algorithm}", "fragments.count=1"))
        runs[algorithm] = run_local(cfg, tmp_path / algorithm, steps=32, step_times=[1.0] * 3, sync_time=0.4)
    a, b = runs["diloco"].store, runs["decoupled"].store
    assert a.versions == b.versions == [4]
    for n, x in a.fragment(0)[1].items():
        np.testing.assert_array_equal(b.fragment(0)[1][n], x)
    merges = [e for e in runs["decoupled"].events if e["event"] == "merge"]
    assert [e["contributors"] for e in merges] == [[0, 1, 2]] * 4
