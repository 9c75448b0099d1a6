"""Chaos soak: long runs on a real local Ray cluster under every fault at once, then checks that
gate a release.

Each algorithm (decoupled, then dp) trains for its share of `--minutes` on the `micro` model with
4 learners, each capped at its share of the machine's cores (`learners.cpu_limit`), under one
seeded chaos schedule: learner processes killed (per-learner MTBF chosen so that each run sees at
least 20 kills), freezes, 2 % of pushes lost on the wire, and the syncer and the store killed 3
times each, at fixed fractions of the run. Ray restarts every killed actor; the run must carry on
and end by itself at its wall-time budget.

Checked after each run (any failing check makes the script exit 1):

- faults: at least 20 learner kills (scaled down with `--quick`), 3 syncer and 3 store kills
  carried out;
- ended by itself: the run reached its budget with no fatal error;
- versions: per fragment, the merges the driver saw commit versions v, v + 1, ... in order (none
  twice, none skipped across a restart), every store restart restored at least the newest
  version merged before it (versions lost: 0), and the final store holds the newest version merged;
- on disk: every commit-log and snapshot file verifies (checksum) and holds finite values only,
  nothing was quarantined;
- NaN: every evaluation finite, the final global model finite;
- ledger: per learner, the tokens the store's ledger says were merged (averaged over fragments)
  are at least what the driver's merge events show (events of a killed syncer since its last drain
  are lost with it); per learner and fragment, read back from disk, they are at most `high` (the
  highest step merged) × the learner's tokens per step: each step counted once, retrained ones
  included. (Tokens trained as the driver saw them are reported beside it, not compared: the
  driver polls learner status, so a killed incarnation's last steps may be merged but never seen.)
- restarts: after each kill of the store or the syncer, the run commits again within 15 s (each
  restart's time to serving and to that commit is in the table);
- K = 1 (decoupled): uptime 1.0, the model never stalled;
- memory: resident set of the driver, the store and the syncer after warm-up versus at the end,
  flat within 10 % (a restarted store or syncer is a new process: each is measured over its own
  life, and the table shows the longest-lived one).

Usage:  python benchmarks/soak.py [--minutes 30] [--quick] [--algorithms decoupled,dp] [--out PATH]
Writes  benchmarks/results/soak.json (with --quick: soak-quick.json); run dirs in a temp dir. The quick
        runs RESULTS.md shows are benchmarks/results/soak-quick/NAME.json (written with --out).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from dloco import build, chaos, config, durable  # noqa: E402

LEARNERS = 4
MIN_KILLS, SYNCER_KILLS, STORE_KILLS = 20, (0.2, 0.45, 0.7), (0.3, 0.55, 0.8)  # kills at fractions of the run
WARMUP_S = 30.0
RSS_LIMIT = 0.10
RESTART_LIMIT_S = 15.0  # a killed store or syncer: kill → the run's next commit


def overrides(algorithm: str, seconds: float, seed: int, cpu_limit: float) -> list[str]:
    """The run: micro model, 4 capped learners, every fault; per-learner MTBF so that the schedule
    averages 30 % more than MIN_KILLS (scaled) kills in the run."""
    kills = max(3, round(MIN_KILLS * seconds / 900.0 * 1.3))
    mtbf = LEARNERS * (seconds - WARMUP_S) / kills
    return [
        "preset=micro",
        f"algorithm={algorithm}",
        *(["syncer.quorum=1"] if algorithm == "decoupled" else []),
        f"learners.count={LEARNERS}",
        f"learners.num_cpus={2.0 / LEARNERS}",
        f"learners.cpu_limit={cpu_limit}",
        "data.shards=64",
        "budget.tokens=0",
        f"budget.seconds={seconds}",
        "metrics.eval_every_s=30",
        "metrics.stall_threshold_s=30",
        f"chaos.seed={seed}",
        f"chaos.mtbf_s={mtbf:.1f}",
        f"chaos.warmup_s={WARMUP_S}",
        "chaos.freeze_mtbf_s=240",
        "chaos.freeze_s=5",
        "chaos.payload_loss=0.02",
        f"chaos.syncer_kills_s=[{','.join(f'{f * seconds:.0f}' for f in SYNCER_KILLS)}]",
        f"chaos.store_kills_s=[{','.join(f'{f * seconds:.0f}' for f in STORE_KILLS)}]",
    ]


class MemorySampler:
    """Samples the resident set of the driver, the store and the syncer every `every` seconds."""

    def __init__(self, handle, every: float = 10.0) -> None:
        from actors.health import process_memory

        self.h, self.every, self.own = handle, every, process_memory
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import ray

        t0 = time.time()
        while not self._stop.wait(self.every):
            row = {"t": time.time() - t0, "driver": self.own()}
            for name in ("store", "syncer"):
                try:
                    row[name] = ray.get(getattr(self.h, name).memory.remote(), timeout=5.0)
                except Exception:  # restarting, or busy past 5 s: no sample this time
                    row[name] = None
            self.samples.append(row)

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join()
        return self.samples


def rss_growth(samples: list[dict], name: str, warmup: float, settle: float = 30.0) -> dict:
    """Resident-set growth of each process that served as `name` (a restarted store or syncer is a
    new one): median over its first 10 % of samples after warm-up (`warmup`, or `settle` seconds
    after it started) versus over its last 10 %. Reports the longest-lived process and the largest growth."""
    by_pid: dict[int, list[tuple[float, int]]] = {}
    for s in samples:
        if s.get(name):
            by_pid.setdefault(s[name]["pid"], []).append((s["t"], s[name]["rss_bytes"]))
    grown = []
    for rows in by_pid.values():
        after = [x for t, x in rows if t >= max(warmup, rows[0][0] + settle)]
        if len(after) >= 3:
            n = max(1, len(after) // 10)
            start, end = statistics.median(after[:n]), statistics.median(after[-n:])
            grown.append((len(after), start, end, end / start - 1))
    if not grown:
        return {"start_mb": None, "end_mb": None, "growth": None, "max_growth": None, "pids": len(by_pid)}
    _, start, end, growth = max(grown)
    return {
        "start_mb": start / 2**20,
        "end_mb": end / 2**20,
        "growth": growth,
        "max_growth": max(g for *_, g in grown),
        "pids": len(by_pid),
    }


def versions_check(events: list[dict], final: list[int]) -> dict:
    """Merges per fragment in commit order: v, v + 1, ...; store restarts restore at least the
    newest version merged before them; the final store holds the newest merged."""
    problems, lost, newest = [], 0, {}
    for e in sorted(events, key=lambda e: e["time"]):
        if e["event"] == "merge":
            p, v = int(e["fragment"]), int(e["version"])
            prev = newest.get(p)
            if prev is not None and v <= prev:
                problems.append(f"fragment {p}: version {v} merged after {prev}")
            newest[p] = max(v, prev or 0)
        elif e["event"] == "store_start" and newest:
            for p, v in enumerate(e["versions"]):
                if v < newest.get(p, 0):
                    lost += newest[p] - v
                    problems.append(f"fragment {p}: store restored v{v} after v{newest[p]} was merged")
    for p, v in newest.items():
        if final[p] < v:
            lost += v - final[p]
            problems.append(f"fragment {p}: the store ends at v{final[p]}, v{v} was merged")
    return {"lost": lost, "problems": problems[:10], "merged_versions": [newest.get(p, 0) for p in range(len(final))]}


def disk_check(store_dir: Path) -> dict:
    """Every commit-log and snapshot file verifies and holds finite values; nothing quarantined."""
    files, bad, nonfinite = 0, [], []
    for path in sorted(store_dir.glob("wal/*.npz")) + sorted(store_dir.glob("snap-*/*.npz")):
        files += 1
        try:
            arrays, _ = durable.read_arrays(path)
        except durable.CorruptFileError as e:
            bad.append(f"{path.name}: {e}")
            continue
        if not all(bool(np.isfinite(a).all()) for a in arrays.values()):
            nonfinite.append(str(path.relative_to(store_dir)))
    quarantined = (
        sorted(p.name for p in (store_dir / "quarantine").glob("*")) if (store_dir / "quarantine").exists() else []
    )
    return {"files": files, "corrupt": bad, "nonfinite": nonfinite, "quarantined": quarantined}


def ledger_entries(cfg, store_dir: Path) -> dict[tuple[int, int], dict]:
    """(learner, fragment) → its ledger entry, from the store directory as a restarting store reads it."""
    from dloco.store import StoreCore

    bp = build.blueprint(cfg)
    core = StoreCore(store_dir, list(bp.initial), build.initial_outer(cfg, bp), lock_wait_s=30.0)
    try:
        return {(m, p): dict(e) for p in range(bp.plan.count) for m, e in core.last_merged(p).items()}
    finally:
        core.close()


def restart_times(events: list[dict]) -> list[dict]:
    """Per scheduled kill of the store or the syncer: seconds from the kill to the restarted
    process's `store_start` / `syncer_start` (serving) and to the run's first merge after that
    (the first commit the restarted process took part in; a merge event between the kill and the
    restart is a commit acknowledged before the kill). None: it did not come before the run ended.
    Times are the events' run clock."""
    starts = {"store": "store_start", "syncer": "syncer_start"}
    out = []
    for f in events:
        if f["event"] != "fault" or f.get("skipped") or f["target"] not in starts:
            continue
        began = [e for e in events if e["event"] == starts[f["target"]] and e["t"] > f["t"]]
        started = [e["t"] for e in began]
        merged = [e["t"] for e in events if e["event"] == "merge" and started and e["t"] >= min(started)]
        out.append(
            {
                "target": f["target"],
                "killed_at": round(f["t"], 1),
                "serving_s": round(min(started) - f["t"], 1) if started else None,
                "first_commit_s": round(min(merged) - f["t"], 1) if merged else None,
                # the restarted process's own account: Ray's restart and imports ("process"), the model, ...
                "startup_s": min(began, key=lambda e: e["t"]).get("startup_s") if began else None,
            }
        )
    return out


def run_one(algorithm: str, seconds: float, seed: int, cpu_limit: float, run_dir: Path) -> dict:
    import ray

    from actors.launch import start

    cfg = config.load(overrides=overrides(algorithm, seconds, seed, cpu_limit))
    schedule = [f for f in chaos.schedule(cfg.chaos, LEARNERS) if f.at < seconds]
    t0 = time.time()
    h = start(cfg, run_dir=run_dir)
    quick = seconds < 900
    sampler = MemorySampler(h, every=5.0 if quick else 10.0)
    result = h.wait(timeout=seconds + 600)
    ended_by_itself = result is not None and h.status()["done"]
    try:
        store = ray.get(h.store.summary.remote(), timeout=120)
        _, frs = ray.get(h.store.fragments.remote(), timeout=120)
        model_finite = all(bool(np.isfinite(x).all()) for fr in frs for x in fr.values())
    except ray.exceptions.RayError as e:
        store, model_finite = {"versions": None, "error": str(e)}, False
    samples = sampler.stop()
    trained: dict[int, int] = {}
    for (m, _), tokens in dict(h.trained).items():
        trained[m] = trained.get(m, 0) + tokens
    h.stop()
    wall = time.time() - t0
    summary = result.metrics if result is not None else {}
    events = h.metrics()
    faults = [e for e in events if e["event"] == "fault" and not e.get("skipped")]
    count = {
        "learner_kills": sum(e["kind"] == "kill" and e["target"].startswith("learner-") for e in faults),
        "freezes": sum(e["kind"] == "freeze" for e in faults),
        "syncer_kills": sum(e["target"] == "syncer" for e in faults),
        "store_kills": sum(e["target"] == "store" for e in faults),
        "payloads_lost": sum(e["event"] == "payload_lost" for e in events),
        "skipped": sum(e["event"] == "fault" and bool(e.get("skipped")) for e in events),
    }
    final = store.get("versions") or [0] * cfg.fragments.count
    versions = versions_check(events, final)
    disk = disk_check(run_dir / "store")
    evals = [e["loss"] for e in events if e["event"] == "eval"]
    P = cfg.fragments.count
    ledger = {int(m): sum(v) / P for m, v in (store.get("tokens_merged") or {}).items()}
    driver = {int(m): v["merged_tokens"] for m, v in (summary.get("learner_time") or {}).items()}
    entries = ledger_entries(cfg, run_dir / "store")
    once = [
        e["tokens"] <= int(e.get("high", e["step"])) * build.learner_batch_size(cfg, m) * cfg.data.seq_len
        for (m, _), e in entries.items()
    ]
    ledger_ok = bool(ledger) and all(once) and all(driver.get(m, 0.0) <= ledger[m] * (1 + 1e-9) + 1 for m in ledger)
    settle = 10.0 if quick else 30.0  # a --quick run kills its store and syncer every 20 s or so
    rss = {name: rss_growth(samples, name, WARMUP_S + settle, settle) for name in ("driver", "store", "syncer")}
    # a 15-minute run must see MIN_KILLS; a shorter (--quick) one at least half its share of them
    need = MIN_KILLS if not quick else max(1, math.floor(MIN_KILLS * seconds / 900 / 2))
    checks = {
        "learner kills": count["learner_kills"] >= need,
        "syncer kills": count["syncer_kills"] >= len(SYNCER_KILLS),
        "store kills": count["store_kills"] >= len(STORE_KILLS),
        "ended by itself": ended_by_itself and summary.get("error") is None,
        "versions monotone, none lost": versions["lost"] == 0 and not versions["problems"],
        "files verify, none quarantined": not disk["corrupt"] and not disk["quarantined"],
        "0 NaN": model_finite and all(math.isfinite(x) for x in evals) and not disk["nonfinite"],
        "ledger consistent": ledger_ok,
        "RSS flat": all(r["max_growth"] is not None and r["max_growth"] <= RSS_LIMIT for r in rss.values()),
    }
    restarts = restart_times(events)
    checks[f"store and syncer restart → first commit ≤ {RESTART_LIMIT_S:g} s"] = bool(restarts) and all(
        r["first_commit_s"] is not None and r["first_commit_s"] <= RESTART_LIMIT_S for r in restarts
    )
    if algorithm == "decoupled":
        checks["uptime 1.0 (K = 1)"] = summary.get("uptime") == 1.0
    du = subprocess.run(["du", "-sb", str(run_dir)], capture_output=True, text=True, check=False).stdout.split()
    return {
        "algorithm": algorithm,
        "seconds": seconds,
        "wall_s": wall,
        "overrides": overrides(algorithm, seconds, seed, cpu_limit),
        "scheduled": len(schedule),
        "faults": count,
        "versions": versions,
        "final_versions": final,
        "disk": {**disk, "bytes": int(du[0]) if du else None},
        "evals": evals,
        "eval_loss_start": summary.get("eval_loss_start"),
        "eval_loss_end": summary.get("eval_loss_end"),
        "uptime": summary.get("uptime"),
        "goodput": summary.get("goodput"),
        "merges": summary.get("merges"),
        "rejected": summary.get("rejected"),
        "restarts": summary.get("restarts"),
        "errors": summary.get("errors"),
        "error": summary.get("error"),
        "ledger": {
            "store": ledger,
            "driver": driver,
            "trained_seen": trained,
            "entries": {f"{m}/{p}": e for (m, p), e in entries.items()},
        },
        "copies": store.get("copies"),
        "restart_times": restarts,
        "rss": rss,
        "memory_samples": samples,
        "checks": checks,
        "passed": all(checks.values()),
        "run_dir": str(run_dir),
    }


def table(rows: list[dict]) -> str:
    def mb(r, name):
        g = r["rss"][name]
        return "-" if g["growth"] is None else f"{g['start_mb']:.0f}→{g['end_mb']:.0f} ({100 * g['growth']:+.0f} %)"

    cols = [
        ("algorithm", lambda r: r["algorithm"]),
        ("minutes", lambda r: f"{r['seconds'] / 60:g}"),
        ("learner kills", lambda r: str(r["faults"]["learner_kills"])),
        ("syncer kills", lambda r: str(r["faults"]["syncer_kills"])),
        ("store kills", lambda r: str(r["faults"]["store_kills"])),
        ("freezes", lambda r: str(r["faults"]["freezes"])),
        ("pushes lost", lambda r: str(r["faults"]["payloads_lost"])),
        ("merges", lambda r: str(r["merges"])),
        ("versions lost", lambda r: str(r["versions"]["lost"])),
        ("NaN", lambda r: "0" if r["checks"]["0 NaN"] else "yes"),
        ("uptime", lambda r: "-" if r["uptime"] is None else f"{r['uptime']:.3f}"),
        ("eval loss", lambda r: f"{r['eval_loss_start'] or math.nan:.3f}→{r['eval_loss_end'] or math.nan:.3f}"),
        ("driver MB", lambda r: mb(r, "driver")),
        ("store MB", lambda r: mb(r, "store")),
        ("syncer MB", lambda r: mb(r, "syncer")),
        ("disk MB", lambda r: f"{(r['disk']['bytes'] or 0) / 2**20:.0f}"),
        ("checks", lambda r: "pass" if r["passed"] else "FAIL"),
    ]
    cells = [[f(r) for _, f in cols] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (h, _) in enumerate(cols)]
    lines = [" | ".join(h.rjust(w) for (h, _), w in zip(cols, widths, strict=True))]
    lines += [" | ".join(c.rjust(w) for c, w in zip(cr, widths, strict=True)) for cr in cells]
    lines += ["", "restarts (s from the kill): " + "algorithm target killed_at → serving, first commit"]
    for r in rows:
        for x in r["restart_times"]:
            parts = ", ".join(f"{k} {v:.1f}" for k, v in (x.get("startup_s") or {}).items())
            lines.append(
                f"  {r['algorithm']:>9} {x['target']:>6} at {x['killed_at']:6.1f} → {_s(x['serving_s'])}, "
                f"{_s(x['first_commit_s'])}   ({parts})"
            )
    return "\n".join(lines)


def _s(x: float | None, unit: str = " s") -> str:
    return "never" if x is None else f"{x:.1f}{unit}"


def report(result: dict) -> str:
    """A Markdown section of a soak.json result (for docs/RESULTS.md)."""
    rows = result["rows"]
    head = [
        "algorithm",
        "minutes",
        "learner kills",
        "syncer kills",
        "store kills",
        "freezes",
        "pushes lost",
        "merges",
        "versions lost",
        "NaN",
        "uptime",
        "RSS driver / store / syncer",
        "checks",
    ]

    def rss(r):
        return " / ".join(
            "-" if r["rss"][n]["max_growth"] is None else f"{100 * r['rss'][n]['max_growth']:+.0f} %"
            for n in ("driver", "store", "syncer")
        )

    body = [
        [
            r["algorithm"],
            f"{r['seconds'] / 60:g}",
            *(
                str(r["faults"][k])
                for k in ("learner_kills", "syncer_kills", "store_kills", "freezes", "payloads_lost")
            ),
            str(r["merges"]),
            str(r["versions"]["lost"]),
            "0" if r["checks"]["0 NaN"] else "yes",
            "-" if r["uptime"] is None else f"{r['uptime']:.3f}",
            rss(r),
            "pass" if r["passed"] else "FAIL",
        ]
        for r in rows
    ]
    failed = [f"{r['algorithm']}: {k}" for r in rows for k, ok in r["checks"].items() if not ok]
    return "\n".join(
        [
            "## Chaos soak (`benchmarks/soak.py`)",
            "",
            f"`{result['command']}`: {result['wall_s'] / 60:.0f} min on {result['machine']['cpus']} CPUs, a local Ray "
            f"cluster; per algorithm the `micro` model, {LEARNERS} learners each capped at "
            f"{result['cpu_limit'] or 'no'} cores, learner kills (seeded MTBF), freezes, 2 % of pushes lost, the "
            "syncer and the store killed 3 times each. Versions lost: a store restart that restored less than "
            "the driver had seen merged, or a version merged twice or skipped. RSS: resident set after warm-up "
            "versus at the end (a restarted store or syncer counted from its own start).",
            "",
            "| " + " | ".join(head) + " |",
            "|" + "---|" * len(head),
            *("| " + " | ".join(c) + " |" for c in body),
            "",
            "Every check passed." if not failed else "Failed checks: " + "; ".join(failed) + ".",
            "",
            *(restarts_table(rows) if any(r.get("restart_times") for r in rows) else []),
        ]
    )


def restarts_table(rows: list[dict]) -> list[str]:
    """Markdown lines: each restart of a soak's rows (a soak from before they were recorded has none)."""
    return [
        "Restarts: seconds from each kill of the store or the syncer to the restarted process serving "
        "(its `store_start` / `syncer_start`) and to the run's first commit after that.",
        "",
        "| algorithm | killed | at (s) | serving (s) | first commit (s) |",
        "|---|---|---|---|---|",
        *(
            f"| {r['algorithm']} | {x['target']} | {x['killed_at']:.1f} | {_s(x['serving_s'], '')} | "
            f"{_s(x['first_commit_s'], '')} |"
            for r in rows
            for x in r.get("restart_times", [])
        ),
        "",
    ]


def report_quick(runs: dict[str, dict]) -> str:
    """A Markdown section of `--quick` soaks run one after another (name → its JSON, as in
    benchmarks/results/soak-quick/): per run and algorithm, the checks and the slowest restart."""
    rows = []
    for name, result in runs.items():
        for r in result["rows"]:
            times = r.get("restart_times") or []
            slowest = max((x["first_commit_s"] for x in times if x["first_commit_s"] is not None), default=None)
            never = sum(x["first_commit_s"] is None for x in times)
            failed = [k for k, ok in r["checks"].items() if not ok]
            rows.append(
                f"| {name} | {r['algorithm']} | {len(times)} | {_s(slowest, '')}{f' ({never} never)' if never else ''} "
                f"| {r['uptime']:.3f} | {r['merges']} | {'pass' if not failed else 'FAIL: ' + ', '.join(failed)} |"
            )
    return "\n".join(
        [
            "## Chaos soak, quick runs from a fresh clone (`benchmarks/soak.py --quick`)",
            "",
            "Each run: `git clone`, `pip install -e .[test]`, then `python benchmarks/soak.py --quick` (2.5 min "
            f"per algorithm, {LEARNERS} learners, 3 store and 3 syncer kills, learner kills, lost pushes); `hog` ran "
            "beside one `nice -n 10` busy loop. Restarts: kill of the store or the syncer → the run's first commit "
            f"after the restarted process serves (the check: ≤ {RESTART_LIMIT_S:g} s each).",
            "",
            "| run | algorithm | restarts | slowest restart → first commit (s) | uptime | merges | checks |",
            "|---|---|---|---|---|---|---|",
            *rows,
            "",
        ]
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0, help="wall time of the whole soak (split across algorithms)")
    ap.add_argument("--quick", action="store_true", help="5 minutes in all (fewer kills required)")
    ap.add_argument("--algorithms", default="decoupled,dp")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    minutes = 5.0 if args.quick else args.minutes
    algos = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    seconds = 60.0 * minutes / len(algos)
    from actors import isolation

    try:
        capped = bool(isolation.cgroup_root())
    except RuntimeError:
        capped = False
    cpu_limit = round((os.cpu_count() or 1) / LEARNERS, 3) if capped else 0.0
    out = Path(args.out or f"benchmarks/results/soak{'-quick' if args.quick else ''}.json")

    from actors.launch import connect

    owns = connect(None, num_cpus=4)
    root = Path(tempfile.mkdtemp(prefix="dloco-soak-"))
    t0, rows = time.time(), []
    try:
        for a in algos:
            print(f"{a}: {seconds / 60:.1f} min ...", flush=True)
            rows.append(run_one(a, seconds, args.seed, cpu_limit, root / a))
            failed = [k for k, ok in rows[-1]["checks"].items() if not ok]
            print(f"  {'all checks pass' if not failed else 'FAILED: ' + ', '.join(failed)}", flush=True)
    finally:
        if owns:
            import ray

            ray.shutdown()
    text = table(rows)
    print(text)
    for r in rows:
        for k, ok in r["checks"].items():
            if not ok:
                print(f"FAIL {r['algorithm']}: {k}", file=sys.stderr)
        for p in r["versions"]["problems"]:
            print(f"  {r['algorithm']}: {p}", file=sys.stderr)
    import jax
    import ray

    command = "python benchmarks/soak.py" + (" --quick" if args.quick else f" --minutes {minutes:g}")
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "command": command,
        "wall_s": time.time() - t0,
        "cpu_limit": cpu_limit,
        "rows": [{k: v for k, v in r.items() if k != "memory_samples"} for r in rows],
        "memory_samples": {r["algorithm"]: r["memory_samples"] for r in rows},
        "table": text,
        "passed": all(r["passed"] for r in rows),
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
        "versions": {"jax": jax.__version__, "ray": ray.__version__},
    }
    out.write_text(json.dumps(doc, indent=2, default=str))
    print(f"wrote {out} (run dirs under {root})")
    return 0 if doc["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
