"""Merge throughput: RDA merge + outer Nesterov step, and int4 encode/decode, vs numpy copy.

All rates are measured in one run, side by side, on the same arrays (this machine is noisy):

  copy      np.copyto of the fragment set                    GB/s of fp32 parameters copied
  merge     merge_fragment (RDA, M contributions)            GB/s of fp32 parameters produced
            + outer_step (optax Nesterov SGD)                and of contribution bytes read
  int4 enc  compress.encode(x, "int4")                       GB/s of fp32 input
  int4 dec  compress.decode(payload)                         GB/s of fp32 output
  packed    the syncer's path on M int4 payloads, side by side: Σ c_m decode(p_m) and Σ_m ‖p_m‖² by
            numpy passes over cache-sized chunks against the compiled kernels (`dloco.kernels`)
  fused     the syncer's commit on M int4 payloads (norms from the screen, `compress.sq_norm`), for
            plain averaging (η 1, μ 0) and Delayed Nesterov (η 0.7, μ 0.9, N = M: every commit moves
            the momentum), rules mean and RDA: today's path (`merge.merge_fragment`, then the jitted
            step of `outer.make_outer_step`) against the fused pass (`outer.make_merge_step`), timed in
            turns; and RDA with Δ materialized (`merge_fragment`, then numpy's Θ − Δ: the cheapest
            update on a stored Δ), the floor for fused RDA (its sum is stored for the norm too)
  syncer    `benchmarks/syncer_scale.py`'s syncer cell in a process of its own (random int4 codes,
            RDA, Delayed Nesterov): screen + merge + outer, today's path and fused, against its memcpy

Usage:  python benchmarks/merge_throughput.py [--params 100e6] [--learners 4] [--repeat 3] [--no-syncer-cell]
Writes  benchmarks/results/merge_throughput.json (`report` renders its docs/RESULTS.md section)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

from dloco import compress, config, merge, outer  # noqa: E402


def fragment_set(n_params: int, tensor: int, rng: np.random.Generator, scale: float = 1.0) -> dict[str, np.ndarray]:
    out, left, i = {}, n_params, 0
    while left > 0:
        k = min(tensor, left)
        out[f"t{i:04d}"] = rng.standard_normal(k, dtype=np.float32) * np.float32(scale)
        left, i = left - k, i + 1
    return out


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


FUSED_CONFIGS = {"plain averaging": {}, "Delayed Nesterov": {"lr": 0.7, "momentum": 0.9}}


def fused_rows(theta: dict, packed: list[dict], weights: np.ndarray, m: int, repeat: int) -> list[tuple[str, float]]:
    """(operation, best seconds) of the syncer's commit on M packed pushes: today's path and the fused
    pass for each outer optimizer and merge rule, timed in turns (the machine's noise falls on both),
    and RDA with Δ materialized and applied by numpy (plain averaging: Θ − Δ)."""
    norms = [{k: math.sqrt(compress.sq_norm(q)) for k, q in pm.items()} for pm in packed]  # the screen's
    out = [
        (
            f"screen: ‖δ_m‖ from the codes (M={m})",
            best(lambda: [compress.sq_norm(q) for pm in packed for q in pm.values()], repeat),
        )
    ]
    for label, kw in FUSED_CONFIGS.items():
        ocfg = config.OuterConfig(**kw, delay=m if kw else 0)  # N = M: with n = M every commit fires
        step = outer.make_outer_step(ocfg)
        fused = outer.make_merge_step(ocfg, step)
        for rule in ("mean", "rda"):
            held = {"today": (theta, outer.init(ocfg, theta)), "fused": (theta, outer.init(ocfg, theta))}

            def today(rule=rule, step=step, held=held):
                d = merge.merge_fragment(packed, weights, rule, norms=norms)
                held["today"] = step(*held["today"], d, m)

            def one_pass(rule=rule, fused=fused, held=held):
                held["fused"] = fused(*held["fused"], packed, weights, rule, norms=norms, contributions=m)

            today(), one_pass()  # compiled (or loaded) once, outside the timing
            times: dict[str, list[float]] = {"today": [], "fused": []}
            for _ in range(repeat):
                times["today"].append(best(today, 1))
                times["fused"].append(best(one_pass, 1))
            out += [
                (f"{label}, {rule}: merge + outer step", min(times["today"])),
                (f"{label}, {rule}: fused", min(times["fused"])),
            ]
    held_theta = {"theta": theta}

    def materialized():  # Δ stored (with ‖Σ‖² on the way), then one numpy pass Θ − Δ
        d = merge.merge_fragment(packed, weights, "rda", norms=norms)
        held_theta["theta"] = {k: np.subtract(v, d[k]) for k, v in held_theta["theta"].items()}

    materialized()
    out.append(("plain averaging, rda: Δ materialized, numpy Θ − Δ", best(materialized, repeat)))
    return out


def report(doc: dict) -> str:
    """The section of docs/RESULTS.md: the syncer's commit on packed pushes, today's path and fused."""
    t = {r["operation"]: r for r in doc["results"]}
    m = doc["learners"]
    copy = t["numpy copy"]["seconds"]
    screen = t[f"screen: ‖δ_m‖ from the codes (M={m})"]["seconds"]
    lines = [
        "## The fused merge + outer pass (`benchmarks/merge_throughput.py`)",
        "",
        f"`python benchmarks/merge_throughput.py --params {doc['params'] / 1e6:g}e6 --learners {m} "
        f"--repeat {doc['repeat']}` "
        f"on {doc['cpus']} CPU cores: one commit of {doc['params'] / 1e6:.0f} M fp32 parameters ({doc['tensors']} "
        f"tensors) from M = {m} int4 pushes (block 128), norms from the screen; best of {doc['repeat']}, seconds, "
        "today's path and the fused pass timed in turns in one process. *x memcpy*: parameters per second against "
        f"a warm np.copyto of the fragment set ({copy:.3f} s). *+ screen*: with the screen's read of the codes "
        f"for the norms ({screen:.3f} s), as the syncer commits. Delayed Nesterov: η 0.7, μ 0.9, N = M (every "
        "commit moves the momentum).",
        "",
        "| outer step | rule | today: merge + outer | x memcpy | fused | x memcpy | + screen: today | + screen: fused "
        "|",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label in FUSED_CONFIGS:
        for rule in ("mean", "rda"):
            a, b = t[f"{label}, {rule}: merge + outer step"]["seconds"], t[f"{label}, {rule}: fused"]["seconds"]
            lines.append(
                f"| {label} | {rule} | {a:.3f} | {copy / a:.2f} | {b:.3f} | {copy / b:.2f} | "
                f"{copy / (a + screen):.2f} | {copy / (b + screen):.2f} |"
            )
    mat = t["plain averaging, rda: Δ materialized, numpy Θ − Δ"]["seconds"]
    fused_rda = t["plain averaging, rda: fused"]["seconds"]
    lines += [
        "",
        "RDA needs ‖Σ w̃_m unit(δ_m)‖ before it can scale, so its fused pass is two: the merge writes Σ, with ‖Σ‖² "
        "on the way, into the array that becomes Θ', and the update scales it and applies the step in place (a "
        "version that read the codes twice, the first time for ‖Σ‖² alone, was slower: decoding M int4 pushes "
        "costs more than writing Σ and reading it back). Against the cheapest update of a stored Δ (today's "
        f"merge, then numpy's Θ − Δ: {mat:.3f} s), fused RDA took {fused_rda:.3f} s (plain averaging).",
    ]
    cell = doc.get("syncer_cell")
    if cell:
        unfused = cell["screen_s"] + cell["merge_s"] + cell["outer_s"]
        fused = cell["screen_s"] + cell["fused_s"]
        lines += [
            "",
            f"`benchmarks/syncer_scale.py`'s syncer cell (random int4 codes, RDA, Delayed Nesterov, N = M = {m}, "
            f"{cell['params'] / 1e6:.0f} M parameters, its own process): screen + merge + outer {unfused:.3f} s "
            f"({cell['memcpy_s'] / unfused:.3f} x memcpy), fused {fused:.3f} s ({cell['memcpy_s'] / fused:.3f} x "
            f"memcpy; memcpy {cell['memcpy_s']:.3f} s).",
        ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=100e6, help="parameters in the fragment set")
    ap.add_argument("--tensor", type=int, default=4_000_000, help="parameters per tensor")
    ap.add_argument("--learners", type=int, default=4, help="contributions merged (M)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/merge_throughput.json")
    ap.add_argument(
        "--no-syncer-cell", dest="syncer_cell", action="store_false", help="skip syncer_scale.py's syncer cell"
    )
    args = ap.parse_args()
    n = int(args.params)
    rng = np.random.default_rng(0)
    theta = fragment_set(n, args.tensor, rng)
    deltas = [fragment_set(n, args.tensor, rng, 1e-3) for _ in range(args.learners)]
    weights = merge.token_weights([1000 * (m + 1) for m in range(args.learners)], [10] * args.learners)
    ocfg = config.OuterConfig()
    step, state = outer.make_outer_step(ocfg), outer.init(ocfg, theta)
    gb = n * 4 / 1e9

    dst = {k: np.empty_like(v) for k, v in theta.items()}
    t_copy = best(lambda: [np.copyto(dst[k], v) for k, v in theta.items()], args.repeat)

    holder = {"theta": theta, "state": state}

    def do_merge():
        d = merge.merge_fragment(deltas, weights, rule="rda")
        holder["theta"], holder["state"] = step(holder["theta"], holder["state"], d)

    norms = [merge.tensor_norms(d) for d in deltas]

    def do_merge_syncer():  # the syncer's path: per-tensor norms come from validating each contribution
        d = merge.merge_fragment(deltas, weights, rule="rda", norms=norms)
        holder["theta"], holder["state"] = step(holder["theta"], holder["state"], d)

    do_merge()  # compile the outer step once
    t_merge = best(do_merge, args.repeat)
    t_merge_syncer = best(do_merge_syncer, args.repeat)
    t_rda = best(lambda: merge.merge_fragment(deltas, weights, rule="rda"), args.repeat)
    t_rda_norms = best(lambda: merge.merge_fragment(deltas, weights, rule="rda", norms=norms), args.repeat)
    d = merge.merge_fragment(deltas, weights, rule="rda")
    t_outer = best(lambda: step(holder["theta"], holder["state"], d), args.repeat)
    x = deltas[0]
    payloads = {}
    t_enc = best(lambda: payloads.update({k: compress.encode(v, "int4") for k, v in x.items()}), args.repeat)
    t_dec = best(lambda: [compress.decode(p) for p in payloads.values()], args.repeat)
    wire = sum(p.nbytes for p in payloads.values())
    packed = [{k: compress.encode(v, "int4") for k, v in dm.items()} for dm in deltas]
    coefs = list(weights / weights.sum())

    def weighted_sum(combine):
        return [combine([pm[k] for pm in packed], coefs) for k in theta]

    b = np.arange(256)
    lut = (((b & 15) - 8) ** 2 + ((b >> 4) - 8) ** 2).astype(np.uint8)  # Σ q² of the two codes in each byte

    def sq_norms_numpy():  # Σ q² per byte gathered from the table, chunk by chunk (the path before the kernel)
        total = 0.0
        for pm in packed:
            for q in pm.values():
                codes, s2 = q.data.reshape(-1, q.block // 2), np.square(q.scales.astype(np.float64))
                for i in range(0, codes.shape[0], 1024):
                    q2 = np.take(lut, codes[i : i + 1024]).sum(axis=1, dtype=np.uint64)
                    total += float(np.dot(q2.astype(np.float64), s2[i : i + 1024]))
        return total

    weighted_sum(merge._combine)  # compile (or load) the kernels once
    t_sum_np = best(lambda: weighted_sum(merge._combine_chunks), args.repeat)
    t_sum_k = best(lambda: weighted_sum(merge._combine), args.repeat)
    t_sq_np = best(sq_norms_numpy, args.repeat)
    t_sq_k = best(lambda: [compress.sq_norm(q) for pm in packed for q in pm.values()], args.repeat)

    fused = fused_rows(theta, packed, weights, args.learners, args.repeat)
    t_copy = min(t_copy, best(lambda: [np.copyto(dst[k], v) for k, v in theta.items()], args.repeat))
    copy_bw = gb / t_copy
    rows = [
        ("numpy copy", t_copy, gb / t_copy, None),
        (f"RDA merge (M={args.learners}) + outer step", t_merge, gb / t_merge, args.learners * gb / t_merge),
        (
            "RDA merge, norms from validation + outer",
            t_merge_syncer,
            gb / t_merge_syncer,
            args.learners * gb / t_merge_syncer,
        ),
        (f"RDA merge only (M={args.learners})", t_rda, gb / t_rda, args.learners * gb / t_rda),
        (
            f"RDA merge, norms from validation (M={args.learners})",
            t_rda_norms,
            gb / t_rda_norms,
            args.learners * gb / t_rda_norms,
        ),
        ("outer step only", t_outer, gb / t_outer, None),
        ("int4 encode", t_enc, gb / t_enc, None),
        ("int4 decode", t_dec, gb / t_dec, None),
        (f"int4 Σ c_m p_m (M={args.learners}), numpy chunks", t_sum_np, gb / t_sum_np, args.learners * gb / t_sum_np),
        (f"int4 Σ c_m p_m (M={args.learners}), kernel", t_sum_k, gb / t_sum_k, args.learners * gb / t_sum_k),
        (f"int4 ‖p_m‖² (M={args.learners}), numpy table", t_sq_np, gb / t_sq_np, args.learners * gb / t_sq_np),
        (f"int4 ‖p_m‖² (M={args.learners}), kernel", t_sq_k, gb / t_sq_k, args.learners * gb / t_sq_k),
    ]
    print(
        f"fragment set: {n / 1e6:.0f}M fp32 parameters ({gb:.2f} GB), {len(theta)} tensors; "
        f"int4 wire size {wire / 1e6:.1f} MB ({wire / (n * 4):.4f} of fp32)"
    )
    rows += [(name, t, gb / t, None) for name, t in fused]
    print(f"{'operation':44s} {'seconds':>8s} {'GB/s params':>12s} {'x copy':>7s} {'GB/s inputs':>12s} {'x copy':>7s}")
    results = []
    for name, t, bw, in_bw in rows:
        ratio = bw / copy_bw
        in_txt = f"{in_bw:12.2f} {in_bw / copy_bw:7.2f}" if in_bw else f"{'':12s} {'':7s}"
        print(f"{name:44s} {t:8.3f} {bw:12.2f} {ratio:7.2f} {in_txt}")
        results.append(
            {
                "operation": name,
                "seconds": t,
                "gbps_params": bw,
                "ratio_to_copy": ratio,
                "gbps_inputs": in_bw,
                "inputs_ratio_to_copy": in_bw / copy_bw if in_bw else None,
            }
        )
    doc = {
        "params": n,
        "learners": args.learners,
        "repeat": args.repeat,
        "tensors": len(theta),
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "int4_wire_bytes": wire,
        "results": results,
    }
    if args.syncer_cell:
        del theta, deltas, packed, payloads, holder, dst, d, x  # the cell's process needs the memory
        import syncer_scale

        cell = syncer_scale.run_cell("syncer", n, args.learners, args.repeat)
        doc["syncer_cell"] = cell
        today, fused = cell["screen_s"] + cell["merge_s"] + cell["outer_s"], cell["screen_s"] + cell["fused_s"]
        print(
            f"syncer cell: memcpy {cell['memcpy_s']:.3f} s; screen + merge + outer {today:.3f} s, fused {fused:.3f} s"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}")
    print(report(doc))


if __name__ == "__main__":
    main()
