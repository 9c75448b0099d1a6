"""Goodput under chaos: dp, elastic_dp and decoupled replay one seeded fault schedule on real actors.

Every algorithm runs on the same local Ray cluster, the same model, data and learners, for the
same wall time (`--seconds`), under the same `chaos:` section: learner processes really killed
(Ray restarts them; their downtime is what restart + JAX import + compile + rejoin costs here),
at the same seeded times (`dloco.chaos.schedule`). A wall-time budget, not a token budget, so
that each run sees the whole schedule; tokens trained and merged are reported beside it. A
failure-free decoupled run gives the reference eval loss. Each learner process is capped at its
share of the machine's cores (`learners.cpu_limit`, a cgroup), as if it had a host of its own:
otherwise a restarting learner competes with every learner still training (decoupled), or gets
the whole machine while the others wait (dp), and the restart cost measures the test box.

Goodput, uptime, downtime and stalls are computed from each run's events (`dloco.metrics`;
ALGORITHM.md §8); each run's directory keeps its ``metrics.jsonl``, so every number traces back
to events. Beside each goodput: the same relative to the failure-free run (what the faults cost)
and what the simulator `dloco.goodput.simulate_run` predicts for the same schedule with that
run's measured median restart + rejoin time (kill → first merge of the new incarnation).

Usage:  python benchmarks/goodput.py [--quick] [--learners 6] [--seconds 240] [--mtbf 25]
                                     [--algorithms dp,elastic_dp,diloco,streaming,decoupled,decoupled+spares]
                                     [--out PATH]
Writes  benchmarks/results/goodput.json and goodput.png (or --out and its .png)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors import isolation  # noqa: E402
from dloco import chaos, config  # noqa: E402

# The `mini` preset (115k parameters): steps are cheap, so six learners share two cores and the
# run is dominated by what the algorithms do, not by arithmetic.
MODEL = (
    "preset=mini",
    "metrics.eval_every_s=15",
    "metrics.stall_threshold_s=5",
)
# Decoupled: the defaults, K = 1 + grace (the model advances while any learner is up), rebase
# receive (nothing trained is thrown away) and rounds scaled by their share of the live learners'
# weight (`merge.scale_by_share`), so a one-push round does not apply a learner's full progress.
DECOUPLED = ("syncer.quorum=1",)


def run_one(name: str, overrides: list[str], run_dir: Path) -> dict:
    from actors.launch import start

    cfg = config.load(overrides=overrides)
    t0 = time.time()
    h = start(cfg, run_dir=run_dir)
    h.wait()
    summary = h.stop()
    print(f"  {name}: {time.time() - t0:.0f} s", flush=True)
    return {"name": name, "overrides": overrides, "run_dir": str(run_dir), "summary": summary}


def row(r: dict) -> dict:
    s = r["summary"]
    down, rejoin = s["downtime_s"], s["rejoin_s"]
    return {
        "run": r["name"],
        "cpu_limit": r["summary"]["config"]["learners"]["cpu_limit"],
        "goodput": s["goodput"],
        "uptime": s["uptime"],
        "tokens_trained": s["tokens_trained"],
        "tokens_merged": s["tokens_merged"],
        "eval_loss": s["eval_loss_end"],
        "wall_s": s["wall_time_s"],
        "failures": s["faults"],
        "skipped": s["faults_skipped"],
        "restarts": s["restarts"],
        "downtime_median_s": statistics.median(down) if down else None,
        "rejoin_median_s": statistics.median(rejoin) if rejoin else None,
        "longest_stall_s": s["longest_commit_gaps_s"][0] if s["longest_commit_gaps_s"] else None,
        "merges": s["merges"],
        "rejected": s["rejected"],
        "spare_s": s.get("spare_s", 0.0),
    }


def simulated(chaos_cfg: config.ChaosConfig, algorithm: str, learners: int, quorum: int, seconds: float, down: float):
    """`dloco.goodput.simulate_run` on the same schedule; a learner is out for the run's measured
    median kill → first merge of its new incarnation (restart + rejoin, ALGORITHM.md §10)."""
    from dloco import goodput

    pause = config.SyncerConfig().elastic_timeout_s if algorithm == "elastic_dp" else 0.0
    return goodput.simulate_run(chaos_cfg, algorithm, learners, quorum, seconds, down, pause_s=pause).goodput


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["name"] for r in results]
    a.bar(names, [r["summary"]["goodput"] for r in results], color="tab:blue")
    a.set_ylabel("goodput (ALGORITHM.md §8)")
    a.set_ylim(0, 1)
    a.tick_params(axis="x", rotation=20)
    for r in results:
        with open(Path(r["run_dir"]) / "metrics.jsonl") as f:
            events = [json.loads(x) for x in f]
        evals = [e for e in events if e["event"] == "eval"]
        line = b.plot([e["t"] for e in evals], [e["loss"] for e in evals], marker=".", label=r["name"])[0]
        for e in events:
            if e["event"] == "fault" and not e.get("skipped"):
                b.axvline(e["t"], color=line.get_color(), alpha=0.25, lw=0.8)
    b.set_xlabel("wall seconds (thin lines: learner kills, in the run's colour)")
    b.set_ylabel("eval loss")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="shorter runs (about 10 minutes in all on 2 cores)")
    ap.add_argument("--learners", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=240.0, help="wall-time budget of every run")
    ap.add_argument("--mtbf", type=float, default=20.0, help="per-learner mean time between kills (s)")
    ap.add_argument(
        "--warmup", type=float, default=15.0, help="no fault before this many seconds after every learner is up"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--algorithms", default="dp,elastic_dp,decoupled,decoupled+spares")
    ap.add_argument("--no-reference", action="store_true", help="skip the failure-free decoupled run")
    ap.add_argument(
        "--cpu-limit",
        type=float,
        default=None,
        help="cores per learner process (learners.cpu_limit; default: this machine's cores / learners "
        "where cgroups allow, so a restart costs what it would on a learner's own host; 0: no cap)",
    )
    ap.add_argument("--out", default="benchmarks/results/goodput.json")
    args = ap.parse_args()
    if args.quick:
        args.seconds = min(args.seconds, 120.0)
    M = args.learners
    if args.cpu_limit is None:
        try:
            isolation_ok = bool(isolation.cgroup_root())
        except RuntimeError:
            isolation_ok = False
        args.cpu_limit = round((os.cpu_count() or 1) / M, 3) if isolation_ok else 0.0
    chaos_set = [f"chaos.seed={args.seed}", f"chaos.mtbf_s={args.mtbf}", f"chaos.warmup_s={args.warmup}"]
    common = [
        *MODEL,
        f"learners.count={M}",
        f"learners.num_cpus={2.0 / M}",
        f"learners.cpu_limit={args.cpu_limit}",
        f"data.shards={max(64, M)}",
        "budget.tokens=0",
        f"budget.seconds={args.seconds}",
    ]
    per_algo = {
        "dp": ["algorithm=dp"],
        "elastic_dp": ["algorithm=elastic_dp"],
        "diloco": ["algorithm=diloco"],
        "streaming": ["algorithm=streaming"],
        "decoupled": ["algorithm=decoupled", *DECOUPLED],
        # two warm spare processes take over killed learners (`actors.spares`); their idle time is
        # provisioned learner time in the goodput (an idle spare is a host paid for)
        "decoupled+spares": ["algorithm=decoupled", *DECOUPLED, "learners.spares=2"],
    }
    algos = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    cfg_chaos = config.load(overrides=chaos_set).chaos
    schedule = chaos.schedule(cfg_chaos, M)
    in_run = [f for f in schedule if f.at < args.seconds]
    print(
        f"{M} learners ({args.cpu_limit or 'uncapped'} cores each), {args.seconds:.0f} s per run, "
        f"per-learner MTBF {args.mtbf:.0f} s (seed {args.seed}): "
        f"{len(in_run)} kills scheduled in the run window, "
        f"{chaos.expected_failures(cfg_chaos, M, args.seconds):.1f} expected",
        flush=True,
    )

    from actors.launch import connect

    owns = connect(None, num_cpus=4)
    root = Path(tempfile.mkdtemp(prefix="dloco-goodput-"))
    results = []
    try:
        for a in algos:
            results.append(run_one(a, [*common, *per_algo[a], *chaos_set], root / a))
        if not args.no_reference and "decoupled" in algos:
            results.append(run_one("decoupled, no faults", [*common, *per_algo["decoupled"]], root / "reference"))
    finally:
        if owns:
            import ray

            ray.shutdown()

    rows = [row(r) for r in results]
    ref = next((r for r in rows if r["run"] == "decoupled, no faults"), None)
    for r, res in zip(rows, results, strict=True):
        r["eval_loss_vs_reference"] = r["eval_loss"] / ref["eval_loss"] - 1 if ref else None
        # what the faults cost: goodput relative to the failure-free run (startup, tail and merge
        # losses divided out), beside the simulator's prediction for the same schedule
        r["goodput_vs_reference"] = r["goodput"] / ref["goodput"] if ref else None
        algo = res["summary"]["algorithm"]
        quorum = 1 if algo == "decoupled" else M
        faulty = r["run"] != "decoupled, no faults" and r["rejoin_median_s"]
        r["simulated_goodput"] = (
            simulated(cfg_chaos, algo, M, quorum, args.seconds, r["rejoin_median_s"]) if faulty else None
        )

    def num(fmt):
        return lambda v: "" if v is None else format(v, fmt)

    cols = [
        ("run", "run", str),
        ("goodput", "goodput", num(".3f")),
        ("÷ no-fault run", "goodput_vs_reference", num(".3f")),
        ("simulated", "simulated_goodput", num(".3f")),
        ("uptime", "uptime", num(".3f")),
        ("tokens trained", "tokens_trained", num(",")),
        ("tokens merged", "tokens_merged", num(",.0f")),
        ("eval loss", "eval_loss", num(".3f")),
        ("vs ref", "eval_loss_vs_reference", lambda v: "" if v is None else f"{100 * v:+.1f}%"),
        ("wall s", "wall_s", num(".0f")),
        ("kills", "failures", num("d")),
        ("restarts", "restarts", num("d")),
        ("restart s", "downtime_median_s", num(".1f")),
        ("rejoin s", "rejoin_median_s", num(".1f")),
        ("longest stall s", "longest_stall_s", num(".1f")),
    ]
    cells = [[f(r[key]) for _, key, f in cols] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (h, _, _) in enumerate(cols)]
    lines = [" | ".join(h.rjust(w) for (h, _, _), w in zip(cols, widths, strict=True))]
    lines += [" | ".join(c.rjust(w) for c, w in zip(cr, widths, strict=True)) for cr in cells]
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    png = out.with_suffix(".png")
    plot(results, png)
    import jax
    import ray

    out.write_text(
        json.dumps(
            {
                "command": " ".join(["python", "benchmarks/goodput.py", *sys.argv[1:]]),
                "learners": M,
                "seconds": args.seconds,
                "chaos": cfg_chaos.__dict__ | {"syncer_kills_s": [], "store_kills_s": []},
                "schedule": [f.to_event() for f in in_run],
                "rows": rows,
                "runs": results,
                "table": table,
                "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
                "versions": {"jax": jax.__version__, "ray": ray.__version__},
            },
            indent=2,
            default=str,
        )
    )
    print(f"wrote {out} and {png} (run dirs under {root})")


if __name__ == "__main__":
    main()
