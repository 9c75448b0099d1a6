"""Wire accounting (ALGORITHM.md §7): exact bytes per token in each direction, from payload sizes.

For every algorithm, wire dtype and publish mode, the bytes one learner sends (learner → syncer) and
receives (syncer → learner) per inner step are the exact `Payload.nbytes` of the model's fragments
(real `dloco.compress.encode` calls on arrays of each tensor's shape: codes, padding and fp16
scales included), divided by H; per token, divided by the tokens of one learner step. The
reference is fp32 data-parallel with a ring all-reduce: about 2 × 4 bytes per parameter per step
per learner (sent plus received). Pickled metadata (a few hundred bytes per push) is left out.

Usage:  python benchmarks/bandwidth.py [--preset small] [--out PATH]
Writes  benchmarks/results/bandwidth.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dloco import build, compress, config  # noqa: E402


def fragment_bytes(shapes: list[tuple[int, ...]], dtype: str, block: int) -> int:
    return sum(compress.encode(np.zeros(s, np.float32), dtype, block).nbytes for s in shapes)


def table(preset: str) -> dict:
    cfg = config.load(overrides=[f"preset={preset}"])
    bp = build.blueprint(cfg)
    shapes = [s for f in bp.plan.fragments for s in f.shapes]
    n = sum(int(np.prod(s)) for s in shapes)
    tokens = cfg.inner.batch_size * cfg.data.seq_len
    ring = 2 * 4 * n  # bytes per learner per step
    rows = [{"algorithm": "dp (ring all-reduce reference)", "H": 1, "up": 4 * n, "down": 4 * n}]
    rows.append(
        {"algorithm": "dp (this engine: fp32 gradient up, fp32 model down)", "H": 1, "up": 4 * n, "down": 4 * n}
    )
    block = cfg.compression.block
    size = {d: fragment_bytes(shapes, d, block) for d in compress.DTYPES}  # bytes of the whole model, per dtype
    for algo in ("diloco", "streaming", "decoupled"):
        for H in (24, 48, 96):
            for dtype in ("fp32", "bf16", "int8", "int4", "int2"):
                for publish in ("full", "delta"):
                    if algo != "decoupled" and (dtype not in ("fp32", "int4") or H != 24):
                        continue
                    up = size[dtype] / H
                    down = (size["fp32"] if publish == "full" else size["int4"]) / H
                    rows.append({"algorithm": algo, "H": H, "dtype": dtype, "publish": publish, "up": up, "down": down})
    for r in rows:
        r["up_per_token"], r["down_per_token"] = r["up"] / tokens, r["down"] / tokens
        r["ratio_to_dp"] = ring / (r["up"] + r["down"])
    return {"preset": preset, "params": n, "tokens_per_step": tokens, "block": block, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--out", default="benchmarks/results/bandwidth.json")
    a = ap.parse_args(argv)
    t = table(a.preset)
    print(f"preset {t['preset']}: {t['params']:,} parameters, {t['tokens_per_step']} tokens per learner step")
    print(f"{'algorithm':52s} {'H':>3s} {'up':>5s} {'pub':>5s} {'B/token up':>11s} {'down':>9s} {'× dp':>8s}")
    for r in t["rows"]:
        print(
            f"{r['algorithm']:52s} {r['H']:3d} {r.get('dtype', 'fp32'):>5s} {r.get('publish', 'full'):>5s} "
            f"{r['up_per_token']:11.3f} {r['down_per_token']:9.3f} {r['ratio_to_dp']:8.1f}"
        )
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(t, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
