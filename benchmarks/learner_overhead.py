"""Learner overhead: the training loop inside a Ray actor vs a bare process, and rejoin time.

Measured in one run, on one local Ray cluster started by the script (this machine is noisy):

1. Actor overhead ratio: tokens/s of the same learner loop, same model, batch and steps,
   - bare:  a fresh subprocess (no Ray imported) builds `dloco.learner.LearnerCore` exactly as
            `actors/learner.py` does (blueprint, initial fragments at version 0, stream of shard 0,
            `inner.make_mesh()`) and runs the loop of `Learner.run` without the Ray calls:
            ``apply_inbox(); step()``;
   - actor: the real `actors.learner.Learner` class, wrapped as `actors.launch` wraps it
            (``max_restarts=-1, max_task_retries=-1, max_concurrency=4``, one CPU), beside a real
            `FragmentStore` and a sink syncer that accepts every push and merges nothing. So the
            actor pays everything a learner pays in a real run — a non-blocking store poll per step,
            ``ray.put`` of each compressed push into the object store, ``syncer.push`` calls — but
            has no merged fragments to install, and so does the same arithmetic as the bare loop.
   Both get the XLA/OMP/compilation-cache environment the launcher gives learner actors
   (`actors.launch._worker_env`): the subprocess in its environment, the actor in its runtime_env.
   Each run does `warmup` untimed steps (compile) then `steps` timed steps (wall clock around
   the loop). Order bare, actor, bare, actor, ...; the median of each is reported, with the
   ratio actor/bare (the target is >= 0.97). The Ray cluster is up during the bare runs too, so
   the ratio isolates the actor itself, not the idle cluster's background load.

2. Rejoin time: a real run (`actors.launch.start`, tiny preset, 2 learners, K=1, no token
   budget); once learner 1 has contributed to a merge, `kill_learner(1)` and measure
   kill -> `learner_restart` (the restarted actor registered with the store: Ray restarted the
   process, it imported JAX and built its blueprint) and kill -> the first merge that includes
   learner 1 in its new incarnation (compiled, trained to its next push, and the syncer merged
   it). Repeated `--rejoins` times. The launcher points JAX's persistent compilation cache at
   ``~/.cache/dloco/jax`` (`_worker_env`); the report says how many entries it held before the
   run and how many each rejoin added (0: the restarted learner compiled from the cache).

Prints a table (operation, value, unit) and writes every raw number, the configs, the CPU count
and the jax/ray versions as JSON.

Usage:  python benchmarks/learner_overhead.py [--quick | --tiny] [--steps 200] [--rejoins 3]
Writes  benchmarks/results/learner_overhead.json (or --out)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

# (preset, timed steps, warm-up steps, repetitions, rejoins) per mode
MODES = {
    "full": ("small", 200, 10, 2, 3),
    "quick": ("tiny", 100, 5, 2, 1),
    "tiny": ("tiny", 40, 3, 1, 1),
}


# ---- bare process -----------------------------------------------------------------------------
def bare_worker(spec: dict) -> dict:
    """Runs in a fresh subprocess: LearnerCore built as `actors.learner.Learner` builds it."""
    t_start = time.perf_counter()
    from dloco import build, inner
    from dloco.config import from_dict
    from dloco.learner import LearnerCore
    from dloco.policy import Ema

    cfg = from_dict(spec["cfg"])
    bp = build.blueprint(cfg)
    learner_id = 0
    batch = build.learner_batch_size(cfg, learner_id)
    stream = build.stream(cfg, bp.corpus.load_split("train"), learner_id, None, batch)
    core = LearnerCore(
        cfg, learner_id, 1, bp.model, inner.make_mesh(), bp.plan, list(bp.initial), [0] * bp.plan.count, stream, 0
    )
    t_built = time.perf_counter()
    step_time = Ema(0.9)
    pushes = bytes_out = 0

    def loop(max_steps: int) -> None:  # `Learner.run` without its Ray calls
        nonlocal pushes, bytes_out
        while core.step_count < max_steps:
            core.apply_inbox()
            t0 = time.perf_counter()
            _, out = core.step(step_time=step_time.value or 0.0)
            if core.step_count > 1:
                step_time.update(time.perf_counter() - t0)
            pushes += len(out)
            bytes_out += sum(p.nbytes for p in out)

    loop(spec["warmup"])
    t_warm = time.perf_counter()
    pushes = bytes_out = 0
    loop(spec["warmup"] + spec["steps"])
    t_end = time.perf_counter()
    return {
        "seconds": t_end - t_warm,
        "steps": spec["steps"],
        "tokens": spec["steps"] * core.tokens_per_step,
        "tokens_per_s": spec["steps"] * core.tokens_per_step / (t_end - t_warm),
        "pushes": pushes,
        "bytes_out": bytes_out,
        "build_s": t_built - t_start,
        "warmup_s": t_warm - t_built,
    }


def run_bare(cfg, warmup: int, steps: int) -> dict:
    from actors.launch import _worker_env

    env = {**os.environ, **_worker_env(cfg, gpu=False)}
    spec = json.dumps({"cfg": cfg.to_dict(), "warmup": warmup, "steps": steps})
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--bare-worker", spec],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"bare worker failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["process_s"] = time.perf_counter() - t0
    return out


# ---- Ray actor --------------------------------------------------------------------------------
class SinkSyncer:
    """Stands in for the syncer: accepts every push, keeps the newest payload ref per fragment
    (as a pending round would) and merges nothing, so the learner has nothing to install."""

    def __init__(self) -> None:
        self.pending: dict[int, object] = {}
        self.pushes = 0

    def push(self, meta, payload: list) -> tuple[bool, str]:
        self.pending[meta.fragment_id] = payload[0]
        self.pushes += 1
        return True, "accepted"

    def count(self) -> int:
        return self.pushes

    def ping(self) -> bool:
        return True


def run_actor(cfg, warmup: int, steps: int) -> dict:
    import uuid

    import ray

    from actors.launch import _worker_env
    from actors.learner import Learner
    from actors.store import FragmentStore

    ns = f"overhead-{uuid.uuid4().hex[:8]}"
    cfg_dict = cfg.to_dict()
    env = {"env_vars": _worker_env(cfg, gpu=False)}
    run_dir = tempfile.mkdtemp(prefix="dloco-overhead-")
    opts = {"namespace": ns, "num_cpus": 0, "runtime_env": env}
    store = ray.remote(FragmentStore).options(name="store", **opts).remote(cfg_dict, run_dir)
    syncer = ray.remote(SinkSyncer).options(name="syncer", **opts).remote()
    ray.get([store.ping.remote(), syncer.ping.remote()])
    g = cfg.learners.expand()[0]
    t0 = time.perf_counter()
    learner = (
        ray.remote(Learner)
        .options(
            name="learner-0",
            namespace=ns,
            max_restarts=-1,
            max_task_retries=-1,
            max_concurrency=4,
            num_cpus=g.num_cpus,
            runtime_env=env,
        )
        .remote(cfg_dict, 0, "store", "syncer", ns)
    )
    try:
        ray.get(learner.ping.remote())
        t_built = time.perf_counter()
        before = ray.get(learner.run.remote(warmup))
        t_warm = time.perf_counter()
        after = ray.get(learner.run.remote(warmup + steps))
        t_end = time.perf_counter()
        received = ray.get(syncer.count.remote())
    finally:
        for a in (learner, syncer, store):
            ray.kill(a, no_restart=True)
        shutil.rmtree(run_dir, ignore_errors=True)
    tokens = after["tokens"] - before["tokens"]
    return {
        "seconds": t_end - t_warm,
        "steps": after["step"] - before["step"],
        "tokens": tokens,
        "tokens_per_s": tokens / (t_end - t_warm),
        "pushes": after["pushes"] - before["pushes"],
        "bytes_out": after["bytes_out"] - before["bytes_out"],
        "pushes_received_by_syncer": received,
        "build_s": t_built - t0,
        "warmup_s": t_warm - t_built,
    }


def overhead(cfg, warmup: int, steps: int, reps: int) -> dict:
    bare, actor = [], []
    for r in range(reps):
        for kind, fn, out in (("bare", run_bare, bare), ("actor", run_actor, actor)):
            res = fn(cfg, warmup, steps)
            out.append(res)
            print(
                f"  rep {r + 1}/{reps} {kind:5s}: {res['tokens_per_s']:9.0f} tokens/s "
                f"({res['steps']} steps in {res['seconds']:.2f} s, {res['pushes']} pushes; "
                f"build {res['build_s']:.1f} s, warm-up {res['warmup_s']:.1f} s)",
                flush=True,
            )
    b = statistics.median(x["tokens_per_s"] for x in bare)
    a = statistics.median(x["tokens_per_s"] for x in actor)
    return {
        "code_path": "dloco.learner.LearnerCore.step() in both: actors.learner.Learner.run vs its loop without Ray",
        "warmup_steps": warmup,
        "steps": steps,
        "repetitions": reps,
        "order": "bare, actor, bare, actor, ...",
        "bare": bare,
        "actor": actor,
        "bare_tokens_per_s": b,
        "actor_tokens_per_s": a,
        "ratio": a / b,
        "target_ratio": 0.97,
    }


# ---- rejoin -----------------------------------------------------------------------------------
def cache_entries(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()} if path.exists() else set()


def wait_for(pred, timeout: float, what: str, every: float = 0.1):
    """Polls `pred` until it returns something truthy; a hang guard, not a performance check."""
    end = time.time() + timeout
    while time.time() < end:
        value = pred()
        if value:
            return value
        time.sleep(every)
    raise RuntimeError(f"gave up waiting {timeout:.0f} s for {what}")


def rejoins(cfg, n: int, timeout: float = 300.0) -> dict:
    from actors.launch import _worker_env, start

    cache = Path(_worker_env(cfg, gpu=False)["JAX_COMPILATION_CACHE_DIR"])
    entries_at_start = cache_entries(cache)
    run_dir = Path(tempfile.mkdtemp(prefix="dloco-rejoin-"))
    t0 = time.time()
    h = start(cfg, run_dir=run_dir / "run")
    t_started = time.time()

    def merges_of(learner: int, incarnation: int) -> list[dict]:
        return [
            e
            for e in h.metrics("merge")
            if (learner, incarnation) in zip(e["contributors"], e["incarnations"], strict=True)
        ]

    out = []
    try:
        for i in range(n):
            inc = i + 1
            wait_for(lambda inc=inc: merges_of(1, inc), timeout, f"a merge including learner 1 incarnation {inc}")
            entries_before = cache_entries(cache)
            h.kill_learner(1)
            killed = h.metrics("kill")[-1]["time"]
            restart = wait_for(
                lambda inc=inc: [
                    e for e in h.metrics("learner_restart") if e["learner"] == 1 and e["incarnation"] == inc + 1
                ],
                timeout,
                f"learner 1 incarnation {inc + 1} to register",
            )[0]
            merged = wait_for(
                lambda inc=inc: merges_of(1, inc + 1), timeout, f"a merge including learner 1 incarnation {inc + 1}"
            )
            first = min(merged, key=lambda e: e["time"])
            new = cache_entries(cache) - entries_before
            row = {
                "incarnation": inc + 1,
                "kill_to_restart_s": restart["time"] - killed,
                "kill_to_first_merge_s": first["time"] - killed,
                "restart_to_first_merge_s": first["time"] - restart["time"],
                "resumed_at_step": restart["step"],
                "first_merge_step": first["steps"][first["contributors"].index(1)],
                "cache_entries_before_kill": len(entries_before),
                "new_cache_entries": len(new),
                "new_cache_entry_names": sorted(new),
            }
            out.append(row)
            print(
                f"  rejoin {inc}/{n}: kill -> restart {row['kill_to_restart_s']:.2f} s, "
                f"kill -> first merge {row['kill_to_first_merge_s']:.2f} s "
                f"(new cache entries: {row['new_cache_entries']})",
                flush=True,
            )
        merges_total = len(h.metrics("merge"))
    finally:
        h.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
    return {
        "rejoins": out,
        "kill_to_restart_s_median": statistics.median(r["kill_to_restart_s"] for r in out),
        "kill_to_first_merge_s_median": statistics.median(r["kill_to_first_merge_s"] for r in out),
        "run_start_s": t_started - t0,
        "merges": merges_total,
        "compilation_cache": {
            "dir": str(cache),
            "entries_at_start": len(entries_at_start),
            "warm_at_start": len(entries_at_start) > 0,
            "restarts_compiled_from_cache": all(r["new_cache_entries"] == 0 for r in out),
        },
    }


# ---- driver -----------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="tiny preset, 100 steps, 1 rejoin (~2 min)")
    mode.add_argument("--tiny", action="store_true", help="smallest run, for the test suite")
    ap.add_argument("--preset", choices=("tiny", "small"), help="model of the overhead runs")
    ap.add_argument("--batch", type=int, default=8, help="rows per step of the overhead runs")
    ap.add_argument("--seq", type=int, default=128, help="sequence length of the overhead runs")
    ap.add_argument("--steps", type=int, help="timed steps per overhead run")
    ap.add_argument("--warmup", type=int, help="untimed steps before them")
    ap.add_argument("--reps", type=int, help="repetitions of (bare, actor)")
    ap.add_argument("--rejoins", type=int, help="learner kills in the rejoin run")
    ap.add_argument("--out", default="benchmarks/results/learner_overhead.json")
    ap.add_argument("--bare-worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.bare_worker:
        print(json.dumps(bare_worker(json.loads(args.bare_worker))))
        return

    import jax
    import ray

    from actors.launch import connect
    from dloco import config

    name = "tiny" if args.tiny else "quick" if args.quick else "full"
    preset, steps, warmup, reps, n_rejoins = MODES[name]
    preset = args.preset or preset
    steps, warmup = args.steps or steps, args.warmup or warmup
    reps, n_rejoins = args.reps or reps, args.rejoins or n_rejoins
    overhead_cfg = config.load(
        overrides=(
            f"preset={preset}",
            f"inner.batch_size={args.batch}",
            f"data.seq_len={args.seq}",
            "learners.count=1",
            "budget.tokens=0",
            "budget.seconds=3600",
        )
    )
    rejoin_cfg = config.load(
        overrides=(
            "preset=tiny",
            "learners.count=2",
            "syncer.quorum=1",
            "budget.tokens=0",
            "budget.seconds=3600",
            "metrics.eval_every_s=1000",
        )
    )
    t0 = time.time()
    owns = connect(None, num_cpus=max(os.cpu_count() or 1, 3))
    try:
        n_params = sum(int(x.size) for f in _blueprint_initial(overhead_cfg) for x in f.values())
        print(
            f"actor overhead: {preset} model ({n_params / 1e6:.2f}M parameters), batch {args.batch} x seq "
            f"{args.seq}, {warmup} warm-up + {steps} timed steps, {reps} x (bare, actor)",
            flush=True,
        )
        ov = overhead(overhead_cfg, warmup, steps, reps)
        print(f"rejoin: tiny preset, 2 learners, K=1, {n_rejoins} kill(s) of learner 1", flush=True)
        rj = rejoins(rejoin_cfg, n_rejoins)
    finally:
        if owns:
            ray.shutdown()
    wall = time.time() - t0

    rows = [
        ("bare tokens/s (median)", ov["bare_tokens_per_s"], "tokens/s"),
        ("actor tokens/s (median)", ov["actor_tokens_per_s"], "tokens/s"),
        ("actor / bare", ov["ratio"], "ratio"),
        ("kill -> learner_restart (median)", rj["kill_to_restart_s_median"], "s"),
        ("kill -> first merge again (median)", rj["kill_to_first_merge_s_median"], "s"),
        ("compile cache entries before run", rj["compilation_cache"]["entries_at_start"], "files"),
        ("restarts compiled from cache", rj["compilation_cache"]["restarts_compiled_from_cache"], "bool"),
        ("benchmark wall time", wall, "s"),
    ]
    print(f"\n{'operation':38s} {'value':>12s}  unit")
    for op, v, unit in rows:
        txt = str(v) if isinstance(v, bool) else f"{v:12.3f}" if isinstance(v, float) else f"{v:12d}"
        print(f"{op:38s} {txt:>12s}  {unit}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "mode": name,
                "table": [{"operation": op, "value": v, "unit": unit} for op, v, unit in rows],
                "overhead": {**ov, "preset": preset, "batch": args.batch, "seq": args.seq, "params": n_params},
                "rejoin": rj,
                "config": {"overhead": overhead_cfg.to_dict(), "rejoin": rejoin_cfg.to_dict()},
                "machine": {
                    "cpus": os.cpu_count(),
                    "processor": platform.processor() or platform.machine(),
                    "python": platform.python_version(),
                },
                "versions": {"jax": jax.__version__, "ray": ray.__version__},
                "wall_s": wall,
            },
            indent=2,
            default=str,
        )
    )
    print(f"wrote {out}")


def _blueprint_initial(cfg):
    from dloco import build

    return build.blueprint(cfg).initial


if __name__ == "__main__":
    main()
