"""GPU check: llama-125m tokens/s and MFU, a bare loop against the learner actor, replicated vs FSDP.

For each `learners.sharding` (replicate, fsdp) over every local device, two runners of one config:

- bare: the train step alone, `dloco.inner.make_train_step` (the function `LearnerCore` compiles
  for this config), called in a tight Python loop on synthetic token batches already on the
  devices: no data stream, no pushes, no Ray, no host sync per step;
- actor: the real `actors.learner.Learner` beside a real `FragmentStore` and a syncer that accepts
  every push, built and driven exactly as `benchmarks/learner_overhead.py` does (`ActorLearner`):
  it reads its data stream, polls the store, and compresses and ``ray.put``s each push that falls
  due, as in production.

Both cells' actors start together before anything is timed (a learner that does not fit beside
the one before it, on its GPUs, starts once that one is closed). In each cell both runners are
compiled and warmed up (`warmup` steps), then take turns in timed chunks of `chunk` steps (bare,
actor, then actor, bare, ...; the idle one waits), each timed from the driver around one call,
until `chunks` pairs ran or the cell's share of `--budget-s` is spent. Reported per cell: tokens/s
of each (all timed tokens over all timed seconds), actor / bare (the target is >= 0.97), the
median of the paired chunks' ratios, and the set-up times. With one device FSDP places every
array as replicate does (`inner.leaf_sharding`), so the two rows differ only on several devices.

MFU = F · tokens/s / (n_devices · peak), with F the model FLOPs per token (PaLM, appendix B):

    F = 6·N + 12·L·d·T

N: the parameters that take part in a matrix multiply, i.e. all of them but the input embedding
table when it is not tied to the output head (a lookup, no FLOPs; the norms' scales are counted, a
rounding error). 6 = 2 FLOPs per multiply-add × 3 (forward; backward for activations and for
weights). 12·L·d·T: per token and layer, the attention scores QKᵀ and their product with V
(2·2·d·T forward over T = seq_len keys, d = n_heads · head_dim = d_model), × 3; counted over every
key, without discounting the causal mask (as PaLM counts it). `peak` is the dense bf16
peak of one device, from `PEAK_TFLOPS` by ``jax.devices()[0].device_kind`` or from
``--peak-tflops``; without one (a CPU) MFU is null and ``mfu_reason`` says why.

``--tiny`` runs the same code on CPU on the `llama-micro` model (a few seconds per cell) over
``--devices`` emulated devices (``--xla_force_host_platform_device_count``, given to the driver
and, through the actor's environment, to the learner actor), so that FSDP really shards: it checks
the script, not the speed. On an accelerator the driver and the learner actor share the devices
(they take turns), each with ``XLA_PYTHON_CLIENT_PREALLOCATE=false``.

Usage:  python benchmarks/gpu_check.py [--tiny] [--budget-s 420] [--peak-tflops 989] [--out PATH]
        (benchmarks/gpu_check.sh installs JAX's CUDA plugin if needed and runs this)
Writes  benchmarks/results/gpu_check.json (or --out)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--tiny", action="store_true", help="llama-micro on CPU over --devices emulated devices")
ap.add_argument("--devices", type=int, default=2, help="emulated CPU devices with --tiny")
ap.add_argument("--batch", type=int, help="rows per step (default: 32, --tiny 4)")
ap.add_argument("--warmup", type=int, help="untimed steps of each runner (default: 5, --tiny 3)")
ap.add_argument("--chunk", type=int, help="timed steps per turn (default: 50, --tiny 10)")
ap.add_argument("--chunks", type=int, help="(bare, actor) turns per sharding at most (default: 8, --tiny 3)")
ap.add_argument("--budget-s", type=float, help="wall time for the whole check (default: 420, --tiny 120)")
ap.add_argument("--peak-tflops", type=float, help="dense bf16 peak of one device (default: PEAK_TFLOPS)")
ap.add_argument("--out", default="benchmarks/results/gpu_check.json")
args = ap.parse_args()

# Before JAX loads, and before `learner_overhead`, which pins JAX to the CPU unless JAX_PLATFORMS is set
if args.tiny:
    os.environ["JAX_PLATFORMS"] = "cpu"
else:
    os.environ.setdefault("JAX_PLATFORMS", "")  # "": JAX takes the GPU
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # the driver and the actor share the GPU

import learner_overhead  # noqa: E402 - a sibling script: its actor runner and chunk timing are reused

from dloco import config  # noqa: E402

# (preset, overrides, batch, warm-up steps, steps per chunk, chunk pairs, budget s) per mode
MODES = {
    # the byte tokenizer with the preset's 32768-token vocabulary: the model's size and FLOPs, no BPE to train
    "full": ("llama-125m", ("data.tokenizer=byte", "model.vocab_size=32768"), 32, 5, 50, 8, 420.0),
    "tiny": ("llama-micro", ("model.vocab_size=512",), 4, 3, 10, 3, 120.0),
}
SHARDINGS = ("replicate", "fsdp")
# dense bf16 peak TFLOP/s of one device; the first name contained in `device_kind` wins
PEAK_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM
    ("H200", 989.0),
    ("A100", 312.0),
)
TARGET_RATIO = 0.97

MODE = "tiny" if args.tiny else "full"
PRESET, MODEL_OVERRIDES, BATCH, WARMUP, CHUNK, CHUNKS, BUDGET = MODES[MODE]
BATCH, WARMUP, CHUNK = args.batch or BATCH, args.warmup or WARMUP, args.chunk or CHUNK
CHUNKS, BUDGET = args.chunks or CHUNKS, args.budget_s or BUDGET


def overrides(sharding: str, devices: int) -> tuple[str, ...]:
    """One learner of the preset, as `learner_overhead` configures its overhead runs."""
    return (
        f"preset={PRESET}",
        *MODEL_OVERRIDES,
        f"inner.batch_size={BATCH}",
        "learners.count=1",
        f"learners.sharding={sharding}",
        f"learners.num_gpus={0 if args.tiny else devices}",
        # the stdlib corpus is small: in one shard the learner does not start an epoch every few steps
        "data.shards=1",
        "budget.tokens=0",
        "budget.seconds=3600",
    )


def run_config(sharding: str, devices: int):
    return config.load(overrides=overrides(sharding, devices))


_LEARNER_ENV = learner_overhead._learner_env


def learner_env(cfg) -> dict[str, str]:
    """The environment `actors.launch` gives this config's learner, plus with --tiny the emulated
    devices: the driver (bare loop) and the actor both run in it."""
    env = _LEARNER_ENV(cfg)
    if args.tiny:
        env["XLA_FLAGS"] += f" --xla_force_host_platform_device_count={args.devices}"
    return env


@contextlib.contextmanager
def actor_env():
    """`learner_overhead.ActorLearner` gives its actor `_learner_env(cfg)`: here `learner_env`'s."""
    learner_overhead._learner_env = learner_env
    try:
        yield
    finally:
        learner_overhead._learner_env = _LEARNER_ENV


# The driver runs in the learner's environment too (threads, compile cache, emulated devices).
os.environ.update({k: v for k, v in learner_env(run_config("replicate", 1)).items() if k != "JAX_PLATFORMS"})
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from dloco import build, inner, model  # noqa: E402


def flops_per_token(params: dict, cfg) -> tuple[int, int]:
    """(F, N) of the module docstring for `params` of the model of `cfg`."""
    n = model.count_params(params)
    if not cfg.model.tie_embeddings:
        n -= model.count_params(params[model.EMBED_KEY])
    return 6 * n + 12 * cfg.model.n_layers * cfg.model.d_model * cfg.data.seq_len, n


def peak_tflops(kind: str) -> tuple[float | None, str]:
    """One device's dense bf16 peak and where it came from (or why there is none)."""
    if args.peak_tflops:
        return args.peak_tflops, "--peak-tflops"
    for name, tflops in PEAK_TFLOPS:
        if name.lower() in kind.lower():
            return tflops, f"PEAK_TFLOPS[{name!r}]"
    return None, f"no dense bf16 peak known for device kind {kind!r} (PEAK_TFLOPS): pass --peak-tflops"


class BareLoop:
    """The train step in a tight loop on synthetic batches (module docstring), with the runner
    interface of `learner_overhead` (`kind`, `pid`, `advance`) so that `_chunk` times it."""

    kind = "bare"

    def __init__(self, cfg, bp, mesh, batches: int = 4) -> None:
        self.pid = os.getpid()
        sharding = cfg.learners.sharding
        self.step_fn = inner.make_train_step(bp.model, cfg.inner, mesh, sharding)
        self.state = inner.init_state(bp.plan.join(list(bp.initial)), cfg.inner, mesh, sharding)
        rng = np.random.default_rng(cfg.seed)
        shape, vocab = (cfg.inner.batch_size, cfg.data.seq_len + 1), cfg.model.vocab_size or bp.corpus.vocab_size
        self.batches = [inner.shard_batch(rng.integers(0, vocab, shape, dtype=np.int32), mesh) for _ in range(batches)]
        self.tokens_per_step = cfg.inner.batch_size * cfg.data.seq_len
        self.loss = math.nan

    def advance(self, max_steps: int) -> dict:
        params, opt_state, t = self.state
        metrics = None
        while t < max_steps:
            params, opt_state, metrics = self.step_fn(params, opt_state, self.batches[t % len(self.batches)], t)
            t += 1
        jax.block_until_ready(params)
        self.state = inner.TrainState(params, opt_state, t)
        if metrics is not None:
            self.loss = float(metrics["loss"])
        return {"step": t, "tokens": t * self.tokens_per_step, "pushes": 0, "bytes_out": 0}


def cell(cfg, bp, mesh, starting: Future, deadline: float) -> dict:
    """One sharding: the bare loop built, the actor (being started: `starting`) waited for, both
    warmed up, then timed turns until `CHUNKS` pairs or `deadline`; the actor is closed after."""
    seconds = {}
    t = time.perf_counter()
    bare = BareLoop(cfg, bp, mesh)
    seconds["bare_start"] = time.perf_counter() - t
    t = time.perf_counter()
    actor = starting.result()  # store, syncer and learner up, the learner's step compiled
    seconds["actor_start_wait"] = time.perf_counter() - t
    try:
        actor_devices = jax_devices_of(actor)
        runners = (bare, actor)
        for r in runners:
            t = time.perf_counter()
            r.last = {"step": 0, "tokens": 0, "pushes": 0, "bytes_out": 0}
            r.last = r.advance(WARMUP)
            seconds[f"{r.kind}_warmup"] = time.perf_counter() - t
        chunks: dict[str, list[dict]] = {"bare": [], "actor": []}
        target, pairs = WARMUP, 0
        while pairs < CHUNKS and (pairs == 0 or time.monotonic() < deadline):
            target += CHUNK
            for r in runners if pairs % 2 == 0 else runners[::-1]:
                chunks[r.kind].append(learner_overhead._chunk(r, target))
            pairs += 1
        pushes = actor.pushes_received()
    finally:
        actor.close()
    tps = {k: sum(c["tokens"] for c in v) / sum(c["seconds"] for c in v) for k, v in chunks.items()}
    paired = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(chunks["actor"], chunks["bare"], strict=True)]
    return {
        "sharding": cfg.learners.sharding,
        "devices": mesh.devices.size,
        "actor_devices": actor_devices,
        "bare_tokens_per_s": tps["bare"],
        "actor_tokens_per_s": tps["actor"],
        "ratio": tps["actor"] / tps["bare"],
        "meets_target": tps["actor"] / tps["bare"] >= TARGET_RATIO,
        "paired_ratio_median": statistics.median(paired),
        "pairs": pairs,
        "cut_by_budget": pairs < CHUNKS,
        "timed_steps": pairs * CHUNK,
        "actor_pushes_received_by_syncer": pushes,
        "bare_loss": bare.loss,
        "setup_s": seconds,
        "chunks": chunks,
    }


def jax_devices_of(actor) -> int:
    """How many devices the learner actor's mesh spans (asked of the actor itself)."""
    return actor.ray.get(actor.learner.__ray_call__.remote(lambda self: int(self.mesh.devices.size)))


def main() -> int:
    import ray

    from actors.launch import connect

    t0 = time.monotonic()
    owns = connect(None, num_cpus=max(os.cpu_count() or 1, 3))
    try:
        devices = jax.devices()
        kind, n_dev = devices[0].device_kind, len(devices)
        if devices[0].platform == "cpu" and not args.tiny:
            raise SystemExit(
                "gpu_check: JAX sees only the CPU; install JAX's CUDA plugin (benchmarks/gpu_check.sh does), "
                "or run --tiny to check the script on the CPU"
            )
        peak, peak_source = peak_tflops(kind)
        mesh = inner.make_mesh()
        cfgs = [run_config(s, n_dev) for s in SHARDINGS]
        bp = build.blueprint(cfgs[0])  # the sharding is not part of it; this also prepares the corpus
        params = bp.plan.join(list(bp.initial))
        F, N = flops_per_token(params, cfgs[0])
        rows = []
        # Every cell's actors start at once, before any timing: a learner that does not fit beside the
        # one before it (its GPUs) starts when that one is closed.
        with actor_env(), ThreadPoolExecutor(len(cfgs)) as pool:
            starting = [pool.submit(learner_overhead.ActorLearner, c) for c in cfgs]
            try:
                for i, cfg in enumerate(cfgs):
                    row = cell(cfg, bp, mesh, starting[i], deadline=t0 + BUDGET * (i + 1) / len(cfgs))
                    for k in ("bare", "actor"):
                        row[f"{k}_mfu"] = F * row[f"{k}_tokens_per_s"] / (n_dev * peak * 1e12) if peak else None
                    row.update(params=model.count_params(params), flops_params=N, flops_per_token=F)
                    rows.append(row)
                    print(
                        f"{cfg.learners.sharding:9s} {n_dev} x {kind}: bare {row['bare_tokens_per_s']:12,.0f} "
                        f"tokens/s, actor {row['actor_tokens_per_s']:12,.0f} tokens/s, actor/bare {row['ratio']:.3f} "
                        f"(paired {row['paired_ratio_median']:.3f}), {row['pairs']} x {CHUNK} steps",
                        flush=True,
                    )
            finally:  # the actors of the cells that did not run (a failure): closing one twice is harmless
                for f in starting[len(rows) :]:
                    if f.exception() is None:
                        f.result().close()
    finally:
        if owns:
            ray.shutdown()
    wall = time.monotonic() - t0

    def pct(x: float | None) -> str:
        return "—" if x is None else f"{x:.1%}"

    print(
        f"\n{'sharding':9s} {'devices':>7s} {'bare tok/s':>12s} {'actor tok/s':>12s} {'ratio':>6s} "
        f"{'>= ' + str(TARGET_RATIO):>7s}  MFU bare / actor"
    )
    for r in rows:
        print(
            f"{r['sharding']:9s} {r['devices']:7d} {r['bare_tokens_per_s']:12,.0f} {r['actor_tokens_per_s']:12,.0f} "
            f"{r['ratio']:6.3f} {'yes' if r['meets_target'] else 'no':>7s}  "
            f"{pct(r['bare_mfu'])} / {pct(r['actor_mfu'])}"
        )
    if peak is None:
        print(f"MFU: null: {peak_source}")
    doc = {
        "command": " ".join(["python", "benchmarks/gpu_check.py", *sys.argv[1:]]),
        "mode": MODE,
        "preset": PRESET,
        "overrides": {s: list(overrides(s, n_dev)) for s in SHARDINGS},
        "batch": BATCH,
        "seq": run_config("replicate", n_dev).data.seq_len,
        "warmup_steps": WARMUP,
        "chunk_steps": CHUNK,
        "max_pairs": CHUNKS,
        "budget_s": BUDGET,
        "target_ratio": TARGET_RATIO,
        "flops_formula": "F = 6·N + 12·L·d·T; N: every parameter but an untied input embedding, L: layers, "
        "d: d_model, T: seq_len",
        "peak_tflops_per_device": peak,
        "peak_source": peak_source if peak else None,
        "mfu_reason": None if peak else peak_source,
        "rows": rows,
        "config": {s: run_config(s, n_dev).to_dict() for s in SHARDINGS},
        "machine": {
            "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(),
            "device_kind": kind,
            "devices": [str(d) for d in devices],
            "platform": devices[0].platform,
        },
        "env": {k: os.environ.get(k) for k in ("XLA_FLAGS", "XLA_PYTHON_CLIENT_PREALLOCATE", "JAX_PLATFORMS")},
        "versions": {"jax": jax.__version__, "ray": ray.__version__},
        "wall_s": wall,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2, default=str))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
