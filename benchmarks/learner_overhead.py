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
   (`actors.workers.worker_env`): the subprocess in its environment, the actor in its runtime_env.
   Both are started and warmed up (`warmup` untimed steps: compile), then they take turns: timed
   chunks of `chunk` steps alternate bare, actor, bare, actor, ... (the idle one waits, using no
   CPU), each timed by the driver around one request (one pipe round trip vs one Ray call), so
   both see the same machine from second to second. `reps` fresh pairs; repetitions alternate
   who goes first. Reported: the median chunk tokens/s of each, their ratio actor/bare (the
   target is >= 0.97), the median of the paired chunk ratios, and the CPU cores each process
   used while training. The Ray cluster is up during the bare chunks too, so the ratio isolates
   the actor itself, not the idle cluster's background load.

2. Rejoin time: a real run (`actors.launch.start`, tiny preset, 2 learners, K=1, no token
   budget); once the current incarnation of learner 1 has contributed to a merge of every
   fragment (so that it resumes from its merged cursor, not from step 0), `kill_learner(1)` and
   measure
   kill -> `learner_restart` (the restarted actor registered with the store: Ray restarted the
   process, it imported JAX and built its blueprint) and kill -> the first merge that includes
   learner 1 in its new incarnation (compiled, trained to its next push, and the syncer merged
   it). Repeated `--rejoins` times. The launcher points JAX's persistent compilation cache at
   ``~/.cache/dloco/jax`` (`worker_env`); the report says how many entries it held before the
   run and how many each rejoin added (0: the restarted learner compiled from the cache).
   Then the same kills with `learners.spares=1`: each waits for the spare to be warm, and the
   spare takes learner 1's identity instead of a new process (`actors.spares`).

Prints a table (operation, value, unit) and writes every raw number, the configs, the CPU count
and the jax/ray versions as JSON.

Usage:  python benchmarks/learner_overhead.py [--quick] [--steps 200] [--chunk 20] [--rejoins 3]
Writes  benchmarks/results/learner_overhead.json (or --out)
"""

from __future__ import annotations

import argparse
import contextlib
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

if "--gpu" in sys.argv:  # JAX finds the GPU; the driver and both learners share it
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
else:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

# (preset, timed steps, warm-up steps, steps per timed chunk, repetitions, rejoins) per mode
MODES = {
    "full": ("small", 200, 10, 20, 2, 3),
    "quick": ("tiny", 100, 5, 20, 2, 1),
}


# ---- bare process -----------------------------------------------------------------------------
def bare_worker(spec: dict) -> None:
    """Runs in a fresh subprocess: builds LearnerCore as `actors.learner.Learner` builds it, then
    for each line ``N`` on stdin trains up to local step N and answers one JSON line."""
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
    step_time = Ema(0.9)
    status = {"step": 0, "tokens": 0, "pushes": 0, "bytes_out": 0, "build_s": time.perf_counter() - t_start}
    print(json.dumps(status), flush=True)
    for line in sys.stdin:
        while core.step_count < int(line):  # `Learner.run` without its Ray calls
            core.apply_inbox()
            t0 = time.perf_counter()
            _, pushes = core.step(step_time=step_time.value or 0.0)
            if core.step_count > 1:
                step_time.update(time.perf_counter() - t0)
            status["pushes"] += len(pushes)
            status["bytes_out"] += sum(p.nbytes for p in pushes)
        status.update(step=core.step_count, tokens=core.step_count * core.tokens_per_step)
        print(json.dumps(status), flush=True)


class BareLearner:
    """Driver side of `bare_worker`: a subprocess with the learner actors' environment."""

    kind = "bare"

    def __init__(self, cfg) -> None:
        self._err = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed in close()
        spec = json.dumps({"cfg": cfg.to_dict()})
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--bare-worker", spec]
            + (["--gpu"] if cfg.learners.expand()[0].num_gpus > 0 else []),
            env={**os.environ, **_learner_env(cfg)},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            text=True,
        )
        self.pid = self.proc.pid
        self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self._err.seek(0)
            raise RuntimeError(f"bare worker exited ({self.proc.wait()}):\n{self._err.read()[-4000:]}")
        return json.loads(line)

    def advance(self, max_steps: int) -> dict:
        self.proc.stdin.write(f"{max_steps}\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self._err.close()


# ---- Ray actor --------------------------------------------------------------------------------
class SinkSyncer:
    """Stands in for the syncer: accepts every push, keeps the newest payload ref per fragment
    (as a pending round would) and merges nothing, so the learner has nothing to install."""

    def __init__(self) -> None:
        self.pending: dict[int, object] = {}
        self.pushes = 0

    def push(self, meta, payload: list):
        from dloco.policy import ACCEPTED  # the syncer's answer to a push: a `Decision`

        self.pending[meta.fragment_id] = payload[0]
        self.pushes += 1
        return ACCEPTED

    def count(self) -> int:
        return self.pushes

    def ping(self) -> bool:
        return True


class ActorLearner:
    """The real `actors.learner.Learner`, wrapped as `actors.launch` wraps it, beside a real
    `FragmentStore` and a `SinkSyncer`, in a namespace of its own."""

    kind = "actor"

    def __init__(self, cfg) -> None:
        import uuid

        import ray

        from actors.learner import Learner
        from actors.store import FragmentStore

        self.ray = ray
        ns = f"overhead-{uuid.uuid4().hex[:8]}"
        cfg_dict = cfg.to_dict()
        env = {"env_vars": _learner_env(cfg)}
        self.run_dir = tempfile.mkdtemp(prefix="dloco-overhead-")
        opts = {"namespace": ns, "num_cpus": 0, "runtime_env": env}
        self.store = ray.remote(FragmentStore).options(name="store", **opts).remote(cfg_dict, self.run_dir)
        self.syncer = ray.remote(SinkSyncer).options(name="syncer", **opts).remote()
        ray.get([self.store.ping.remote(), self.syncer.ping.remote()])
        g = cfg.learners.expand()[0]
        self.learner = (
            ray.remote(Learner)
            .options(
                name="learner-0",
                namespace=ns,
                max_restarts=-1,
                max_task_retries=-1,
                max_concurrency=4,
                num_cpus=g.num_cpus,
                num_gpus=g.num_gpus,
                runtime_env=env,
            )
            .remote(cfg_dict, 0, "store", "syncer", ns)
        )
        ray.get(self.learner.ping.remote())
        self.pid = _find_pid("ray::Learner")

    def advance(self, max_steps: int) -> dict:
        return self.ray.get(self.learner.run.remote(max_steps))

    def pushes_received(self) -> int:
        return self.ray.get(self.syncer.count.remote())

    def close(self) -> None:
        for a in (self.learner, self.syncer, self.store):
            self.ray.kill(a, no_restart=True)
        shutil.rmtree(self.run_dir, ignore_errors=True)


def _learner_env(cfg) -> dict[str, str]:
    """The environment `actors.launch` gives a learner of this config (GPU with --gpu)."""
    from actors.workers import worker_env

    g = cfg.learners.expand()[0]
    return worker_env(cfg, accelerator=g.num_gpus > 0, shared_gpu=0 < g.num_gpus < 1)


def _find_pid(title: str) -> int | None:
    """The pid of the one process whose title starts with `title` (Ray names workers by actor)."""
    import psutil

    found = [p.pid for p in psutil.process_iter(["cmdline"]) if (p.info["cmdline"] or [""])[0].startswith(title)]
    return found[0] if len(found) == 1 else None


def _cpu_seconds(pid: int | None) -> float | None:
    import psutil

    if pid is None:
        return None
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def _chunk(runner, to_step: int) -> dict:
    """Trains `runner` up to `to_step`, timed from the driver (both kinds pay one round trip)."""
    c0 = _cpu_seconds(runner.pid)
    t0 = time.perf_counter()
    before = runner.last
    after = runner.advance(to_step)
    seconds = time.perf_counter() - t0
    c1 = _cpu_seconds(runner.pid)
    runner.last = after
    tokens = after["tokens"] - before["tokens"]
    return {
        "steps": after["step"] - before["step"],
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "cores_used": (c1 - c0) / seconds if c0 is not None and c1 is not None else None,
        "pushes": after["pushes"] - before["pushes"],
        "bytes_out": after["bytes_out"] - before["bytes_out"],
    }


def overhead(cfg, warmup: int, steps: int, chunk: int, reps: int) -> dict:
    """`reps` fresh (bare, actor) pairs; in each, timed chunks of `chunk` steps alternate between
    the two (the idle one waits), so that both see the same machine from second to second."""
    runs = []
    for r in range(reps):
        with contextlib.ExitStack() as cleanup:
            t0 = time.perf_counter()
            bare = BareLearner(cfg)
            cleanup.callback(bare.close)
            t1 = time.perf_counter()
            actor = ActorLearner(cfg)
            cleanup.callback(actor.close)
            t2 = time.perf_counter()
            rec = {"bare": {"start_s": t1 - t0, "chunks": []}, "actor": {"start_s": t2 - t1, "chunks": []}}
            order = (bare, actor) if r % 2 == 0 else (actor, bare)
            for runner in order:
                runner.last = {"step": 0, "tokens": 0, "pushes": 0, "bytes_out": 0}
                w0 = time.perf_counter()
                runner.last = runner.advance(warmup)
                rec[runner.kind]["warmup_s"] = time.perf_counter() - w0
            target = warmup
            while target < warmup + steps:
                target = min(target + chunk, warmup + steps)
                for runner in order:
                    rec[runner.kind]["chunks"].append(_chunk(runner, target))
            rec["actor"]["pushes_received_by_syncer"] = actor.pushes_received()
        for kind in ("bare", "actor"):
            ch = rec[kind]["chunks"]
            rec[kind]["tokens_per_s"] = sum(c["tokens"] for c in ch) / sum(c["seconds"] for c in ch)
            rec[kind]["pushes"] = sum(c["pushes"] for c in ch)
        runs.append(rec)
        print(
            f"  rep {r + 1}/{reps} ({order[0].kind} first): bare {rec['bare']['tokens_per_s']:8.0f} tokens/s, "
            f"actor {rec['actor']['tokens_per_s']:8.0f} tokens/s "
            f"({rec['actor']['tokens_per_s'] / rec['bare']['tokens_per_s']:.3f}); "
            f"start bare {rec['bare']['start_s']:.1f} s, actor {rec['actor']['start_s']:.1f} s",
            flush=True,
        )
    chunks = {k: [c for rec in runs for c in rec[k]["chunks"]] for k in ("bare", "actor")}
    med = {k: statistics.median(c["tokens_per_s"] for c in v) for k, v in chunks.items()}
    paired = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(chunks["actor"], chunks["bare"], strict=True)]
    cores = {k: [c["cores_used"] for c in v if c["cores_used"] is not None] for k, v in chunks.items()}
    return {
        "code_path": "dloco.learner.LearnerCore.step() in both: actors.learner.Learner.run vs its loop without Ray",
        "warmup_steps": warmup,
        "steps": steps,
        "chunk_steps": chunk,
        "repetitions": reps,
        "order": "per repetition: warm-up both, then timed chunks alternate; repetitions alternate who goes first",
        "runs": runs,
        "bare_tokens_per_s": med["bare"],
        "actor_tokens_per_s": med["actor"],
        "ratio": med["actor"] / med["bare"],
        "paired_ratio_median": statistics.median(paired),
        "ratio_of_totals": statistics.median(r["actor"]["tokens_per_s"] for r in runs)
        / statistics.median(r["bare"]["tokens_per_s"] for r in runs),
        "cores_used_median": {k: statistics.median(v) if v else None for k, v in cores.items()},
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
    import ray

    from actors.launch import start
    from actors.workers import worker_env

    cache = Path(worker_env(cfg, accelerator=False)["JAX_COMPILATION_CACHE_DIR"])
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
            wait_for(
                lambda inc=inc: {e["fragment"] for e in merges_of(1, inc)} == set(range(cfg.fragments.count)),
                timeout,
                f"merges of every fragment including learner 1 incarnation {inc}",
            )
            if h.spares is not None:  # with spares: one warm (JAX loaded, step compiled) before the kill
                wait_for(
                    lambda: any(ray.wait([w], timeout=0)[0] for _, _, w in h.spares.waiting), timeout, "a warm spare"
                )
            entries_before = cache_entries(cache)
            h.kill_learner(1)
            killed = [e for e in h.metrics("fault") if e["kind"] == "kill"][-1]["time"]
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
REJOIN = (
    "preset=tiny",
    "learners.count=2",
    "syncer.quorum=1",
    "budget.tokens=0",
    "budget.seconds=3600",
    "metrics.eval_every_s=1000",
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny preset, 100 timed steps, 1 rejoin (~70 s)")
    ap.add_argument("--preset", choices=("tiny", "small"), help="model of the overhead runs")
    ap.add_argument("--batch", type=int, default=8, help="rows per step of the overhead runs")
    ap.add_argument("--seq", type=int, default=128, help="sequence length of the overhead runs")
    ap.add_argument("--steps", type=int, help="timed steps per overhead run")
    ap.add_argument("--warmup", type=int, help="untimed steps before them")
    ap.add_argument("--chunk", type=int, help="timed steps per turn (bare and actor take turns)")
    ap.add_argument("--reps", type=int, help="repetitions of (bare, actor)")
    ap.add_argument("--rejoins", type=int, help="learner kills in the rejoin run")
    ap.add_argument(
        "--gpu",
        action="store_true",
        help="learners on the GPU (bare and actor share it: each learner num_gpus=0.5, JAX allocating as it goes)",
    )
    ap.add_argument("--out", default="benchmarks/results/learner_overhead.json")
    ap.add_argument("--bare-worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.bare_worker:
        bare_worker(json.loads(args.bare_worker))
        return

    import jax
    import ray

    from actors.launch import connect
    from dloco import config

    name = "quick" if args.quick else "full"
    preset, steps, warmup, chunk, reps, n_rejoins = MODES[name]
    preset = args.preset or preset
    steps, warmup, chunk = args.steps or steps, args.warmup or warmup, args.chunk or chunk
    reps, n_rejoins = args.reps or reps, args.rejoins or n_rejoins
    gpu = ("learners.num_gpus=0.5",) if args.gpu else ()
    overhead_cfg = config.load(
        overrides=(
            f"preset={preset}",
            f"inner.batch_size={args.batch}",
            f"data.seq_len={args.seq}",
            "learners.count=1",
            "budget.tokens=0",
            "budget.seconds=3600",
            *gpu,
        )
    )
    rejoin_cfg = config.load(overrides=(*REJOIN, *gpu))
    t0 = time.time()
    owns = connect(None, num_cpus=max(os.cpu_count() or 1, 3))
    try:
        n_params = sum(int(x.size) for f in _blueprint_initial(overhead_cfg) for x in f.values())
        print(
            f"actor overhead: {preset} model ({n_params / 1e6:.2f}M parameters), batch {args.batch} x seq "
            f"{args.seq}, {warmup} warm-up + {steps} timed steps, {reps} x (bare, actor)",
            flush=True,
        )
        ov = overhead(overhead_cfg, warmup, steps, chunk, reps)
        print(f"rejoin: tiny preset, 2 learners, K=1, {n_rejoins} kill(s) of learner 1", flush=True)
        rj = rejoins(rejoin_cfg, n_rejoins)
        print("rejoin with a warm spare (learners.spares=1): the same kills", flush=True)
        rj_spare = rejoins(config.load(overrides=(*REJOIN, "learners.spares=1", *gpu)), n_rejoins)
    finally:
        if owns:
            ray.shutdown()
    wall = time.time() - t0

    rows = [
        ("bare tokens/s (median)", ov["bare_tokens_per_s"], "tokens/s"),
        ("actor tokens/s (median)", ov["actor_tokens_per_s"], "tokens/s"),
        ("actor / bare (ratio of medians)", ov["ratio"], "ratio"),
        ("actor / bare (median of paired chunks)", ov["paired_ratio_median"], "ratio"),
        ("bare CPU use while training (median)", ov["cores_used_median"]["bare"], "cores"),
        ("actor CPU use while training (median)", ov["cores_used_median"]["actor"], "cores"),
        ("kill -> learner_restart (median)", rj["kill_to_restart_s_median"], "s"),
        ("kill -> first merge again (median)", rj["kill_to_first_merge_s_median"], "s"),
        ("with a spare: kill -> learner_restart (median)", rj_spare["kill_to_restart_s_median"], "s"),
        ("with a spare: kill -> first merge again (median)", rj_spare["kill_to_first_merge_s_median"], "s"),
        ("compile cache entries before run", rj["compilation_cache"]["entries_at_start"], "files"),
        ("restarts compiled from cache", rj["compilation_cache"]["restarts_compiled_from_cache"], "bool"),
        ("benchmark wall time", wall, "s"),
    ]
    print(f"\n{'operation':40s} {'value':>12s}  unit")
    for op, v, unit in rows:
        txt = f"{v:12.3f}" if isinstance(v, float) else str(v)
        print(f"{op:40s} {txt:>12s}  {unit}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "command": " ".join(["python", "benchmarks/learner_overhead.py", *sys.argv[1:]]),
                "mode": name,
                "table": [{"operation": op, "value": v, "unit": unit} for op, v, unit in rows],
                "overhead": {**ov, "preset": preset, "batch": args.batch, "seq": args.seq, "params": n_params},
                "rejoin": rj,
                "rejoin_spares": rj_spare,
                "config": {"overhead": overhead_cfg.to_dict(), "rejoin": rejoin_cfg.to_dict()},
                "machine": {
                    "cpus": os.cpu_count(),
                    "processor": platform.processor() or platform.machine(),
                    "python": platform.python_version(),
                },
                "versions": {"jax": jax.__version__, "ray": ray.__version__},
                "device": "gpu" if args.gpu else "cpu",
                "gpus": [d.device_kind for d in jax.devices()] if args.gpu else [],
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
