"""Learner throughput by model family and sharding: tokens/s of one learner's jitted train step.

For each model (the classic `tiny`, the llama family at reduced width with and without a mixture
of experts, and, on a GPU, the `llama-125m` preset) and each `learners.sharding` (replicate, fsdp)
the script builds exactly what a learner builds (`dloco.learner.LearnerCore` on
`inner.make_mesh()` over every device of this process), compiles, then times `--steps` steps in
`--reps` alternating rounds (replicate, fsdp, replicate, ...: this machine is noisy) and reports
the median tokens/s, the per-device parameter + AdamW bytes (what FSDP divides), and on a GPU the
model FLOPs utilisation (6·N·tokens/s over the device's peak, `--peak-tflops`).

On CPU the devices are emulated (`--devices`, default 4, via
``--xla_force_host_platform_device_count``): they share the same cores, so FSDP's gathers cost
time without adding compute; the table shows what it saves (memory per device) and what it
costs (tokens/s), not a multi-host speed-up.

Usage:  python benchmarks/throughput.py [--devices 4] [--steps 10] [--reps 3] [--gpu] [--out PATH]
Writes  benchmarks/results/throughput.json (--gpu: throughput-gpu.json)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--devices", type=int, default=4, help="emulated CPU devices (ignored with --gpu)")
ap.add_argument("--steps", type=int, default=10)
ap.add_argument("--reps", type=int, default=3)
ap.add_argument("--gpu", action="store_true", help="time on the GPU(s) instead, with the llama-125m preset")
ap.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense peak per GPU for MFU (H100 SXM: 989)")
ap.add_argument("--out", default=None)
args = ap.parse_args()
if not args.gpu:
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from dloco import build, config, inner, model  # noqa: E402
from dloco.learner import LearnerCore  # noqa: E402

CPU_MODELS = {
    "classic tiny (d128, 2 layers)": ("preset=tiny",),
    "llama d256, 4 layers, GQA 8/2": (
        "preset=llama-micro",
        "model.d_model=256",
        "model.n_heads=8",
        "model.n_kv_heads=2",
        "model.n_layers=4",
        "data.seq_len=128",
        "inner.batch_size=8",
    ),
    "llama d256, 4 layers, MoE 4×top-2": (
        "preset=llama-micro",
        "model.d_model=256",
        "model.n_heads=8",
        "model.n_kv_heads=2",
        "model.n_layers=4",
        "model.n_experts=4",
        "model.experts_per_token=2",
        "data.seq_len=128",
        "inner.batch_size=8",
    ),
}
GPU_MODELS = {
    "llama-125m (bf16)": ("preset=llama-125m", "data.tokenizer=byte", "model.vocab_size=32768", "inner.batch_size=16"),
}


def learner(overrides: tuple[str, ...], sharding: str) -> tuple[LearnerCore, int, int]:
    cfg = config.load(overrides=(*overrides, "learners.count=1", f"learners.sharding={sharding}", "sync.every=100000"))
    bp = build.blueprint(cfg)
    stream = build.stream(cfg, bp.corpus.load_split("train"), 0)
    core = LearnerCore(cfg, 0, 1, bp.model, inner.make_mesh(), bp.plan, bp.initial, [0] * bp.plan.count, stream)
    n = model.count_params(bp.plan.join(list(bp.initial)))
    return core, n, cfg.inner.batch_size * cfg.data.seq_len


def per_device_bytes(core: LearnerCore) -> int:
    """Bytes of parameters and AdamW state on the first device."""
    dev = jax.devices()[0]
    total = 0
    for x in jax.tree_util.tree_leaves((core.state.params, core.state.opt_state)):
        for s in getattr(x, "addressable_shards", []):
            if s.device == dev:
                total += s.data.nbytes
    return total


def timed(core: LearnerCore, steps: int) -> float:
    jax.block_until_ready(core.state.params)
    t0 = time.perf_counter()
    for _ in range(steps):
        core.step(step_time=0.0)
    jax.block_until_ready(core.state.params)
    return time.perf_counter() - t0


def main() -> int:
    models = GPU_MODELS if args.gpu else CPU_MODELS
    rows = []
    for name, overrides in models.items():
        cores = {}
        for mode in ("replicate", "fsdp"):
            core, n, tokens = learner(overrides, mode)
            timed(core, 2)  # compile
            cores[mode] = core
        secs: dict[str, list[float]] = {m: [] for m in cores}
        for _ in range(args.reps):
            for mode, core in cores.items():
                secs[mode].append(timed(core, args.steps))
        for mode, core in cores.items():
            tps = args.steps * tokens / statistics.median(secs[mode])
            row = {
                "model": name,
                "sharding": mode,
                "parameters": n,
                "devices": jax.device_count(),
                "tokens_per_s": tps,
                "state_mb_per_device": per_device_bytes(core) / 2**20,
                "loss": float(core.step(step_time=0.0)[0]["loss"]),
                "overrides": list(overrides),
            }
            if args.gpu:
                row["mfu"] = 6 * n * tps / (args.peak_tflops * 1e12 * jax.device_count())
            rows.append(row)
            print(
                f"{name:36s} {mode:9s} {n / 1e6:8.2f} M params  {tps:10,.0f} tokens/s  "
                f"{row['state_mb_per_device']:8.1f} MB/device" + (f"  MFU {row['mfu']:.1%}" if args.gpu else ""),
                flush=True,
            )
    out = Path(args.out or f"benchmarks/results/throughput{'-gpu' if args.gpu else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "command": "python benchmarks/throughput.py" + (" --gpu" if args.gpu else f" --devices {args.devices}"),
        "rows": rows,
        "steps": args.steps,
        "reps": args.reps,
        "machine": {
            "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
            "devices": [str(d) for d in jax.devices()],
        },
        "versions": {"jax": jax.__version__},
    }
    out.write_text(json.dumps(doc, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
