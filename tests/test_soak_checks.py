"""The checks `benchmarks/soak.py` gates a release on, on hand-written traces and files: each one
must fail on the defect it exists to catch (a soak that cannot fail proves nothing)."""

import sys
from pathlib import Path

import numpy as np

from dloco import durable

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import soak  # noqa: E402


def merge(t, p, v):
    return {"event": "merge", "time": t, "fragment": p, "version": v}


def test_versions_check_passes_a_clean_trace_with_restarts():
    events = [merge(1, 0, 1), merge(2, 1, 1), merge(3, 0, 2), {"event": "store_start", "time": 4, "versions": [2, 1]}]
    events += [merge(5, 0, 3)]
    assert soak.versions_check(events, final=[3, 1]) == {"lost": 0, "problems": [], "merged_versions": [3, 1]}


def test_versions_check_counts_what_a_restart_lost_and_repeats():
    events = [merge(1, 0, 1), merge(2, 0, 2), merge(3, 0, 3), {"event": "store_start", "time": 4, "versions": [1]}]
    events += [merge(5, 0, 2)]  # v2 and v3 merged again: lost once, and a repeat
    r = soak.versions_check(events, final=[2])
    assert r["lost"] == 2 + 1  # the restart lost v2, v3; the store ends at v2 after v3 was merged
    assert any("restored v1 after v3" in p for p in r["problems"])
    assert any("version 2 merged after 3" in p for p in r["problems"])


def test_rss_growth_measures_each_process_over_its_own_life():
    def sample(t, pid, mb):
        return {"t": t, "store": {"pid": pid, "rss_bytes": mb << 20}}

    flat = [sample(t, 1, 100) for t in range(0, 400, 10)] + [sample(t, 2, 50) for t in range(400, 700, 10)]
    g = soak.rss_growth(flat, "store", warmup=60)
    assert (g["start_mb"], g["end_mb"], g["growth"], g["max_growth"], g["pids"]) == (100, 100, 0.0, 0.0, 2)
    leaking = [sample(t, 1, 100 + t // 10) for t in range(0, 400, 10)]  # +1 MB every sample
    g = soak.rss_growth(leaking, "store", warmup=60)
    assert g["max_growth"] > soak.RSS_LIMIT and g["start_mb"] == 107 and g["end_mb"] == 138  # medians of 3
    assert soak.rss_growth([{"t": 1, "store": None}], "store", warmup=0)["growth"] is None


def test_disk_check_finds_damaged_and_non_finite_files(tmp_path):
    store = tmp_path / "store"
    (store / "wal").mkdir(parents=True)
    durable.write_arrays(store / "wal" / "p000-v00000001.npz", {"v/w": np.ones(3, np.float32)}, {"version": 1})
    assert soak.disk_check(store) == {"files": 1, "corrupt": [], "nonfinite": [], "quarantined": []}
    durable.write_arrays(store / "wal" / "p000-v00000002.npz", {"v/w": np.array([1, np.nan], np.float32)}, {})
    bad = store / "wal" / "p001-v00000001.npz"
    durable.write_arrays(bad, {"v/w": np.ones(3, np.float32)}, {})
    bad.write_bytes(bad.read_bytes()[:-3])
    r = soak.disk_check(store)
    assert r["files"] == 3 and r["nonfinite"] == ["wal/p000-v00000002.npz"] and len(r["corrupt"]) == 1


def test_restart_times_count_from_the_kill_to_the_first_commit_after_the_restart():
    """A merge between the kill and the restart is a commit acknowledged before the kill: the first
    commit of a restart is the first merge after its process serves; a kill never followed by a
    restart (or a commit) reads None, which fails the soak's restart check."""
    events = [
        {"event": "fault", "target": "syncer", "kind": "kill", "t": 10.0},
        {"event": "merge", "t": 10.5},
        {"event": "syncer_start", "t": 14.0, "startup_s": {"process": 3.0, "model": 0.5, "state": 0.5}},
        {"event": "merge", "t": 16.0},
        {"event": "fault", "target": "learner-0", "kind": "kill", "t": 17.0},
        {"event": "fault", "target": "store", "kind": "kill", "t": 20.0, "skipped": "down already"},
        {"event": "fault", "target": "store", "kind": "kill", "t": 30.0},
    ]
    assert soak.restart_times(events) == [
        {
            "target": "syncer",
            "killed_at": 10.0,
            "serving_s": 4.0,
            "first_commit_s": 6.0,
            "startup_s": {"process": 3.0, "model": 0.5, "state": 0.5},
        },
        {"target": "store", "killed_at": 30.0, "serving_s": None, "first_commit_s": None, "startup_s": None},
    ]
