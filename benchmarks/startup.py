"""Start-up of `dloco train`: seconds from the command to each stage of a run, cold and warm.

Each measurement runs the CLI as a user would (a new process, a new local Ray cluster) on the
built-in defaults, with a step budget so that every learner trains past its first merge, and reads
the run's ``metrics.jsonl``: when the store and the syncer were up (``store_start``,
``syncer_start``), when the first learner registered (``learner_start``: its train step is
compiled by then, so it is the first trained step to within one step) and when the first merge
committed, each counted from the moment the command was started, plus the command's whole wall
time. *cold*: an empty JAX compilation cache (`learners.compile_cache_dir`); *warm*: the same
cache again. The tokenized corpus is prepared by an unrecorded run first, so neither row pays for
it. ``--dloco`` runs another checkout's CLI (e.g. a worktree of an older commit) for a
before/after table from one sitting; ``--label`` names its rows.

    python benchmarks/startup.py --repeat 2                       # this checkout
    python benchmarks/startup.py --dloco /tmp/old/.venv/bin/dloco --label before

Rows are merged into ``benchmarks/results/startup.json`` by label (the other labels are kept).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "startup.json"
STAGES = ("store_start", "syncer_start", "learner_start", "merge")
BUDGET = ("budget.tokens=0", "budget.steps=40", "metrics.eval_every_s=1000")


def run_once(dloco: str, cache: Path, extra: list[str]) -> dict:
    """One `dloco train`; seconds from the command's start to the first event of each stage."""
    run_dir = Path(tempfile.mkdtemp(prefix="dloco-startup-"))
    sets = [*BUDGET, f"learners.compile_cache_dir={cache}", *extra]
    cmd = [dloco, "train", "--quiet", "--run-dir", str(run_dir / "run")]
    for s in sets:
        cmd += ["--set", s]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.time() - t0
    try:
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()[-400:]}")
        firsts: dict[str, float] = {}
        for line in (run_dir / "run" / "metrics.jsonl").read_text().splitlines():
            e = json.loads(line)
            if e.get("event") in STAGES and "time" in e:
                firsts.setdefault(e["event"], e["time"] - t0)
        return {**{k: firsts.get(k) for k in STAGES}, "wall_s": wall}
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def measure(dloco: str, repeat: int, extra: list[str]) -> dict[str, list[dict]]:
    """`repeat` (cold, warm) pairs, each cold one on a new empty compilation cache."""
    scratch = Path(tempfile.mkdtemp(prefix="dloco-startup-cache-"))
    run_once(dloco, scratch / "prepare", extra)  # the corpus cache, so that no row tokenizes
    rows: dict[str, list[dict]] = {"cold": [], "warm": []}
    for i in range(repeat):
        cache = scratch / f"jax-{i}"
        for kind in ("cold", "warm"):
            r = run_once(dloco, cache, extra)
            rows[kind].append(r)
            print(f"  {kind} {i + 1}/{repeat}: " + ", ".join(f"{k} {fmt(v)}" for k, v in r.items()), flush=True)
    shutil.rmtree(scratch, ignore_errors=True)
    return rows


def fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f} s"


def median(rows: list[dict], key: str) -> float | None:
    xs = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(xs) if xs else None


def table(results: dict) -> str:
    head = "| label | cache | store up | syncer up | first learner registered | first merge | wall (40 steps) |"
    lines = [head, "|" + "---|" * 7]
    for label, by in results.items():
        for kind in ("cold", "warm"):
            rows = by["rows"][kind]
            cells = [fmt(median(rows, k)) for k in (*STAGES, "wall_s")]
            lines.append(f"| {label} | {kind} ({len(rows)}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(results: dict) -> str:
    """The RESULTS.md section (`benchmarks/report.py`)."""
    any_row = next(iter(results.values()))
    return "\n".join(
        [
            "## Start-up (`benchmarks/startup.py`)",
            "",
            "Seconds from the `dloco train` command to each stage (median over the pairs in parentheses), on "
            f"{any_row['cores']} cores, the built-in defaults with `{' '.join(any_row['sets'])}`: the store "
            "and the syncer constructed, the first learner registered, the first merge committed, and the "
            "command's whole wall time. Since the start-up change a learner registers with its train step "
            "compiled, so its first step follows at once; before it, a learner registered first and compiled "
            "on its first step, so *before* rows' registration comes earlier than their first step. *cold*: an "
            "empty JAX compilation cache; *warm*: the same cache on the next run. Rows of other labels ran "
            "another checkout's CLI in the same sitting, one pair each: single runs on a shared 2-core machine, "
            "so differences of a few seconds are noise.",
            "",
            table(results),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dloco", default=str(Path(sys.executable).with_name("dloco")), help="the CLI to run")
    ap.add_argument("--label", default="this checkout")
    ap.add_argument("--repeat", type=int, default=2, help="(cold, warm) pairs")
    ap.add_argument("--set", action="append", default=[], help="extra dotted overrides")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    print(f"start-up of {args.dloco} ({args.label}), {args.repeat} cold/warm pairs on {os.cpu_count()} cores")
    rows = measure(args.dloco, args.repeat, args.set)
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    results[args.label] = {"dloco": args.dloco, "sets": [*BUDGET, *args.set], "cores": os.cpu_count(), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
