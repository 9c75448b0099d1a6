"""Quality at equal tokens: dp, diloco, streaming and decoupled, plus the ablations of ALGORITHM.md.

Every row is one deterministic in-process run (`actors.local.run_local`: the same learner, syncer
and store cores the Ray actors wrap, on a virtual clock), so rows differ only in what the row
changes, and each is reproducible bit for bit. All rows use the same model, corpus split and
validation set; every learner takes `--steps` inner steps of `inner.batch_size` sequences. The DP
reference is one learner with an M× larger batch for the same number of steps (the same tokens;
synchronous data parallel computes exactly this, up to float summation order), through the same
engine (`algorithm: dp`). The inner schedule (warmup + cosine) spans the run in every row.

Learner speeds: learner m's step takes 1 + 0.2·m/(M−1) virtual seconds (a mildly heterogeneous
fleet), a commit reaches the learners 0.5 s after it closes. The quorum/grace ablation instead
slows half the learners by 20 % and adds per-step jitter U(1, 1.3) (the `chaos` section's
stragglers and jitter on the virtual clock).

Usage:  python benchmarks/quality.py [--steps 160] [--workers 2] [--only GROUP[/LABEL-PREFIX],...] [--seeds 0,...]
                                    [--tiny] [--out PATH]
        JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/quality.py ...: rows on a GPU
Writes  benchmarks/results/quality.json (+ quality.png): every row with its config and config hash.
        With --only, the other rows already in that file are kept (same --steps/--tiny).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dloco import config  # noqa: E402

# The model every row trains: the `tiny` preset (0.43M parameters, d128, 2 layers, byte tokens on
# the stdlib corpus) with 8 sequences of 128 tokens per learner step. `--tiny`: the 21k-parameter
# `micro` preset, for the test suite.
MODEL = ("preset=tiny", "inner.batch_size=8")
TINY_MODEL = (
    "preset=micro",
    "sync.every=8",
    "fragments.count=2",
    "sync.overlap=1",
)
CHAOS_STRAGGLERS = ("chaos.straggler_factor=1.2", "chaos.jitter=0.3")


def rows(tiny: bool) -> list[dict]:
    """The table: (group, label, M, overrides, seed). Seeds 1, 2 repeat the key rows."""
    r = []

    def add(group, label, M, *ov, seed=0, algorithm="decoupled", steps=None):
        r.append(
            {"group": group, "label": label, "M": M, "algorithm": algorithm, "overrides": list(ov), "seed": seed}
            | ({"steps": steps} if steps else {})
        )

    Ms = (4,) if tiny else (4, 8)
    for M in Ms:
        add("main", f"dp (1 learner, {M}x batch)", M, algorithm="dp")
        add("main", "diloco", M, algorithm="diloco")
        add("main", "streaming", M, algorithm="streaming")
        add("main", "decoupled", M)
    if tiny:
        add("compression", "int2", 4, "compression.dtype=int2")
        add("bandwidth", "H=8, int4 both ways", 4, "compression.publish=delta")
        return r
    for seed in (1, 2):
        add("main", "dp (1 learner, 4x batch)", 4, algorithm="dp", seed=seed)
        add("main", "decoupled", 4, seed=seed)
    for M in (4, 8, 16):
        add("merge", "mean", M, "merge.rule=mean")
    add("merge", "rda", 16)
    for d in ("fp32", "bf16", "int8", "int2"):
        add("compression", d, 4, f"compression.dtype={d}")
    add("quorum", "K=M", 4, "syncer.quorum=4", "syncer.grace_factor=0", *CHAOS_STRAGGLERS, "chaos.stragglers=2")
    add("quorum", "K=1, no grace", 4, "syncer.grace_factor=0", *CHAOS_STRAGGLERS, "chaos.stragglers=2")
    add("quorum", "K=1 + grace", 4, *CHAOS_STRAGGLERS, "chaos.stragglers=2")
    # each receive mode with the default share scaling, and blend / rebase with every round applied
    # in full (merge.scale_by_share=false; blend unscaled was the default before)
    for M in (4, 8):
        for mode in ("overwrite", "blend", "rebase"):
            add("receive", mode, M, f"learner.receive={mode}")
        for mode in ("blend", "rebase"):
            add("receive", f"{mode}, unscaled rounds", M, f"learner.receive={mode}", "merge.scale_by_share=false")
    # when a learner is sent a merged fragment: each committed version (every) or once its own push
    # is merged (own, the default); each against the default rows of the main table
    for M in (4, 8):
        add("install", "every", M, "learner.install=every")
    add("fragments", "P=1", 4, "fragments.count=1")
    # one tensor per fragment: the tiny model has 14 tensors; H must be a multiple of P and τ < H/P
    add("fragments", "P=14 (all tensors), H=28, τ=1", 4, "fragments.count=14", "sync.every=28", "sync.overlap=1")
    for H in (24, 48, 96):
        add("bandwidth", f"H={H}, int4 both ways", 4, "compression.publish=delta", f"sync.every={H}")
    add("bandwidth", "H=24, int4 both ways, install every", 4, "compression.publish=delta", "learner.install=every")
    # the gap to dp against training length (each row its own step count, equal tokens within a pair)
    for S in (480, 1000):
        add("horizon", f"dp (1 learner, 4x batch), {S} steps", 4, algorithm="dp", steps=S)
        add("horizon", f"diloco, {S} steps", 4, algorithm="diloco", steps=S)
        add("horizon", f"decoupled, {S} steps", 4, steps=S)
        add("horizon", f"blend (scaled rounds), {S} steps", 4, "learner.receive=blend", steps=S)
        add(
            "horizon",
            f"former default (blend, unscaled rounds), {S} steps",
            4,
            "learner.receive=blend",
            "merge.scale_by_share=false",
            "learner.install=every",
            steps=S,
        )
    # where the gap comes from: one learner with the same per-learner batch (what 4 learners must beat),
    # the spec's outer Nesterov (η 0.7, μ 0.9) instead of the presets' plain η 1, and a 4x larger
    # per-learner batch (dp's batch grows with it: equal tokens within the pair)
    nesterov = ("outer.lr=0.7", "outer.momentum=0.9")
    for S in (480, 1000):
        add("gap", f"1 learner, 1x batch, {S} steps", 1, algorithm="dp", steps=S)
    add("gap", "diloco, outer η 0.7 μ 0.9, 480 steps", 4, *nesterov, algorithm="diloco", steps=480)
    add("gap", "decoupled, outer η 0.7 μ 0.9, 480 steps", 4, *nesterov, steps=480)
    add("gap", "dp (1 learner, 4x batch), batch 32 per learner", 4, "inner.batch_size=128", algorithm="dp")
    add("gap", "decoupled, batch 32 per learner", 4, "inner.batch_size=32")
    return r


def row_config(row: dict, steps: int, tiny: bool) -> config.RunConfig:
    M = row["M"]
    base = TINY_MODEL if tiny else MODEL
    if row["algorithm"] in config.DP_ALGORITHMS:  # dp implies H = P = 1, τ = 0
        base = tuple(o for o in base if not o.startswith(("sync.", "fragments.")))
    if row["algorithm"] == "diloco":  # diloco: one fragment
        base = tuple(o for o in base if not o.startswith("fragments."))
    batch = config.load(overrides=base).inner.batch_size
    ov = [
        *base,
        f"algorithm={row['algorithm']}",
        f"seed={row['seed']}",
        f"chaos.seed={row['seed']}",
        f"inner.total_steps={steps}",
        f"inner.warmup_steps={max(1, steps // 10)}",
        "budget.tokens=0",
        f"budget.steps={steps}",
    ]
    # the same training windows for every algorithm: dp's one learner reads them all (one shard),
    # M learners read M disjoint shards of them
    if row["algorithm"] in config.DP_ALGORITHMS:
        ov += ["learners.count=1", f"inner.batch_size={batch * M}", "data.shards=1"]
    else:
        ov += [f"learners.count={M}", f"data.shards={M}"]
    return config.load(overrides=[*ov, *row["overrides"]])


def config_hash(cfg: config.RunConfig) -> str:
    return hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True).encode()).hexdigest()[:12]


def run_row(args: tuple[dict, int, bool]) -> dict:
    from actors.local import run_local

    row, steps, tiny = args
    steps = row.get("steps", steps)
    cfg = row_config(row, steps, tiny)
    M = cfg.learners.count
    times = [1.0 + 0.2 * m / (M - 1) for m in range(M)] if M > 1 else [1.0]
    if any(o.startswith("chaos.stragglers") for o in row["overrides"]):
        times = [1.0] * M
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        run = run_local(cfg, d, steps=steps, step_times=times, sync_time=0.5)
        loss = run.evaluate()
    merges = [e for e in run.events if e["event"] == "merge"]
    tokens = sum(c.step_count * c.tokens_per_step for c in run.learners)
    return {
        **row,
        "steps": steps,
        "params": sum(f.size for f in run.blueprint.plan.fragments),
        "config_hash": config_hash(cfg),
        "config": cfg.to_dict(),
        "eval_loss": loss,
        "tokens": tokens,
        "merges": len(merges),
        "rejections": sum(e["event"] == "rejection" for e in run.events),
        "bytes_up": sum(e["bytes_in"] for e in merges),
        "bytes_down_per_learner": sum(run.bytes_down) / M,
        "virtual_s": run.now,
        "wall_s": time.perf_counter() - t0,
    }


def summarize(results: list[dict]) -> list[dict]:
    """Groups rows by (group, label, M); mean and spread (max − min) over seeds."""
    out: dict[tuple, dict] = {}
    for r in results:
        k = (r["group"], r["label"], r["M"])
        out.setdefault(k, {"group": k[0], "label": k[1], "M": k[2], "losses": [], "hashes": [], "row": r})
        out[k]["losses"].append(r["eval_loss"])
        out[k]["hashes"].append(r["config_hash"])
    for s in out.values():
        s["mean"] = statistics.fmean(s["losses"])
        s["spread"] = max(s["losses"]) - min(s["losses"])
        s["seeds"] = len(s["losses"])
    return list(out.values())


def plot(summary: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({s["group"] for s in summary}, key=[s["group"] for s in summary].index)
    fig, axes = plt.subplots(1, len(groups), figsize=(3.2 * len(groups), 3.6), squeeze=False)
    for ax, g in zip(axes[0], groups, strict=True):
        items = [s for s in summary if s["group"] == g]
        labels = [f"{s['label'][:18]}\nM={s['M']}" for s in items]
        ax.bar(range(len(items)), [s["mean"] for s in items], yerr=[s["spread"] / 2 for s in items], color="C0")
        ax.set_xticks(range(len(items)), labels, rotation=70, fontsize=6)
        lo = min(s["mean"] for s in items)
        ax.set_ylim(lo * 0.97, max(s["mean"] for s in items) * 1.01)
        ax.set_title(g)
        ax.set_ylabel("validation loss (nats/byte)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=160, help="inner steps per learner (equal tokens per M)")
    ap.add_argument("--workers", type=int, default=2, help="rows run in parallel processes")
    ap.add_argument(
        "--only", default="", help="comma-separated groups, or group/label-prefix for some rows, to run (default: all)"
    )
    ap.add_argument("--seeds", default="", help="comma-separated seeds to run (default: every row's)")
    ap.add_argument("--tiny", action="store_true", help="the micro preset, few rows (for tests)")
    ap.add_argument("--out", default="benchmarks/results/quality.json")
    a = ap.parse_args(argv)
    steps = 16 if a.tiny and a.steps == 160 else a.steps
    sel = [x for x in a.only.split(",") if x]

    seeds = {int(x) for x in a.seeds.split(",") if x}

    def chosen(r: dict) -> bool:
        if seeds and r["seed"] not in seeds:
            return False
        return not sel or any(
            x == r["group"] or (x.startswith(r["group"] + "/") and r["label"].startswith(x.split("/", 1)[1]))
            for x in sel
        )

    def key(r: dict) -> tuple:
        return (r["group"], r["label"], r["M"], r["seed"])

    todo = [r for r in rows(a.tiny) if chosen(r)]
    t0 = time.time()
    results = []
    ctx = mp.get_context("spawn")
    with ctx.Pool(max(1, a.workers)) as pool:
        longest_first = sorted(todo, key=lambda r: -r["M"] * r.get("steps", steps))
        for res in pool.imap_unordered(run_row, [(r, steps, a.tiny) for r in longest_first]):
            results.append(res)
            print(
                f"{res['group']:12s} {res['label']:32s} M={res['M']:<3d} seed={res['seed']} "
                f"loss {res['eval_loss']:.4f}  ({res['wall_s']:.0f} s)",
                flush=True,
            )
    out = Path(a.out)
    prior_s = 0.0
    commands = ["python benchmarks/quality.py " + " ".join(argv if argv is not None else sys.argv[1:])]
    if a.only and out.exists():  # a partial run replaces its rows in the existing results
        old = json.loads(out.read_text())
        if old["tiny"] == a.tiny and old["steps"] == steps:
            ran = {key(r) for r in todo}
            results += [r for r in old["results"] if key(r) not in ran]
            commands = old.get("commands", [old.get("command")]) + commands
            prior_s = old["wall_s"]
            todo = [r for r in rows(a.tiny) if key(r) in {key(x) for x in results}]
    order = {key(r): i for i, r in enumerate(todo)}
    results.sort(key=lambda r: order[key(r)])
    summary = summarize(results)
    print(f"\n{'group':12s} {'row':34s} {'M':>3s} {'loss':>8s} {'±':>7s} seeds")
    for s in summary:
        print(f"{s['group']:12s} {s['label']:34s} {s['M']:3d} {s['mean']:8.4f} {s['spread']:7.4f} {s['seeds']}")
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "commands": commands,
        "steps": steps,
        "tiny": a.tiny,
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "wall_s": prior_s + time.time() - t0,
        "results": results,
        "summary": [{k: v for k, v in s.items() if k != "row"} for s in summary],
    }
    out.write_text(json.dumps(doc, indent=1))
    plot(summary, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')} in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
