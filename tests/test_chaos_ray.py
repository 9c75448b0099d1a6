"""Chaos on a real local Ray cluster: dp stops the world while a learner is down, elastic_dp
reconfigures around it, decoupled (K = 1) keeps advancing, and a seeded schedule is carried out
and logged fault by fault."""

import pytest
from conftest import wait_for

from dloco import chaos, config, metrics

pytest.importorskip("ray")

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

RUN = ("metrics.eval_every_s=1000", "learners.num_cpus=0.5", "budget.tokens=0", "budget.seconds=600")


def dp_run(tiny_run, *overrides):
    base = [o for o in tiny_run if not o.startswith(("sync.", "fragments."))]
    return config.load(overrides=(*base, *RUN, "learners.count=2", *overrides))


def restart_of(h, m, after):
    return [e for e in h.metrics("learner_restart") if e["learner"] == m and e["time"] > after]


def test_dp_stops_the_world_while_a_learner_is_down(ray_cluster, tiny_run, tmp_path):
    from actors.launch import start

    h = start(dp_run(tiny_run, "algorithm=dp"), run_dir=tmp_path)
    try:
        wait_for(lambda: len(h.metrics("merge")) >= 20)
        h.kill_learner(1)
        killed = h.metrics("fault")[-1]["time"]
        back = wait_for(lambda: restart_of(h, 1, killed))[0]["time"]
        wait_for(lambda: [e for e in h.metrics("merge") if e["time"] > back and e["contributors"] == [0, 1]])
        # nothing merged while learner 1 was down (a step already in flight at the kill may close)
        during = [e for e in h.metrics("merge") if killed + 0.5 < e["time"] < back]
        assert during == []
        assert back - killed > 1.0  # a real restart: new process, JAX import, blueprint
        # every merge, before and after, holds both learners' gradients
        assert all(e["contributors"] == [0, 1] for e in h.metrics("merge"))
        gap = metrics.longest_commit_gaps(h.metrics("merge"), killed, back, n=1)[0]
        assert gap >= 0.8 * (back - killed)
    finally:
        h.stop()


def test_elastic_dp_continues_without_the_dead_learner_and_takes_it_back(ray_cluster, tiny_run, tmp_path):
    from actors.launch import start

    h = start(dp_run(tiny_run, "algorithm=elastic_dp", "syncer.elastic_timeout_s=1.0"), run_dir=tmp_path)
    try:
        wait_for(lambda: len(h.metrics("merge")) >= 20)
        h.kill_learner(1)
        killed = h.metrics("fault")[-1]["time"]
        back = wait_for(lambda: restart_of(h, 1, killed))[0]["time"]
        alone = [e for e in h.metrics("merge") if killed < e["time"] < back and e["contributors"] == [0]]
        assert alone, "learner 0 kept training alone while learner 1 restarted"
        assert alone[0]["dropped"] == [1]
        pause = alone[0]["time"] - max(e["time"] for e in h.metrics("merge") if e["time"] <= killed)
        assert 0.9 <= pause < back - killed  # the reconfiguration pause: the timeout, not the restart
        wait_for(lambda: [e for e in h.metrics("merge") if e["time"] > back and e["contributors"] == [0, 1]])
    finally:
        h.stop()


def no_learner_training(events, learners: int, end: float) -> list[tuple[float, float]]:
    """Stretches in which no learner was training: a learner counts as training from the first merge
    that holds a push of it (of each incarnation) until it is killed."""
    merges = sorted((e["time"], e["contributors"]) for e in events if e["event"] == "merge")
    down = {m: [(0.0, next((t for t, c in merges if m in c), end))] for m in range(learners)}
    for d in metrics.downtimes(events):
        down[d["learner"]].append((d["killed"], d["merged_again"] or end))
    edges = sorted({x for ivs in down.values() for iv in ivs for x in iv})
    out = []
    for a, b in zip(edges, edges[1:], strict=False):
        if all(any(lo <= a and b <= hi for lo, hi in down[m]) for m in down):
            out.append((a, b))
    return out


def test_seeded_schedule_is_carried_out_logged_and_k1_keeps_advancing(ray_cluster, tiny_run, tmp_path):
    from actors.launch import start

    chaos_set = ("chaos.seed=2", "chaos.mtbf_s=12", "chaos.warmup_s=2", "chaos.payload_loss=0.05")
    cfg = config.load(
        overrides=(*tiny_run, *RUN, "learners.count=3", "syncer.quorum=1", "budget.seconds=20", *chaos_set)
    )
    schedule = chaos.schedule(cfg.chaos, 3)
    assert [f.kind for f in schedule[:3]] == ["kill"] * 3
    h = start(cfg, run_dir=tmp_path)
    result = h.wait(timeout=200)
    h.stop()
    assert result is not None
    summary = result.metrics
    events = h.metrics()
    # the schedule's clock starts when every learner has registered once (`actors.faults`)
    firsts: dict[int, float] = {}
    for e in events:
        if e["event"] in ("learner_start", "learner_restart"):
            firsts.setdefault(e["learner"], e["t"])
    assert sorted(firsts) == [0, 1, 2]
    up, begun = max(firsts.values()), min(firsts.values())
    # budget.seconds counts from the first registration: the run trained its 20 s, whatever the
    # start-up took (reported as startup_s, from the `start` call)
    assert summary["wall_time_s"] >= begun + 20 and summary["startup_s"] >= begun
    # every fault the schedule places before 18 s of training is logged, in order, at its time (to
    # within the injector's latency: the driver shares 2 cores with 3 learners, the store and the
    # syncer; 2.3 s late was seen in CI); a run starved of CPU may overrun its 20 s budget and carry
    # out later ones too
    logged = faults = [e for e in events if e["event"] == "fault"]
    assert [(f["target"], f["kind"], f["at"]) for f in faults] == [(f.target, f.kind, f.at) for f in schedule][
        : len(faults)
    ]
    assert len(faults) >= len([f for f in schedule if up + f.at < begun + 18]) >= 1
    for f in faults:
        assert f["t"] == pytest.approx(up + f["at"], abs=3.0)
    carried = [f for f in logged if not f.get("skipped")]
    assert summary["faults"] == len(carried) and summary["faults_skipped"] == len(logged) - len(carried)
    downs = metrics.downtimes(events)
    assert len(downs) == len(carried)
    assert all(d["downtime_s"] is None or d["downtime_s"] > 0.5 for d in downs)
    # every kill the learner came back from is a restart, one killed during its start-up included
    assert summary["restarts"] == len([d for d in downs if d["back"] is not None])
    assert summary["error"] is None and summary["auth_mode"] == "disabled"  # the session's choice
    assert any(e["event"] == "payload_lost" for e in events)
    # K = 1: while any learner was training, the merges kept every fragment advancing. On 2 starved
    # cores all three can be down at once (killed, or restarted and not yet merged): only then may a
    # fragment wait longer than 5 s
    first = min(e["time"] for e in events if e["event"] == "merge")
    end = max(e["time"] for e in events)
    commits = metrics.commit_times(events)
    idle = no_learner_training(events, 3, end)
    for p in range(cfg.fragments.count):
        for i in range(int((end - first) / 0.05)):
            t = first + 0.05 * i
            since = max([c for c in commits.get(p, []) if c <= t] + [b for a, b in idle if b <= t] + [first])
            assert t - since <= 5.0 or any(a <= t < b for a, b in idle), (p, t, since)
    # and inside each down window that holds 3 s or more of another learner training, i.e. several
    # of its rounds (once the run is merging at all: on a starved machine a kill can land while the
    # others still compile, and with kills every few seconds all three can be down or restarting at
    # once: that time is no learner's)
    for d in downs:
        if d["back"] is None or d["killed"] <= first:
            continue
        lo, hi = d["killed"], d["back"]
        live = (hi - lo) - sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in idle)
        if live >= 3.0:
            assert [e for e in events if e["event"] == "merge" and lo < e["time"] < hi], (d, live)
    assert 0 < summary["goodput"] < 1
    lt = summary["learner_time"]
    assert summary["goodput"] == pytest.approx(
        sum(v["merged"] for v in lt.values()) / sum(v["provisioned"] for v in lt.values())
    )
