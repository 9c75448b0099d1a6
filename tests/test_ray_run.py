"""The actor system on a real local Ray cluster: restarts, snapshots, lost payloads, equivalence.

Every test kills real actors (`ray.kill(..., no_restart=False)`, as a preemption would) and checks
what survived. A session-wide local Ray cluster is started once (see the fixture).
"""

import json
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import wait_for

from dloco import build, config

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

RUN = ("metrics.eval_every_s=1000", "store.snapshot_every=4", "learners.num_cpus=0.5", "budget.tokens=0")


@pytest.fixture
def cfg_for(tiny_run):
    return lambda *overrides: config.load(overrides=(*tiny_run, *RUN, *overrides))


def merges(handle, after=0.0):
    return [e for e in handle.metrics("merge") if e["time"] > after]


def test_killed_learner_restarts_resumes_and_others_never_stall(ray_cluster, cfg_for, tmp_path):
    from actors.launch import start

    h = start(cfg_for("learners.count=3", "syncer.quorum=1", "budget.seconds=600"), run_dir=tmp_path)
    try:
        wait_for(lambda: any(1 in e["contributors"] for e in merges(h)) and len(merges(h)) >= 6)
        ledger_before = ray.get(h.store.summary.remote())
        killed_at = time.time()
        h.kill_learner(1)
        restart = wait_for(lambda: [e for e in h.metrics("learner_restart") if e["learner"] == 1])[0]
        assert restart["incarnation"] == 2
        # it resumed from its merged cursor (the ledger's position), not from the start of its shard
        assert restart["step"] > 0 and restart["cursor"] is not None
        assert ledger_before["registry"][1] == 1
        # the others kept merging while learner 1 was down (K = 1: nobody waits for it)
        # (a round that closed within a second of the kill may still hold learner 1's last push)
        during = [e for e in merges(h, killed_at + 1.0) if e["time"] < restart["time"]]
        assert during and all(1 not in e["contributors"] for e in during)
        # and learner 1 contributes again, as incarnation 2
        wait_for(lambda: any((1, 2) in zip(e["contributors"], e["incarnations"], strict=True) for e in merges(h)))
    finally:
        h.stop()


def test_a_warm_spare_takes_over_a_killed_learner_at_its_merged_cursor(ray_cluster, cfg_for, tmp_path):
    """learners.spares=1: the killed learner's identity passes to the warm spare, which resumes at
    the merged cursor the store holds for it (no token trained twice, none skipped); a new spare
    takes its place; the spare's idle time counts as provisioned."""
    from actors.launch import start

    h = start(
        cfg_for("learners.count=2", "learners.spares=1", "syncer.quorum=1", "budget.seconds=600"), run_dir=tmp_path
    )
    try:
        wait_for(lambda: any(1 in e["contributors"] for e in merges(h)) and len(merges(h)) >= 6)
        assert h.spares is not None
        wait_for(lambda: ray.wait([h.spares.waiting[0][2]], timeout=0)[0])  # warm: JAX loaded, step compiled
        spare = h.spares.waiting[0][1]
        h.kill_learner(1)
        takeover = wait_for(lambda: h.metrics("spare_takeover"))[0]
        assert (takeover["spare"], takeover["learner"], takeover["cold"]) == (0, 1, False)
        assert h.learners[1] is spare
        restart = wait_for(lambda: [e for e in h.metrics("learner_restart") if e["learner"] == 1])[0]
        last: dict[int, int] = {}  # fragment → the last step of incarnation 1 merged before the spare registered
        for e in merges(h):
            for m, inc, step in zip(e["contributors"], e["incarnations"], e["steps"], strict=True):
                if (m, inc) == (1, 1) and e["time"] <= restart["time"]:
                    last[e["fragment"]] = max(last.get(e["fragment"], 0), step)
        assert restart["incarnation"] == 2 and len(last) == 2 and restart["step"] == min(last.values()), (last, restart)
        assert restart["cursor"] is not None
        wait_for(lambda: any((1, 2) in zip(e["contributors"], e["incarnations"], strict=True) for e in merges(h)))
        assert [e["spare"] for e in h.metrics("spare_start")] == [0, 1]  # the next spare started at the takeover
    finally:
        summary = h.stop()
    assert summary is not None and summary["spare_s"] > 0 and summary["learner_time"][1]["provisioned"] > 0


def test_killed_store_with_its_disk_lost_restores_from_its_mirror_without_losing_versions(
    ray_cluster, cfg_for, tmp_path
):
    from actors.launch import start

    bucket, run = tmp_path / "bucket", tmp_path / "run"
    h = start(cfg_for("learners.count=2", "budget.seconds=600", f"store.mirror={bucket.as_uri()}"), run_dir=run)
    try:
        wait_for(lambda: len(merges(h)) >= 6 and list(bucket.glob("snap-*")))
        before = ray.get(h.store.summary.remote())["versions"]
        (run / "store").rename(tmp_path / "lost")  # the head's disk is gone (later commits fail, unapplied)
        h.kill_store()  # and so is the store: its successor finds an empty run dir
        after = wait_for(lambda: [e for e in h.metrics("store_start") if e.get("restored_from")], timeout=120)[0]
        assert after["restored_from"].endswith(f"(pulled from {bucket.as_uri()})"), after
        assert all(a >= b for a, b in zip(after["versions"], before, strict=True)), (before, after["versions"])
        assert list((run / "store").glob("snap-*"))
        n = len(merges(h))
        wait_for(lambda: len(merges(h)) >= n + 3)  # training and merging continue
        versions = ray.get(h.store.summary.remote())["versions"]
        assert sum(versions) > sum(after["versions"])
    finally:
        h.stop()


def test_two_shards_one_killed_restores_alone_and_the_other_merges_on(ray_cluster, cfg_for, tmp_path):
    """syncer.shards=2, each pair placed by its region resource: store-1 and syncer-1 killed, shard 1
    restores its fragments (1, 3) from its own directory with no version lost, shard 0 merges
    through the outage, no learner restarts, and the weights read back from disk are the run's."""
    from actors.launch import start
    from dloco import export

    where = ("fragments.count=4", "syncer.shards=2", "syncer.shard_resources=[region_a, region_b]")
    h = start(cfg_for("learners.count=2", "budget.seconds=600", *where), run_dir=tmp_path)
    try:
        assert [ray.get(a.ping.remote()) for a in (*h.stores, *h.syncers)] == [True] * 4
        assert ray.available_resources().get("region_a", 0) < 1 and ray.available_resources().get("region_b", 0) < 1
        wait_for(lambda: {e["fragment"] for e in merges(h)} == {0, 1, 2, 3} and len(merges(h)) >= 8)
        before = ray.get(h.stores[1].summary.remote())["versions"]
        killed_at = time.time()
        h.kill_store(1)
        h.kill_syncer(1)
        back = wait_for(lambda: [e for e in h.metrics("store_start") if e["time"] > killed_at], timeout=120)[0]
        assert back["restored_from"] and back["versions"][0::2] == [0, 0]  # shard 1's own fragments only
        assert all(a >= b for a, b in zip(back["versions"], before, strict=True)), (before, back["versions"])
        during = [e["fragment"] for e in merges(h, killed_at + 0.5) if e["time"] < back["time"]]
        assert set(during) <= {0, 2}  # shard 0 went on merging while shard 1 was down
        wait_for(lambda: {1, 3} <= {e["fragment"] for e in merges(h, back["time"])})
        first = {e["fragment"]: e["version"] for e in reversed(merges(h, back["time"])) if e["fragment"] in (1, 3)}
        assert all(first[p] > back["versions"][p] for p in (1, 3))
        assert not h.metrics("learner_restart")
        assert [e["target"] for e in h.metrics("fault")] == ["store-1", "syncer-1"]
    finally:
        summary = h.stop()
    assert summary is not None and summary["error"] is None
    read = export.read_run(tmp_path)
    assert read.versions == summary["versions"] and min(read.versions) > 0
    assert len(summary["store_shards"]) == 2


def test_killed_syncer_is_rebuilt_from_the_store_and_merging_resumes(ray_cluster, cfg_for, tmp_path):
    """Also the evaluator actor, placed by its resource (the driver holds no model): killed, it
    restarts and the run's evaluations go on; its loss is the model's on the run's validation batches."""
    from actors.launch import start
    from dloco import inner

    cfg = cfg_for(
        "learners.count=2", "budget.seconds=600", "metrics.eval_every_s=2", "metrics.eval_resources={evaluator: 1}"
    )
    h = start(cfg, run_dir=tmp_path)
    try:
        assert h._on_driver is None and h.evaluator is not None
        wait_for(lambda: ray.available_resources().get("evaluator", 0) == 0)  # the actor holds the resource
        wait_for(lambda: len(merges(h)) >= 4)
        h.kill_syncer()
        killed_at = time.time()
        restarted = wait_for(lambda: [e for e in h.metrics("syncer_start") if e["time"] > killed_at])[0]
        store_versions = ray.get(h.store.summary.remote())["versions"]
        assert all(s >= r for s, r in zip(store_versions, restarted["versions"], strict=True))
        wait_for(lambda: len(merges(h, restarted["time"])) >= 3)
        new = merges(h, restarted["time"])
        assert new[0]["version"] >= restarted["versions"][new[0]["fragment"]] + 1
        ray.kill(h.evaluator, no_restart=False)
        evaluator_killed = time.time()
        wait_for(lambda: [e for e in h.metrics("eval") if e["time"] > evaluator_killed + 1], 120)
        assert h.status()["error"] is None
        h._stop_requested.set()  # the run winds down (learners stop); its actors stay until stop()
        h._thread.join()
        versions = None
        while versions != (now := ray.get(h.store.summary.remote())["versions"]):  # the last rounds committed
            versions = now
            time.sleep(1.5)
        bp, mesh = build.blueprint(cfg), inner.make_mesh()
        step, batches = inner.make_eval_step(bp.model, mesh), build.eval_set(cfg, bp.corpus)
        mine = inner.evaluate(step, inner.replicate(h.params(), mesh), batches, mesh)
        assert h.evaluate() == pytest.approx(mine, rel=1e-6)  # the evaluator's loss is the model's
    finally:
        h.stop()


def test_payload_lost_with_its_dead_owner_is_skipped_not_fatal(ray_cluster, cfg_for, tmp_path):
    from actors.store import FragmentStore
    from actors.syncer import Syncer
    from dloco import build
    from dloco.policy import ContributionMeta

    class FragmentOwner:  # defined here so that Ray ships it by value to its worker
        """Puts a fragment payload into the object store and so owns it, as a learner does."""

        def put(self, delta):
            from dloco import compress

            return [ray.put({n: compress.encode(x, "fp32") for n, x in delta.items()})]

    cfg = cfg_for("learners.count=2", "syncer.quorum=2", "compression.dtype=fp32", "budget.seconds=10")
    p = 1
    shapes = build.blueprint(cfg).plan.fragments[p].shape_map
    ns = f"lost-{time.time_ns()}"
    store = ray.remote(FragmentStore).options(name="store", namespace=ns).remote(cfg.to_dict(), str(tmp_path))
    for m in (0, 1):
        ray.get(store.register.remote(m))
    syncer = ray.remote(Syncer).options(name="syncer", namespace=ns).remote(cfg.to_dict(), "store", ns)
    delta = {n: np.full(s, 0.01, np.float32) for n, s in shapes.items()}
    owners = [ray.remote(FragmentOwner).remote() for _ in range(2)]
    refs = [ray.get(o.put.remote(delta)) for o in owners]
    ray.kill(owners[0], no_restart=True)  # learner 0 dies after pushing: its payload dies with it

    def meta(m):
        return ContributionMeta(m, 1, p, 0, 100, 10, 10, 0.1, {"epoch": 0, "index": 10}, time.time())

    assert ray.get(syncer.push.remote(meta(0), refs[0])).accept
    assert ray.get(syncer.push.remote(meta(1), refs[1])).accept  # K = 2 reached: the round closes
    seen = []
    wait_for(lambda: seen.extend(ray.get(syncer.drain_events.remote())) or any(e["event"] == "merge" for e in seen))
    lost = [e for e in seen if e["event"] == "rejection"]
    merged = [e for e in seen if e["event"] == "merge"]
    assert len(lost) == 1 and lost[0]["learner"] == 0 and "payload lost" in lost[0]["reason"]
    assert merged[0]["contributors"] == [1] and merged[0]["version"] == 1
    assert ray.get(store.summary.remote())["versions"][p] == 1
    for a in (syncer, store, owners[1]):
        ray.kill(a, no_restart=True)


def test_ray_run_equals_in_process_run_on_a_fixed_schedule(ray_cluster, cfg_for, tmp_path):
    """K = M, γ = 0, equal speeds, overwrite (streaming, blocking after τ): the same global model."""
    from actors.launch import start
    from dloco.sim import run_local

    cfg = cfg_for(
        "algorithm=streaming",
        "learners.count=2",
        "syncer.quorum=2",
        "syncer.grace_factor=0",
        "learner.receive=overwrite",
        "budget.steps=24",
        "budget.tokens=0",
    )
    local = run_local(cfg, tmp_path / "local", steps=24, devices=1)
    expected = local.store.versions
    assert expected == [3, 3]
    h = start(cfg, run_dir=tmp_path / "ray")
    try:
        wait_for(lambda: ray.get(h.store.summary.remote())["versions"] == expected, timeout=180)
        _, got = ray.get(h.store.fragments.remote())
    finally:
        h.stop()
    worst = 0.0
    for p, frag in enumerate(got):
        for n, x in frag.items():
            ref = local.store.fragment(p)[1][n]
            worst = max(worst, float(np.abs(x - ref).max() / (np.abs(ref).max() + 1e-12)))
            np.testing.assert_allclose(x, ref, rtol=1e-4, atol=1e-6)
    print(f"\nRay vs in-process after 24 steps x 2 learners, 6 rounds: max relative difference {worst:.2e}")


def test_delta_publish_with_latency_survives_a_store_restart(ray_cluster, cfg_for, tmp_path):
    """publish: delta over an emulated 0.2 s link: pushes reach the syncer that late, learners get
    int4 deltas (a fraction of the full fragments' bytes) and keep merging after the store restarts
    (when they get Θ̂_p in full once)."""
    from actors.launch import start

    group = "learners.groups=[{name: far, count: 2, num_cpus: 0.5, latency_s: 0.2}]"
    h = start(cfg_for(group, "compression.publish=delta", "budget.seconds=600"), run_dir=tmp_path)
    try:
        wait_for(lambda: len(merges(h)) >= 6)
        ages = [a for e in merges(h) for a in e["push_age_s"]]
        assert min(ages) >= 0.2, ages
        full = sum(4 * f.size for f in build.blueprint(h.cfg).plan.fragments)
        assert all(e["bytes_out"] < full / 6 for e in merges(h))
        # the driver polls learner statuses in the background: wait until a poll has seen an install
        wait_for(lambda: sum(s["installs"] for s in h.status()["learners"].values()) > 0)
        status = h.status()["learners"]
        installs = sum(s["installs"] for s in status.values())
        assert installs > 0 and sum(s["bytes_in"] for s in status.values()) < installs * full / 6
        before = ray.get(h.store.summary.remote())["versions"]
        h.kill_store()
        wait_for(lambda: [e for e in h.metrics("store_start") if e.get("restored_from")], timeout=120)
        n = len(merges(h))
        wait_for(lambda: len(merges(h)) >= n + 4)
        assert sum(ray.get(h.store.summary.remote())["versions"]) > sum(before)
    finally:
        h.stop()


def _break_log(run_dir):
    """Replaces the store's commit log directory by a file (as a full or read-only disk would fail
    every write); returns the function that puts it back."""
    wal, away = run_dir / "store" / "wal", run_dir / "wal-away"
    wal.rename(away)
    wal.write_text("not a directory")

    def mend():
        wal.unlink()
        away.rename(wal)

    return mend


def _since(h, t):
    """What happened after t, for a failure message: events by kind, and the newest error."""
    kinds: dict[str, int] = {}
    for e in h.metrics():
        if e["time"] >= t:
            kinds[e["event"]] = kinds.get(e["event"], 0) + 1
    return f"events since: {kinds}; status: {h.status()}"


def test_failing_commits_are_reported_and_merging_resumes_when_the_disk_is_back(ray_cluster, cfg_for, tmp_path):
    """The store's commit log made unwritable: the syncer's failed commits reach `status()`; once
    the directory is back, merging carries on and the run has no error."""
    from actors.launch import start

    h = start(cfg_for("learners.count=2", "budget.seconds=600"), run_dir=tmp_path)
    try:
        wait_for(lambda: len(merges(h)) >= 3)
        broken_at = time.time()
        mend = _break_log(tmp_path)
        wait_for(lambda: h.status()["errors"].get("syncer_error"), timeout=60)
        mend()
        mended_at = time.time()
        # carries on once commits succeed (a merge newer than the repair: none is logged meanwhile)
        if not wait_for(lambda: merges(h, after=mended_at), timeout=120, fail=False):
            raise AssertionError(f"no merge after the log was back; {_since(h, broken_at)}")
        assert h.status()["error"] is None and h.status()["last_error"].startswith("RayTaskError(NotADirectoryError")
    finally:
        h.stop()


def test_commits_failing_past_fail_after_s_end_the_run_with_that_error(ray_cluster, cfg_for, tmp_path):
    """The commit log stays unwritable past `store.fail_after_s`: the run ends on its own with that
    error in ``summary.json``: it never hangs."""
    from actors.launch import start

    h = start(cfg_for("learners.count=2", "budget.seconds=600", "store.fail_after_s=8"), run_dir=tmp_path)
    try:
        wait_for(lambda: len(merges(h)) >= 3)
        _break_log(tmp_path)
        broken_at = time.time()
        result = h.wait(timeout=180)
        assert result is not None and h.status()["done"], _since(h, broken_at)
        summary = result.metrics
        assert result.error == summary["error"] == h.summary["error"]
        assert summary["error"].startswith("commits have failed for") and "store.fail_after_s=8" in summary["error"]
        assert time.time() - broken_at < 120  # ended by the supervisor, not by the budget (600 s)
        assert summary["errors"]["syncer_error"] >= 2
        on_disk = json.loads((tmp_path / "summary.json").read_text())
        assert on_disk["error"] == summary["error"]
        assert [e for e in h.metrics("run_failed") if e["error"] == summary["error"]]
    finally:
        h.stop()


def test_a_store_that_cannot_start_fails_the_start_in_one_line_and_leaves_nothing(
    ray_cluster, cfg_for, tmp_path, monkeypatch
):
    """Another run takes the directory between the preflight check and the store's start (it holds
    the store's lock): the store actor cannot start (it waits 10 s for the lock, as for a
    predecessor still exiting), `start` raises one line naming the holder, and what the start wrote
    is removed again, so the same command works once the directory is free."""
    from actors.health import ActorStartError
    from actors.launch import start
    from dloco import preflight

    (tmp_path / "mine.txt").write_text("a file of the user's")
    hold = (
        "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); fcntl.flock(f, fcntl.LOCK_EX); "
        "print('held', flush=True); time.sleep(300)"
    )
    holders = []
    record = preflight.record

    def record_then_race(pf, cfg):
        path = record(pf, cfg)
        (pf.run_dir / "store").mkdir()
        holders.append(
            subprocess.Popen(
                [sys.executable, "-c", hold, str(pf.run_dir / "store" / "LOCK")], stdout=subprocess.PIPE, text=True
            )
        )
        assert holders[0].stdout is not None and holders[0].stdout.readline().strip() == "held"
        return path

    monkeypatch.setattr(preflight, "record", record_then_race)
    try:
        t0 = time.time()
        with pytest.raises(ActorStartError) as err:
            start(cfg_for("learners.count=1", "budget.seconds=60"), run_dir=tmp_path)
        msg = str(err.value)
        assert "\n" not in msg and msg.startswith("the store could not start:") and "in use by another store" in msg
        assert time.time() - t0 < 90
        assert [p.name for p in tmp_path.iterdir()] == ["mine.txt"]  # as before the start
    finally:
        for h in holders:
            h.kill()


def test_learners_whose_corpus_differs_from_the_drivers_refuse_to_start_and_the_run_ends(
    ray_cluster, cfg_for, tmp_path, monkeypatch
):
    """On a real cluster each node prepares the corpus itself: a node with other files (or another
    Python's stdlib, or a BPE trained differently) would train on other token ids. Here the
    driver's identity of the corpus is made to differ from the learners': every learner refuses to
    start with one line naming it, none registers, and the run ends with that error."""
    from actors.launch import start
    from dloco import build

    real = build.corpus_identity
    monkeypatch.setattr(build, "corpus_identity", lambda c: {**real(c), "key": "0" * 64})  # the driver's only
    with (
        pytest.raises(RuntimeError, match="the notebook cell failed"),
        start(cfg_for("learners.count=2", "budget.seconds=300"), run_dir=tmp_path) as h,
    ):  # `with`: however the block ends, the run is stopped and its actors removed
        result = h.wait(timeout=180)
        assert result is not None and result.error is not None and result.error.startswith("every learner failed: ")
        summary = result.metrics
        assert (
            "its corpus differs from the driver's" in summary["error"]
            and "000000000000, byte on the driver" in summary["error"]
        )
        failed = [e for e in h.metrics("actor_error") if e["target"].startswith("learner-")]
        assert len(failed) == 2 and all("corpus differs" in e["error"] for e in failed)
        assert not h.metrics("learner_start") and not h.metrics("merge")  # none registered, nothing merged
        raise RuntimeError("the notebook cell failed")
    for name in ("store", "syncer", "learner-0"):
        with pytest.raises(ValueError):  # gone: not merely dead-and-restarting
            ray.get_actor(name, namespace=h.namespace)
    assert (tmp_path / "summary.json").is_file() and h._metrics_file.closed


def test_sigterm_drains_a_learner_it_pushes_its_progress_leaves_and_resumes_where_it_merged_and_metrics_show_it(
    ray_cluster, cfg_for, tmp_path, capsys
):
    """A preemption notice for real: SIGTERM to a learner's process. It pushes every fragment's
    unmerged progress at once (off schedule), waits for the merges (within learners.drain_s),
    deregisters and exits; Ray restarts it and it resumes at exactly the step it drained at, so
    nothing it trained is lost or trained twice. The same run shows its Ray metrics on the node's
    Prometheus endpoint, and `dloco status` / `dloco stop` work on it from outside."""
    import os
    import signal

    from actors.launch import start

    cfg = cfg_for("learners.count=2", "budget.seconds=300", "sync.every=16", "learners.drain_s=20")
    with start(cfg, run_dir=tmp_path) as h:
        wait_for(lambda: any(1 in e["contributors"] for e in merges(h)), 120)
        pid = h.status()["learners"][1]["node"]["pid"]
        os.kill(pid, signal.SIGTERM)
        sent = time.time()
        wait_for(lambda: h.metrics("learner_drain"), 60)
        wait_for(lambda: [e for e in h.metrics("learner_restart") if e["learner"] == 1], 120)
        drain = h.metrics("learner_drain")[0]
        assert (drain["learner"], drain["incarnation"], drain["merged"]) == (1, 1, True), drain
        assert drain["pushed"] <= 2 and drain["seconds"] < 20 and drain["time"] - sent < 20, drain
        at = drain["step"]
        last: dict[int, int] = {}  # per fragment, the newest step of learner 1's first incarnation merged
        for e in merges(h):
            for m, inc, step in zip(e["contributors"], e["incarnations"], e["steps"], strict=True):
                if (m, inc) == (1, 1):
                    last[e["fragment"]] = max(last.get(e["fragment"], -1), step)
        assert last == {0: at, 1: at}, last  # every fragment merged all it trained, up to the drain
        stops = [e for e in h.metrics("learner_stop") if e["learner"] == 1]
        back = [e for e in h.metrics("learner_restart") if e["learner"] == 1][0]
        assert stops and stops[0]["time"] <= back["time"]  # deregistered, then registered again
        assert (back["incarnation"], back["step"]) == (2, at)  # resumes at its merged cursor: the drained step
        wait_for(lambda: h.status()["learners"][1]["node"]["pid"] != pid, 60)
        # the run's Ray metrics on the node's Prometheus endpoint (`actors.observe`)
        import urllib.request

        node = ray.nodes()[0]
        url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"

        def exported():
            body = urllib.request.urlopen(url, timeout=5).read().decode()
            return {
                line.split("{")[0]: float(line.rsplit(" ", 1)[1])
                for line in body.splitlines()
                if line.startswith("ray_dloco_") and f'run="{tmp_path.name}"' in line
            }

        def merged_exported():  # the endpoint shows what was exported last (periodically): wait for a tick with merges
            g = exported()
            return len(g) == 11 and g["ray_dloco_merges"] > 0 and g

        gauges = wait_for(merged_exported, 60)
        assert gauges["ray_dloco_merges"] > 0 and 0 < gauges["ray_dloco_goodput"] <= 1, gauges
        assert gauges["ray_dloco_tokens_trained"] > 0 and gauges["ray_dloco_bytes_up"] > 0, gauges
        # and `dloco status` / `dloco stop` from outside, through the run directory
        from actors.cli import main

        assert main(["status", str(tmp_path)]) == 0 and "state      running" in capsys.readouterr().out
        assert main(["stop", str(tmp_path), "--wait", "120"]) == 0
        result = h.wait(timeout=10)
        assert result is not None and result.error is None and result.metrics["eval_loss_end"] is not None
