"""The benchmark scripts run end to end and write their JSON (values are checked, not timings).

Each script runs in its own interpreter (it starts and stops its own local Ray cluster), so this
module never shares a Ray session with the other tests.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(400)]


def run_script(script: str, *args: str) -> None:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("XLA_FLAGS", None)  # conftest's two virtual devices are for in-process tests only
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=380,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def report_section(name: str, doc: dict) -> str:
    """docs/RESULTS.md's section from one benchmark's JSON (`benchmarks/report.py`)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import report
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return "\n".join(getattr(report, name)(doc))


def test_learner_overhead_quick_writes_positive_numbers(tmp_path):
    out = tmp_path / "x.json"
    run_script("learner_overhead.py", "--quick", "--reps", "1", "--steps", "40", "--out", str(out))
    d = json.loads(out.read_text())
    assert {"overhead", "rejoin", "config", "machine", "versions", "table"} <= set(d)
    ov, rj = d["overhead"], d["rejoin"]
    for key in ("bare_tokens_per_s", "actor_tokens_per_s", "ratio", "paired_ratio_median"):
        assert ov[key] > 0, key
    for run in ov["runs"]:
        for kind in ("bare", "actor"):
            assert sum(c["steps"] for c in run[kind]["chunks"]) == ov["steps"]
        # both did the same work: the same steps and the same pushes
        assert run["bare"]["pushes"] == run["actor"]["pushes"] > 0
    assert len(rj["rejoins"]) == 1
    row = rj["rejoins"][0]
    assert row["incarnation"] == 2
    assert 0 < row["kill_to_restart_s"] < row["kill_to_first_merge_s"]
    assert rj["kill_to_restart_s_median"] > 0 and rj["kill_to_first_merge_s_median"] > 0
    assert isinstance(rj["compilation_cache"]["restarts_compiled_from_cache"], bool)
    spare = d["rejoin_spares"]["rejoins"]  # the same kill, taken over by a warm spare
    assert [r["incarnation"] for r in spare] == [2] and 0 < spare[0]["kill_to_restart_s"] < spare[0][
        "kill_to_first_merge_s"
    ]
    assert d["machine"]["cpus"] >= 1 and d["versions"]["jax"] and d["versions"]["ray"]
    text = report_section("overhead_section", d)
    assert f"| {ov['ratio']:.3f} | {ov['paired_ratio_median']:.3f} |" in text and d["command"] in text
    assert f"| warm spare | 1 | {spare[0]['kill_to_restart_s']:.2f} | {spare[0]['kill_to_first_merge_s']:.2f} |" in text


def test_merge_throughput_writes_positive_rates(tmp_path):
    out = tmp_path / "m.json"
    run_script("merge_throughput.py", "--params", "2e6", "--repeat", "1", "--out", str(out))
    d = json.loads(out.read_text())
    assert d["params"] == 2_000_000 and d["results"]
    for r in d["results"]:
        assert r["seconds"] > 0 and r["gbps_params"] > 0, r["operation"]


def test_goodput_benchmark_replays_one_schedule_against_each_algorithm(tmp_path):
    out = tmp_path / "g.json"
    run_script(
        "goodput.py",
        # kills 5.4 s and 6.5 s after both learners are up (`actors.faults`): inside the 16 s of
        # training (budget.seconds counts from the first registration, however long the start took)
        *("--learners", "2", "--seconds", "16", "--mtbf", "8", "--warmup", "0"),
        *("--algorithms", "dp,decoupled", "--no-reference", "--out", str(out)),
    )
    d = json.loads(out.read_text())
    assert [r["run"] for r in d["rows"]] == ["dp", "decoupled"]
    scheduled = [(f["target"], f["at"]) for f in d["schedule"]]
    assert scheduled, "the seeded schedule holds kills within the run window"
    for run in d["runs"]:
        with open(Path(run["run_dir"]) / "metrics.jsonl") as f:
            faults = [json.loads(x) for x in f if '"fault"' in x]
        # the same schedule, fault by fault, replayed against both algorithms (a run that a loaded
        # machine stretches past its window carries out more of the same seeded schedule)
        replayed = [(e["target"], e["at"]) for e in faults if e["event"] == "fault"]
        n = min(len(replayed), len(scheduled))
        assert replayed[:n] == scheduled[:n] and replayed
    for r in d["rows"]:
        assert 0 < r["goodput"] <= 1 and 0 <= r["uptime"] <= 1 and r["tokens_trained"] > 0
        assert r["simulated_goodput"] is None or 0 < r["simulated_goodput"] <= 1
    assert Path(out.with_suffix(".png")).stat().st_size > 10_000
    text = report_section("goodput_section", d)
    assert all(f"| {r['run']} | {r['goodput']:.3f} | — |" in text for r in d["rows"])  # no reference run


def test_quality_tiny_sweeps_then_runs_the_winners_at_equal_tokens(tmp_path):
    out = tmp_path / "quality.json"
    run_script("quality.py", "--tiny", "--out", str(out))
    doc = json.loads(out.read_text())
    runs = doc["results"]
    sweep = [r for r in runs if r["group"] == "sweep"]
    # the same number of grid points for every tuned algorithm, all at equal tokens
    per_family = {f: sum(r["family"] == f for r in sweep) for f in {r["family"] for r in sweep}}
    assert per_family == {"dp": 2, "diloco": 1, "streaming": 1, "decoupled/delayed": 1, "decoupled/plain": 1}
    assert all(r["grid"] for r in sweep)  # tiny mode runs no outer-optimizer study
    assert len({r["tokens"] for r in runs if r["M"] == 4}) == 1
    assert all(3.0 < r["eval_loss"] < 5.6 for r in runs)  # trained below ln(256) = 5.55
    # each final row repeats its family's best sweep setting at another seed
    for r in (r for r in runs if r["group"] == "final"):
        fam = [
            s for s in sweep if s["algorithm"] == r["algorithm"] and sorted(s["overrides"]) == sorted(r["overrides"])
        ]
        assert len(fam) == 1 and r["seed"] == 1
        same = [s for s in sweep if s.get("family") == fam[0]["family"]]
        if r["label"] != "decoupled (tuned)":
            assert fam[0]["eval_loss"] == min(s["eval_loss"] for s in same)
    dec = next(r for r in runs if r["label"] == "decoupled (tuned)")
    assert sum(o.startswith("outer.delay=") for o in dec["overrides"]) == 1
    m1 = next(r for r in runs if r["group"] == "m1")
    dp_best = min((r for r in sweep if r["family"] == "dp"), key=lambda r: r["eval_loss"])
    assert m1["tokens"] == dp_best["tokens"] and set(dp_best["overrides"]) <= set(m1["overrides"])
    int2 = next(r for r in runs if r["label"] == "int2")
    assert (
        int2["bytes_up"] * 1.8
        < next(r for r in runs if r["group"] == "final" and r is not int2 and r["label"] == "decoupled (tuned)")[
            "bytes_up"
        ]
    )
    assert out.with_suffix(".png").stat().st_size > 1000

    # a partial rerun replaces only its rows, deterministically
    run_script("quality.py", "--tiny", "--only", "compression", "--out", str(out))
    again = json.loads(out.read_text())
    assert [(r["group"], r["label"]) for r in again["results"]] == [(r["group"], r["label"]) for r in runs]
    assert [r["eval_loss"] for r in again["results"]] == [r["eval_loss"] for r in runs]  # deterministic
    assert len(again["commands"]) == 2 and "--only compression" in again["commands"][1]

    # docs/RESULTS.md generated from it: the computed gaps, every row's config hash, the figure
    md = tmp_path / "docs" / "RESULTS.md"
    run_script("report.py", "--results", str(tmp_path), "--out", str(md))
    text = md.read_text()
    dp = [r["eval_loss"] for r in runs if r["label"] == "dp (tuned)"] + [dp_best["eval_loss"]]
    de = [r["eval_loss"] for r in runs if r["label"] == "decoupled (tuned)"]
    de += [s["eval_loss"] for s in sweep if sorted(s["overrides"]) == sorted(dec["overrides"])]
    gap = 100 * (sum(de) / 2 - sum(dp) / 2) / (sum(dp) / 2)
    assert f": {gap:+.2f} % | **{'met' if gap <= 4 else 'missed'}** |" in text
    assert all(r["config_hash"] in text for r in runs)
    assert "Not run: `python benchmarks/bandwidth.py`" in text and "Not run: `sudo python benchmarks/wan.py`" in text
    assert (md.parent / "figures" / "quality.png").stat().st_size > 1000


# The quality sweep's rows before Ray Tune ran them: a pool of spawned processes, each row by
# `quality.run_row` (what benchmarks/quality.py did until its rows became Tune trials); one
# process here, as one Tune trial runs both rows below (the second row skips the first's start-up)
POOL = """
import json, multiprocessing as mp, sys
sys.path.insert(0, "benchmarks")
import quality
rows = json.loads(sys.stdin.read())
with mp.get_context("spawn").Pool(1) as pool:
    print(json.dumps(pool.map(quality.run_row, [(r, True) for r in rows])))
"""


@pytest.mark.timeout(300)
def test_quality_rows_through_ray_tune_read_what_the_process_pool_read(tmp_path):
    """Two tiny sweep rows (the decoupled ones: syncer, int4 pushes, outer steps) as Tune trials on
    a local Ray cluster (one CPU: one trial process, reused for the second row) give the same JSON
    rows, bit for bit but the wall time, as the same rows run by the process pool that ran them
    before: the rows are deterministic whoever runs them."""
    out = tmp_path / "quality.json"
    run_script("quality.py", "--tiny", "--only", "sweep/decoupled", "--workers", "1", "--out", str(out))
    via_tune = json.loads(out.read_text())["results"]
    assert [r["label"] for r in via_tune] == ["decoupled/plain, η 1 μ 0", "decoupled/delayed, η 0.5 μ 0.5"]
    given = ("group", "label", "corpus", "M", "algorithm", "overrides", "seed", "family", "grid")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # as in run_script: the conftest's two virtual devices are not the pool's
    pool = subprocess.run(
        [sys.executable, "-c", POOL],
        input=json.dumps([{k: r[k] for k in given} for r in via_tune]),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    by_pool = json.loads(pool.stdout.splitlines()[-1])
    assert [list(r) for r in by_pool] == [list(r) for r in via_tune]  # the same keys, in the same order

    def same(r):
        return {k: v for k, v in r.items() if k != "wall_s"}

    assert [same(r) for r in via_tune] == [same(r) for r in by_pool]
    losses = [r["eval_loss"] for r in via_tune]
    assert losses == [r["eval_loss"] for r in by_pool] and 3.0 < min(losses) < max(losses) < 5.6


def test_syncer_scale_quick_writes_a_row_per_cell_and_its_section(tmp_path):
    out = tmp_path / "syncer_scale.json"
    run_script("syncer_scale.py", "--quick", "--repeat", "1", "--out", str(out))
    d = json.loads(out.read_text())
    cells = [(r["params"], r["shards"], r["learners"], r["shard_params"]) for r in d["rows"]]
    assert cells == [
        (2_000_000, 1, 2, 2_000_000),
        (2_000_000, 1, 4, 2_000_000),
        (2_000_000, 2, 2, 1_000_000),
        (2_000_000, 2, 4, 1_000_000),
    ]
    for r in d["rows"]:
        parts = r["screen_s"] + r["merge_s"] + r["outer_s"] + r["publish_s"] + r["wal_s"]
        assert r["commit_s"] == pytest.approx(parts) and r["commits_per_s"] == pytest.approx(1 / parts)
        assert r["contributions_per_s"] == pytest.approx(r["shards"] * r["learners"] / parts)
        assert r["arith_ratio_to_memcpy"] > 0 and r["rss_syncer_x_model"] > 0 and r["rss_store_x_model"] > 0
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import syncer_scale
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert "| 2 M | 1 | 4 |" in syncer_scale.report(d) and "| 2 M | 2 | 4 |" in syncer_scale.report(d)
