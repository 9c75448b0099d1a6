"""The commit path at scale: what one syncer/store shard pair spends per commit, against memcpy.

One commit here merges the N/S parameters one of S shards owns (`syncer.shards`; a fragment set of
N/S fp32 parameters in 4 M-parameter tensors) from M synthetic int4 contributions (block 128), as
that shard's syncer and store do it; the S shards are separate processes (on a cluster, separate
hosts and disks) that commit side by side, so a model of N parameters sustains S times one shard's
commit rate:

  memcpy    np.copyto of the N parameters, warm (best of --repeat): the machine's yardstick
  screen    each payload checked and its ‖δ‖ per tensor read from the int4 codes (no decode; the
            compiled `dloco.kernels.sq_norm`)
  merge     RDA over the M packed payloads: the compiled `dloco.kernels.combine` decodes every
            contribution's codes for one cache-sized chunk into the weighted sum, chunk by chunk
  outer     the outer Nesterov step (jitted optax, ``outer.make_outer_step``; lr 0.7, momentum 0.9,
            delayed over M: its state is the momentum and the delay buffer)
  fused     merge + outer as one pass per tensor (``outer.make_merge_step``, the same bits): after the
            peak RSS is read, so the RSS columns stay the unfused path's
  publish   int4 encode of Θ_p − Θ̂_p (``compression.publish: delta``)
  wal       the store's commit-log file (Θ_p, s_p, Θ̂_p: 4 × N × 4 bytes): written, checksummed, fsynced
  disk      as many random bytes written and fsynced as one plain file, in turns with wal: the disk's yardstick
  decoded   for comparison, the path before: every payload decoded to float32, its norms
            computed, then the merge (+ the same outer step)

Each cell runs in its own process per role, so each peak RSS is that role's: VmHWM, reset once
the inputs are built (the contributions are built packed, as the syncer receives them), less the
process's RSS with numpy and JAX loaded, in multiples of the N·4 bytes of the fp32 model: what the
role holds plus what one commit adds, with glibc's default malloc (freed memory it keeps counts, as
it would in the actor). Roles: the syncer (packed path), the syncer on the decoded path, the store
(its fragments, outer state and shadow, and the log write). The arithmetic ratio is parameters
merged per second by screen + merge + outer against parameters copied per second by a warm memcpy
(goal ≥ 0.3). Commits/s sustained by one shard pair is 1 / (screen + merge + outer + publish +
wal): M × that many contributions/s, and S × M for the model. RSS is in multiples of the shard's
part of the model (N/S × 4 bytes).

Usage:  python benchmarks/syncer_scale.py [--params 1e8 3e8] [--learners 4 8] [--shards 1 2] [--repeat 2] [--quick]
Writes  benchmarks/results/syncer_scale.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import merge_throughput  # noqa: E402  (this directory: its tensors and its best-of timer)
import numpy as np  # noqa: E402
from merge_throughput import best  # noqa: E402

TENSOR = 4_000_000
BLOCK = 128


def fragment_set(n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    return merge_throughput.fragment_set(n, TENSOR, rng)


def current_rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    """The peak RSS since the last `reset_peak` (VmHWM), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def reset_peak() -> None:
    """Resets VmHWM to the current RSS (Linux ≥ 4.0): what the benchmark's set-up allocated (the
    synthetic float32 contributions before encoding, the memcpy's copy) is not the syncer's."""
    Path("/proc/self/clear_refs").write_text("5")


def raw_write(path: Path, size: int) -> None:
    """`size` random bytes written and fsynced, in 16 MiB writes: the disk's yardstick for the log
    file (random: a disk that stores zeros cheaply would flatter it)."""
    chunk = np.random.default_rng(1).integers(0, 256, 16 << 20, dtype=np.uint8).tobytes()
    with open(path, "wb") as fh:
        for lo in range(0, size, len(chunk)):
            fh.write(chunk[: min(len(chunk), size - lo)])
        fh.flush()
        os.fsync(fh.fileno())
    path.unlink()


def contributions(theta: dict[str, np.ndarray], m: int, rng: np.random.Generator) -> list[dict]:
    """M int4 contributions to `theta`, built packed (random codes, scales about 1e-3 / 7), as the
    syncer receives them: no float32 copy is ever allocated, so the process's heap holds nothing the
    syncer would not."""
    from dloco import compress

    payloads = []
    for _ in range(m):
        d = {}
        for k, v in theta.items():
            blocks = -(-v.size // BLOCK)  # the last one zero-padded, as `compress.encode` pads it
            codes = rng.integers(0, 256, blocks * BLOCK // 2, dtype=np.uint8)
            scales = (rng.random(blocks, dtype=np.float32) * np.float32(3e-4)).astype(np.float16)
            d[k] = compress.Payload("int4", v.shape, codes, scales, BLOCK)
        payloads.append(d)
    return payloads


def store_cell(out: dict, theta: dict, leaves: list, m: int, repeat: int, rng: np.random.Generator) -> dict:
    """The store's side of a commit (`StoreCore.commit`): the first commit of a fragment writes its
    state (Θ_p, s_p, Θ̂_p), the next ones steps (the M contributions and the published q, with the
    digest of the state they produce); in turns with plain fsynced writes of as many random bytes."""
    from dloco import ledger, recipe, store

    contribs, q = contributions(theta, m, rng), contributions(theta, 1, rng)[0]
    made = recipe.Recipe(
        deltas=tuple(contribs),
        weights=tuple(float(i + 1) for i in range(m)),
        share=1.0,
        norms=tuple({k: 1.0 for k in theta} for _ in range(m)),
        rule="rda",
        embedding=(),
        outer={"kind": "outer", "lr": 0.7, "momentum": 0.9, "nesterov": True, "delay": m},
        published=q,
    )
    merged = tuple(ledger.MergedPush(i, 1, 1, 1000, 10, {"index": 1}) for i in range(m))
    reset_peak()
    state_s, step_s, disk_state, disk_step, step_bytes, state_bytes = [], [], [], [], 0, 0
    with tempfile.TemporaryDirectory(dir=os.environ.get("DLOCO_BENCH_DIR")) as d:
        for r in range(repeat):  # in turns: the disk here is noisy from second to second
            core = store.StoreCore(Path(d) / f"s{r}", [theta], [leaves], snapshot_every=1 << 30)
            wal = Path(d) / f"s{r}" / "wal"
            for v in range(3):  # version 1: the state; 2 and 3: steps
                c = store.Commit(0, v, theta, leaves, merged, f"c{v}", shadow=theta, delta=q, recipe=made)
                t = best(lambda c=c, core=core: core.commit(c), 1)
                size = (wal / f"p000-v{v + 1:08d}.npz").stat().st_size
                if v == 0:
                    state_s.append(t)
                    state_bytes = size
                    disk_state.append(best(lambda size=size: raw_write(Path(d) / "raw", size), 1))
                else:
                    step_s.append(t)
                    step_bytes = size
                    disk_step.append(best(lambda size=size: raw_write(Path(d) / "raw", size), 1))
            core.close()
            shutil.rmtree(Path(d) / f"s{r}")
    out["peak_rss"] = peak_rss()
    out.update(state_s=min(state_s), state_bytes=state_bytes, disk_state_s=min(disk_state))
    out.update(wal_s=min(step_s), wal_bytes=step_bytes, disk_s=min(disk_step))
    return out


def cell(role: str, n: int, m: int, repeat: int) -> dict:
    """One role's measurements for N = n parameters and M = m contributions (run in a child process)."""
    import jax.numpy as jnp

    from dloco import compress, config, merge, outer

    jnp.zeros(1).block_until_ready()  # the runtime up before the baseline
    tiny = compress.encode(np.ones(BLOCK, np.float32), "int4", BLOCK)
    merge.merge_fragment([{"w": tiny}], [1.0])  # numba and the compiled kernels loaded before the baseline too
    out: dict = {"role": role, "params": n, "learners": m, "base_rss": current_rss()}
    rng = np.random.default_rng(0)
    theta = fragment_set(n, rng)
    ocfg = dataclasses.replace(config.OuterConfig(), lr=0.7, momentum=0.9, delay=m)  # state: momentum and buffer
    step, state = outer.make_outer_step(ocfg), outer.init(ocfg, theta)
    if role == "store":
        return store_cell(out, theta, outer.state_to_numpy(state), m, repeat, rng)
    payloads = contributions(theta, m, rng)
    weights = merge.token_weights([1000 * (i + 1) for i in range(m)], [10] * m)
    holder: dict = {}

    def screen():
        holder["norms"] = [
            {k: math.sqrt(compress.sq_norm(compress.validate(p))) for k, p in d.items()} for d in payloads
        ]

    def decoded():
        arrays = [{k: compress.decode(p) for k, p in d.items()} for d in payloads]
        norms = [merge.tensor_norms(a) for a in arrays]
        holder["grad"] = merge.merge_fragment(arrays, weights, "rda", norms=norms)

    reset_peak()  # from here on: what the role holds (Θ, outer state, the payloads) and what a commit adds
    if role == "decoded":
        out["decoded_s"] = best(decoded, repeat)
    else:
        out["screen_s"] = best(screen, repeat)
        out["merge_s"] = best(
            lambda: holder.update(grad=merge.merge_fragment(payloads, weights, "rda", norms=holder["norms"])), repeat
        )
    out["merge_peak_rss"] = peak_rss()  # what the role holds, and screen + merge on top (no outer step yet)
    step(theta, state, holder["grad"], m)  # compiled once, outside the timing
    out["outer_s"] = best(lambda: holder.update(new=step(theta, state, holder["grad"], m)[0]), repeat)
    if role == "syncer":
        new = holder["new"]
        out["publish_s"] = best(lambda: [compress.encode(new[k] - theta[k], "int4", BLOCK) for k in theta], repeat)
    out["peak_rss"] = peak_rss()
    if role == "syncer":  # merge + outer as one fused pass (`outer.make_merge_step`), on the same pushes
        fused = outer.make_merge_step(ocfg, step)

        def merge_outer():
            holder["fused"] = fused(theta, state, payloads, weights, "rda", norms=holder["norms"], contributions=m)

        merge_outer()  # compiled (or loaded) once, outside the timing
        out["fused_s"] = best(merge_outer, repeat)
    copies = {k: np.empty_like(v) for k, v in theta.items()}  # last: after the peak is read
    out["memcpy_s"] = best(lambda: [np.copyto(copies[k], v) for k, v in theta.items()], repeat)
    return out


def num(v: float | None, fmt: str, suffix: str = "") -> str:
    return "—" if v is None else f"{v:{fmt}}{suffix}"


def report(doc: dict) -> str:
    """The section of docs/RESULTS.md (`benchmarks/report.py`)."""
    lines = [
        "## The commit path at scale (`benchmarks/syncer_scale.py`)",
        "",
        f"`python benchmarks/syncer_scale.py --repeat {doc['repeat']}` on {doc['cpus']} CPU cores: one commit "
        f"merges N fp32 parameters from M int4 contributions (block {doc['block']}); best of {doc['repeat']}, "
        "seconds, per shard (each of the S shards merges N/S parameters, in its own processes). *x memcpy*: "
        "parameters merged per second by screen + merge + outer against parameters copied per second by a "
        "warm memcpy. *decoded*: merge + outer on the path before (each payload decoded to float32 first). "
        "RSS: each role's peak in its own process, less its RSS with numpy and JAX loaded, in multiples of "
        "the shard's fp32 parameters (N/S × 4 bytes): the syncer's after screen + merge, and with the outer "
        "step and publish (a commit). *commits/s*: one shard's; *contributions/s*: all S shards', M × S × "
        "commits/s.",
        "",
        "| N | S | M | memcpy | screen | merge | outer | publish | wal | commit | x memcpy | decoded | "
        "commits/s | contributions/s | RSS syncer: merge / commit | RSS decoded: merge / commit | RSS store |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        lines.append(
            f"| {r['params'] / 1e6:.0f} M | {r['shards']} | {r['learners']} | {r['memcpy_s']:.3f} | "
            f"{r['screen_s']:.3f} | {r['merge_s']:.3f} | {r['outer_s']:.3f} | {r['publish_s']:.3f} | "
            f"{r['wal_s']:.3f} | "
            f"{r['commit_s']:.3f} | {r['arith_ratio_to_memcpy']:.3f} | {num(r['decoded_merge_outer_s'], '.3f')} | "
            f"{r['commits_per_s']:.3f} | {r['contributions_per_s']:.2f} | {r['rss_syncer_merge_x_model']:.2f}× / "
            f"{r['rss_syncer_x_model']:.2f}× | {num(r['rss_decoded_merge_x_model'], '.2f', '×')} / "
            f"{num(r['rss_decoded_x_model'], '.2f', '×')} | {r['rss_store_x_model']:.2f}× |"
        )
    if any("state_s" in r for r in doc["rows"]):
        lines += [
            "",
            "The log write (`dloco.commitlog`): *wal* is the store's `commit` of a fragment whose state is on "
            "disk, which writes a step: the M int4 contributions and the published int4 q as they are, with "
            "the XXH3-128 digest of the state they produce (replayed and checked at a restart). *state* is "
            "the commit that writes the whole state instead (Θ_p, s_p, Θ̂_p in float32: the first commit "
            "after a start, one in `store.snapshot_every`, and every commit before steps existed); *disk*: "
            "plain fsynced writes of as many random bytes, in turns with each.",
            "",
            "| N | S | M | wal (step) | bytes | disk | state | bytes | disk |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in doc["rows"]:
            lines.append(
                f"| {r['params'] / 1e6:.0f} M | {r['shards']} | {r['learners']} | {r['wal_s']:.3f} | "
                f"{r['wal_bytes'] / 1e6:.0f} MB | {r['disk_s']:.3f} | {r['state_s']:.3f} | "
                f"{r['state_bytes'] / 1e6:.0f} MB | {r['disk_state_s']:.3f} |"
            )
    r0 = doc["rows"][0]
    lines += [
        "",
        "Screen and merge run in compiled kernels (`dloco.kernels`, numba): the screen reads each "
        "contribution's codes once for its norms, the merge once more, a cache-sized chunk of the sum at a time "
        "for all contributions, with ‖Σ‖² on the way (RDA's own pass over Σ is gone), and the same bits as the "
        "numpy path. The arithmetic ratio stays below the goal of 0.3 × memcpy because of memory traffic, not "
        "compute: memcpy moves 8 bytes per parameter, and the outer step with Delayed Nesterov (jitted optax) "
        "reads Θ, the momentum, the buffer and Δ and writes the first three anew (28 bytes); here it alone took "
        f"{r0['outer_s'] / r0['memcpy_s']:.1f} memcpy-times ({r0['params'] / 1e6:.0f} M, S = {r0['shards']}, "
        f"M = {r0['learners']}). A single pass that read the codes once and never stored Δ would move 28 + M/2 "
        "bytes, 8 / 30 = 0.27 at M = 4; with the default plain averaging (μ = 0: Θ is the whole state) it "
        "would be 8 / (8 + M/2) = 0.8.",
    ]
    fused = [r for r in doc["rows"] if r.get("fused_merge_outer_s") is not None]
    if fused:
        lines += [
            "",
            "That pass (`outer.make_merge_step`, `dloco.kernels.combine_outer`: the same bits as merge + outer, "
            "`tests/test_fused.py`), timed in the same syncer process: *fused* is merge + outer in it, *x memcpy* "
            "screen + fused against memcpy (`benchmarks/merge_throughput.py` has plain averaging and the mean).",
            "",
            "| N | S | M | merge + outer | fused | x memcpy: screen + merge + outer | x memcpy: screen + fused |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in fused:
            lines.append(
                f"| {r['params'] / 1e6:.0f} M | {r['shards']} | {r['learners']} | {r['merge_s'] + r['outer_s']:.3f} | "
                f"{r['fused_merge_outer_s']:.3f} | {r['arith_ratio_to_memcpy']:.3f} | "
                f"{r['arith_fused_ratio_to_memcpy']:.3f} |"
            )
    for r in doc["rows"]:
        if r.get("decoded_error"):
            where = f"{r['params'] / 1e6:.0f} M, S = {r['shards']}, M = {r['learners']}"
            lines += ["", f"Decoded path at {where}: {r['decoded_error']}."]
    return "\n".join(lines)


def run_cell(role: str, n: int, m: int, repeat: int) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--cell", role, str(n), str(m), "--repeat", str(repeat)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode == -9 and role == "decoded":  # the kernel's OOM killer: this path needs M fp32 copies
        ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
        return {"error": f"killed by SIGKILL, out of memory ({ram:.0f} GiB of RAM here)"}
    if proc.returncode != 0:
        raise RuntimeError(f"cell {role} {n} {m} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, nargs="+", default=[1e8, 3e8])
    ap.add_argument("--learners", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--shards", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="2 M parameters, M = 2 and 4 (a check that it runs)")
    ap.add_argument("--out", default="benchmarks/results/syncer_scale.json")
    ap.add_argument("--cell", nargs=3, metavar=("ROLE", "N", "M"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.cell:
        role, n, m = args.cell
        print(json.dumps(cell(role, int(float(n)), int(m), args.repeat)))
        return
    params, learners = ([2e6], [2, 4]) if args.quick else (args.params, args.learners)
    rows = []
    for n, shards in ((int(p), s) for p in params for s in args.shards):
        part = n // shards  # what one shard merges and holds
        for m in learners:
            store = run_cell("store", part, m, args.repeat)
            s, dec = run_cell("syncer", part, m, args.repeat), run_cell("decoded", part, m, args.repeat)
            model = 4 * part
            arith = s["screen_s"] + s["merge_s"] + s["outer_s"]
            commit = arith + s["publish_s"] + store["wal_s"]
            row = {
                "params": n,
                "shard_params": part,
                **{k: s[k] for k in ("learners", "memcpy_s", "screen_s", "merge_s", "outer_s", "publish_s")},
                "wal_s": store["wal_s"],
                "wal_bytes": store["wal_bytes"],
                "disk_s": store["disk_s"],
                "state_s": store["state_s"],
                "state_bytes": store["state_bytes"],
                "disk_state_s": store["disk_state_s"],
                "commit_s": commit,
                "arith_ratio_to_memcpy": s["memcpy_s"] / arith,
                "fused_merge_outer_s": s["fused_s"],  # merge + outer as one pass (`outer.make_merge_step`)
                "arith_fused_ratio_to_memcpy": s["memcpy_s"] / (s["screen_s"] + s["fused_s"]),
                "decoded_merge_outer_s": None if "error" in dec else dec["decoded_s"] + dec["outer_s"],
                "decoded_error": dec.get("error"),
                "commits_per_s": 1 / commit,
                "contributions_per_s": shards * m / commit,
                "rss_syncer_x_model": (s["peak_rss"] - s["base_rss"]) / model,
                "rss_syncer_merge_x_model": (s["merge_peak_rss"] - s["base_rss"]) / model,
                "rss_decoded_merge_x_model": None
                if "error" in dec
                else (dec["merge_peak_rss"] - dec["base_rss"]) / model,
                "rss_decoded_x_model": None if "error" in dec else (dec["peak_rss"] - dec["base_rss"]) / model,
                "rss_store_x_model": (store["peak_rss"] - store["base_rss"]) / model,
                "shards": shards,
            }
            rows.append(row)
            print(f"{n / 1e6:.0f} M parameters, S = {shards}, M = {m}: commit {commit:.3f} s", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "repeat": args.repeat}
    out.write_text(json.dumps({**meta, "block": BLOCK, "tensor": TENSOR, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")
    print(report(json.loads(out.read_text())))


if __name__ == "__main__":
    main()
