"""Scale simulator vs the paper's Table 1: goodput % at per-chip MTBI = 1 year, 150k to 2.4M chips.

The model (`dloco.goodput`) has four free constants: the interruption notice W, dp's fixed
restart F, dp's lost progress L and the mean recovery time E[R]. They are fitted by least squares
on the dp and elastic_dp rows only (`calibrate`); the Decoupled rows (M = 2..16 learners, quorum
1) are predictions with the same constants. Every cell is also simulated (exact event simulation
with `--events` interruptions fleet-wide, seeded) to check the closed form. Two ablations: the
same fit without the notice window (W = 0), and the predictions' sensitivity to the work a learner
loses per interruption (`sync_lost_s`, ℓ; the calibrated model has ℓ = 0).

Usage:  python benchmarks/goodput_sim.py [--quick] [--events 100000] [--seed 0] [--out PATH]
Writes  benchmarks/results/goodput_sim.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dloco import goodput  # noqa: E402

TOLERANCE = 3.0  # percentage points: the calibration target for every cell


def label(chips: int) -> str:
    return f"{chips / 1e6:g}M" if chips >= 1_000_000 else f"{chips // 1000}k"


def algorithm_of(row: str) -> tuple[str, int]:
    return (row, 1) if row in goodput.CALIBRATION_ROWS else ("decoupled", int(row.removeprefix("M=")))


def max_diff(p: goodput.FleetParams, rows) -> float:
    g = goodput.grid(p, goodput.PAPER_CHIPS, rows)
    return float(max(abs(100 * v - t) for r in rows for v, t in zip(g[r], goodput.PAPER_TABLE1[r], strict=True)))


def diagonals(chips, table: dict) -> dict:
    """The paper's cells grouped by chips per learner (elastic_dp as one learner of all chips).

    The closed form depends on chips per learner only (decoupled learners fail independently, at a
    rate ∝ their chips, and never wait for each other), so it is constant along each group; the
    paper's cells in a group show how much its own numbers move at equal chips per learner (its
    simulation noise and integer rounding) and whether they trend with the total scale."""
    groups: dict[int, list[dict]] = {}
    for row, t in table.items():
        if row == "dp":
            continue
        m = 1 if row == "elastic_dp" else int(row.removeprefix("M="))
        for n, paper, ours in zip(chips, t["paper"], t["model"], strict=True):
            groups.setdefault(n // m, []).append({"row": row, "chips": n, "paper": paper, "ours": ours})
    out = {}
    for per, cells in sorted(groups.items(), reverse=True):
        if len(cells) >= 3:
            cells.sort(key=lambda c: c["chips"])
            vals = [c["paper"] for c in cells]
            out[str(per)] = {"cells": cells, "spread": max(vals) - min(vals), "ours": cells[0]["ours"]}
    largest = chips[-1]
    at_largest = {row: t["paper"][-1] - t["model"][-1] for row, t in table.items()}
    return {"groups": out, "paper_minus_ours_at_largest": at_largest, "largest": largest}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer simulated interruptions per cell (5000)")
    ap.add_argument("--events", type=int, default=100_000, help="simulated interruptions per cell, fleet-wide")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/goodput_sim.json")
    args = ap.parse_args()
    events = min(args.events, 5000) if args.quick else args.events
    t0 = time.perf_counter()

    cal = goodput.calibrate()
    p = cal.params
    chips, rows = goodput.PAPER_CHIPS, tuple(goodput.PAPER_TABLE1)
    predictions = [r for r in rows if r not in goodput.CALIBRATION_ROWS]
    model = goodput.grid(p, chips, rows)
    table, sim_gap = {}, 0.0
    for row in rows:
        algo, m = algorithm_of(row)
        sims = [goodput.simulate(p, algo, n, m, events=events, seed=args.seed) for n in chips]
        ups = [goodput.expected(p, algo, n, m).uptime for n in chips]
        ours = [100 * v for v in model[row]]
        paper = list(goodput.PAPER_TABLE1[row])
        table[row] = {
            "role": "calibration" if row in goodput.CALIBRATION_ROWS else "prediction",
            "model": ours,
            "paper": paper,
            "diff": [a - b for a, b in zip(ours, paper, strict=True)],
            "simulated": [100 * s.goodput for s in sims],
            "uptime": ups,
            "simulated_uptime": [s.uptime for s in sims],
        }
        sim_gap = max(sim_gap, *(abs(a - 100 * s.goodput) for a, s in zip(ours, sims, strict=True)))
    cal_max = max(abs(d) for r in goodput.CALIBRATION_ROWS for d in table[r]["diff"])
    pred_max = max(abs(d) for r in predictions for d in table[r]["diff"])
    misses = [
        {"row": r, "chips": n, "diff": d}
        for r in rows
        for n, d in zip(chips, table[r]["diff"], strict=True)
        if abs(d) > TOLERANCE
    ]

    no_notice = goodput.calibrate(replace(p, notice_s=0.0), fit_notice=False)
    ablation = {
        "no_notice": {
            "fitted": asdict(no_notice.params),
            "calibration_max_abs_diff": no_notice.max_abs_diff,
            "prediction_max_abs_diff": max_diff(no_notice.params, predictions),
        },
        "prediction_max_abs_diff_by_sync_lost_s": {
            str(ell): max_diff(replace(p, sync_lost_s=ell), predictions) for ell in (0.0, 1.0, 2.5, 5.0)
        },
    }
    seconds = time.perf_counter() - t0

    r = p.recovery
    print(f"Table 1 goodput % at per-chip MTBI = {p.mtbi_s / goodput.YEAR_S:g} year: ours / paper / diff")
    print(f"{'row':11s}" + "".join(f"{label(n):>19s}" for n in chips) + "   max|diff|  role")
    for row in rows:
        t = table[row]
        cells = "".join(f"{a:8.1f} {b:3d} {d:+6.1f}" for a, b, d in zip(t["model"], t["paper"], t["diff"], strict=True))
        print(f"{row:11s}{cells}{max(abs(d) for d in t['diff']):10.1f}  {t['role']}")
    print(
        f"fitted on dp + elastic_dp: notice W = {p.notice_s:.2f} s, dp restart F = {p.restart_s:.2f} s, "
        f"dp lost progress L = {p.lost_s:.2f} s, E[R] = {r.mean:.2f} s "
        f"({1 - r.long_frac:.0%} short ~{r.short_s:.2f} s, {r.long_frac:.0%} long ~{r.long_s:.1f} s)"
    )
    print(
        f"fixed: rejoin J = {p.rejoin_s:g} s, learner lost work ℓ = {p.sync_lost_s:g} s, "
        f"slice = {p.slice_chips} chips, MTBI = {p.mtbi_s:.0f} s"
    )
    print(f"max |diff|: calibration rows {cal_max:.2f} pts (rms {cal.rms_diff:.2f}), predictions {pred_max:.2f} pts")
    missed = ", ".join(f"{m['row']} @ {label(m['chips'])} {m['diff']:+.1f}" for m in misses)
    print(f"cells beyond ±{TOLERANCE:g}: {missed or 'none'}")
    print(
        f"ablation W = 0: calibration {no_notice.max_abs_diff:.2f}, prediction "
        f"{ablation['no_notice']['prediction_max_abs_diff']:.2f} pts; prediction max |diff| by ℓ: "
        + ", ".join(f"{k} s: {v:.1f}" for k, v in ablation["prediction_max_abs_diff_by_sync_lost_s"].items())
    )
    print(f"event simulation ({events} interruptions per cell) vs closed form: max |diff| {sim_gap:.2f} pts")
    diag = diagonals(chips, table)
    print("the paper's cells at equal chips per learner (ours is one value per group):")
    for per, g in diag["groups"].items():
        cells = ", ".join(f"{c['row']} @ {label(c['chips'])} {c['paper']}" for c in g["cells"])
        print(f"  {int(per) / 1e3:g}k per learner, ours {g['ours']:.1f}: {cells} (spread {g['spread']})")
    signs = ", ".join(f"{r} {d:+.1f}" for r, d in diag["paper_minus_ours_at_largest"].items())
    print(f"paper − ours at {label(diag['largest'])}: {signs}")
    print(f"took {seconds:.2f} s")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "chips": list(chips),
        "rows": table,
        "fitted": asdict(p),
        "recovery_mean_s": r.mean,
        "calibration_rows": list(goodput.CALIBRATION_ROWS),
        "max_abs_diff": {"calibration": cal_max, "prediction": pred_max},
        "calibration_rms_diff": cal.rms_diff,
        "tolerance": TOLERANCE,
        "misses": misses,
        "ablation": ablation,
        "simulation": {"events_per_cell": events, "seed": args.seed, "max_abs_diff_points": sim_gap},
        "diagonals": diag,
        "seconds": seconds,
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "numpy": np.__version__,
    }
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
