"""Wire accounting (ALGORITHM.md §7): exact bytes per token in each direction, from payload sizes, and
what lossless entropy coding (`compression.entropy: zstd`) saves on the bytes real training sends.

**Closed form** (`table`, ``rows``). For every algorithm, wire dtype and publish mode, the bytes one
learner sends (learner → syncer) and receives (syncer → learner) per inner step are the exact
`Payload.nbytes` of the model's fragments (real `dloco.compress.encode` calls on arrays of each
tensor's shape: codes, padding and fp16 scales included), divided by H; per token, divided by the
tokens of one learner step. The reference is fp32 data-parallel with a ring all-reduce: about 2 × 4
bytes per parameter per step per learner (sent plus received). Pickled metadata (a few hundred bytes
per push) is left out. Entropy coding depends on the values, so it has no closed form.

**Measured** (`measure`, ``entropy.runs``). The regime of `benchmarks/quality.py`'s default rung
(decoupled + DyLU, int4 pushes, int4 `publish: delta`, M = 4 learners of the `mini` model at H = 24,
1920 steps each, seed 0; `--quick`: 240 steps), trained twice in process (`dloco.sim`), with
``compression.entropy`` none and zstd. The bytes are those the learners' services counted as sent and
received: `Payload.nbytes` of what went on the transport, a zstd frame's header and checksum included.
The ratio to fp32 dp is 8·n·S·M over the bytes of all M learners (as `benchmarks/report.py` computes
it for the quality runs). Entropy coding is lossless, so both runs must train the same model bit for
bit: the same eval loss, to the last digit.

**Levels and layouts** (``entropy.levels``, ``entropy.layouts``, ``entropy.synthetic``). On the int4
codes that the first run sent (pushes and published deltas, as they travelled), zstd at levels −1, 1,
3, 9 and 19: bytes of the frames over the raw codes (a frame that is not smaller is not sent),
compression and decompression MB/s of codes on one core (best of 3). At level 1, other layouts of the
same codes: one code per byte, bit planes, codes and scales in one frame; and the order-0 entropy
of the codes (the bound for a coder that looks at one code at a time). The same for synthetic
Gaussian, Laplace and Student-t(3) values in each wire dtype.

Usage:  python benchmarks/bandwidth.py [--preset small] [--quick] [--out PATH]
Writes  benchmarks/results/bandwidth.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import quality  # noqa: E402  (sets JAX_PLATFORMS=cpu before jax loads)
import zstandard  # noqa: E402

from dloco import build, compress, config, entropy  # noqa: E402

LEVELS = (-1, 1, 3, 9, 19)
FULL_STEPS, QUICK_STEPS = 1920, 240


def fragment_bytes(shapes: list[tuple[int, ...]], dtype: str, block: int) -> int:
    return sum(compress.encode(np.zeros(s, np.float32), dtype, block).nbytes for s in shapes)


def table(preset: str) -> dict:
    cfg = config.load(overrides=[f"preset={preset}"])
    bp = build.blueprint(cfg)
    shapes = [s for f in bp.plan.fragments for s in f.shapes]
    n = sum(int(np.prod(s)) for s in shapes)
    tokens = cfg.inner.batch_size * cfg.data.seq_len
    ring = 2 * 4 * n  # bytes per learner per step
    rows: list[dict[str, Any]] = [{"algorithm": "dp (ring all-reduce reference)", "H": 1, "up": 4 * n, "down": 4 * n}]
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


# ---- measured: real training with and without zstd ---------------------------------------------


@contextlib.contextmanager
def recording(sent: list[tuple[int, dict]]) -> Iterator[None]:
    """Records every dict of payloads put on a `dloco.sim.SimTransport` (pushes and published deltas,
    as they travel) with the transport's owner; the class is restored afterwards."""
    from dloco import sim

    put = sim.SimTransport.put

    def record(self, obj):
        if isinstance(obj, dict) and obj and all(isinstance(v, compress.Payload) for v in obj.values()):
            sent.append((self.owner, obj))
        return put(self, obj)

    sim.SimTransport.put = record  # type: ignore[method-assign]
    try:
        yield
    finally:
        sim.SimTransport.put = put  # type: ignore[method-assign]


def run(coding: str, steps: int) -> tuple[dict, list[tuple[str, compress.Payload]]]:
    """One training run of the default rung with `compression.entropy` = `coding`: its wire bytes and
    loss, and every payload it put on the wire as (direction, payload)."""
    from dloco.sim import run_local

    label, algorithm, ov, speeds, _ = next(x for x in quality.LADDER if x[0] == quality.DEFAULT_RUNG)
    r = quality.row("ladder", label, "stdlib", 4, algorithm, (*ov, f"compression.entropy={coding}"), 0, speeds=speeds)
    cfg = quality.row_config(r, steps, False)
    M = cfg.learners.count
    times = [1.0 + 0.2 * m / (M - 1) for m in range(M)]  # the quality bench's fleet
    sent: list[tuple[int, dict]] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d, recording(sent):
        s = run_local(cfg, d, steps=steps, step_times=times, sync_time=0.5)
        loss = s.evaluate()
    stores = {st.transport.owner for st in s.stores}
    payloads = [("down" if o in stores else "up", p) for o, obj in sent for p in obj.values()]
    n = sum(f.size for f in s.blueprint.plan.fragments)
    up = sum(svc.bytes_out for svc in s.services.values())
    down = sum(s.bytes_down)
    merges = [e for e in s.events if e["event"] == "merge"]
    out = {
        "entropy": coding,
        "label": label,
        "overrides": r["overrides"],
        "config_hash": quality.config_hash(cfg),
        "params": n,
        "learners": M,
        "H": cfg.sync.every,
        "steps": steps,
        "eval_loss": loss,
        "bytes_up": up,  # sent by the learners (every push put on the wire)
        "bytes_down": down,  # received by the learners (every delivery and fetch)
        "bytes_up_merged": sum(e["bytes_in"] for e in merges),  # the merge events' count of accepted pushes
        "bytes_up_recorded": sum(p.nbytes for d, p in payloads if d == "up"),  # the same pushes, summed here
        "ratio_to_dp": 8 * n * steps * M / (up + down),
        "merges": len(merges),
        "rejections": sum(e["event"] == "rejection" for e in s.events),
        "tensors_packed": sum(p.entropy != "none" for _, p in payloads),
        "tensors_sent": len(payloads),
        "wall_s": time.perf_counter() - t0,
    }
    return out, payloads


# ---- levels and layouts ------------------------------------------------------------------------


def nibbles(data: np.ndarray) -> np.ndarray:
    """int4 codes one per byte, in index order (even index in the low nibble)."""
    return np.stack([data & 0x0F, data >> 4], axis=1).reshape(-1)


def order0_bits(codes: np.ndarray, symbols: int) -> float:
    """Entropy of the codes' frequencies, bits per code."""
    f = np.bincount(codes.reshape(-1), minlength=symbols) / max(codes.size, 1)
    f = f[f > 0]
    return float(-(f * np.log2(f)).sum())


def frames(level: int) -> Callable[[bytes], bytes]:
    c = zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)
    return c.compress


def each(fn: Callable[[bytes], bytes], items: list[bytes]) -> list[bytes]:
    return [fn(x) for x in items]


def best_of(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def levels(payloads: list[compress.Payload]) -> list[dict]:
    """Frames over raw codes (not smaller: sent raw), and MB/s of codes compressed and decompressed."""
    raw = [p.data.tobytes() for p in payloads]
    scales = sum(p.scales.nbytes for p in payloads if p.scales is not None)
    total = sum(len(b) for b in raw)
    out = []
    dec = zstandard.ZstdDecompressor().decompress
    for level in LEVELS:
        compress_fn = frames(level)
        z = [compress_fn(b) for b in raw]
        kept = [f for f, b in zip(z, raw, strict=True) if len(f) < len(b)]
        repeat = 1 if level >= 19 else 3
        tc = best_of(functools.partial(each, compress_fn, raw), repeat)
        td = best_of(functools.partial(each, dec, kept), 3) if kept else math.nan
        sent = sum(min(len(f), len(b)) for f, b in zip(z, raw, strict=True))
        out.append(
            {
                "level": level,
                "codes_ratio": sent / total,  # bytes of codes sent / raw codes
                "wire_ratio": (sent + scales) / (total + scales),  # scales travel raw
                "compress_MBps": total / tc / 1e6,
                "decompress_MBps": sum(len(b) for f, b in zip(z, raw, strict=True) if len(f) < len(b)) / td / 1e6,
                "packed_share": len(kept) / len(raw),
            }
        )
    return out


def layouts(payloads: list[compress.Payload]) -> dict:
    """Level-1 frames of the same int4 codes in other layouts, over the raw packed codes."""
    compress_fn = frames(entropy.LEVEL)
    total = sum(p.data.nbytes for p in payloads)

    def ratio(transform: Callable[[compress.Payload], bytes]) -> float:
        return sum(min(len(compress_fn(transform(p))), p.data.nbytes) for p in payloads) / total

    def planes(p: compress.Payload) -> bytes:
        c = nibbles(p.data)
        return np.packbits(((c[:, None] >> np.arange(4)) & 1).T, axis=1).tobytes()

    codes = np.concatenate([nibbles(p.data) for p in payloads])
    scales = sum(p.scales.nbytes for p in payloads if p.scales is not None)
    together = sum(
        min(len(compress_fn(p.data.tobytes() + p.scales.tobytes())), p.nbytes) for p in payloads if p.scales is not None
    )
    return {
        "order0_bits_per_code": order0_bits(codes, 16),
        "order0_ratio": order0_bits(codes, 16) / 4,
        "packed": ratio(lambda p: p.data.tobytes()),
        "one_code_per_byte": ratio(lambda p: nibbles(p.data).tobytes()),
        "bit_planes": ratio(planes),
        "codes_and_scales_one_frame": together / (total + scales),
        "codes_then_raw_scales": (ratio(lambda p: p.data.tobytes()) * total + scales) / (total + scales),
    }


def synthetic(n: int = 1 << 20) -> list[dict]:
    """Level-1 frames of each wire dtype's data for Gaussian, Laplace and Student-t(3) values (bf16 also
    byte-shuffled)."""
    rng = np.random.default_rng(0)
    draws = {
        "gaussian": rng.standard_normal(n),
        "laplace": rng.laplace(size=n),
        "student_t3": rng.standard_t(3, size=n),
    }
    out = []
    for name, x in draws.items():
        for dtype in ("bf16", "int8", "int4", "int2"):
            p = compress.encode(x.astype(np.float32), dtype)
            q = compress.pack(p)
            row = {"values": name, "dtype": dtype, "wire_ratio": q.nbytes / p.nbytes}
            if dtype == "int4":
                row["order0_bits_per_code"] = order0_bits(nibbles(p.data), 16)
            if dtype == "bf16":  # the high bytes (sign, exponent) apart from the low ones: not done
                shuffled = p.data.view(np.uint8).reshape(-1, 2).T.tobytes()
                row["shuffled_wire_ratio"] = len(frames(entropy.LEVEL)(shuffled)) / p.nbytes
            out.append(row)
    return out


def throughput(n: int = 1 << 24) -> list[dict]:
    """Per level: MB/s of one large tensor's int4 codes (n Gaussian values, n / 2 bytes) compressed
    and decompressed on one core (best of 3), where the small tensors of a run measure mostly the
    per-call cost; and what `compress.unpack` adds to the decompression (the codes array)."""
    codes = compress.encode(np.random.default_rng(1).standard_normal(n, dtype=np.float32), "int4").data.tobytes()
    out = []
    dec = zstandard.ZstdDecompressor().decompress
    for level in LEVELS:
        compress_fn = frames(level)
        z = compress_fn(codes)
        tc = best_of(functools.partial(each, compress_fn, [codes]), 1 if level >= 19 else 3)
        td = best_of(functools.partial(each, dec, [z]), 3)
        out.append(
            {
                "level": level,
                "codes_bytes": len(codes),
                "codes_ratio": len(z) / len(codes),
                "compress_MBps": len(codes) / tc / 1e6,
                "decompress_MBps": len(codes) / td / 1e6,
            }
        )
    plain = compress.Payload("int4", (n,), np.frombuffer(codes, np.uint8), np.ones(n // 128, np.float16), 128)
    p = compress.pack(plain)
    out.append({"level": entropy.LEVEL, "unpack_MBps": len(codes) / best_of(lambda: compress.unpack(p), 3) / 1e6})
    return out


def measure(steps: int) -> dict:
    runs, sent = [], {}
    for coding in ("none", "zstd"):
        r, payloads = run(coding, steps)
        runs.append(r)
        sent[coding] = payloads
        print(
            f"entropy {coding:4s}: loss {r['eval_loss']:.6f}, up {r['bytes_up']:,} B, down {r['bytes_down']:,} B, "
            f"{r['ratio_to_dp']:.1f}× less than fp32 dp ({r['wall_s']:.0f} s)",
            flush=True,
        )
    int4 = {d: [p for dd, p in sent["none"] if dd == d and p.dtype == "int4"] for d in ("up", "down")}
    half = len(int4["up"]) // 2
    study = {
        "runs": runs,
        "same_loss": runs[0]["eval_loss"] == runs[1]["eval_loss"],
        "wire_ratio_zstd": sum(runs[1][k] for k in ("bytes_up", "bytes_down"))
        / sum(runs[0][k] for k in ("bytes_up", "bytes_down")),
        "levels": {d: levels(ps) for d, ps in int4.items()},
        "layouts": {d: layouts(ps) for d, ps in int4.items()},
        # does training change how well the pushes' codes compress? (first and second half of the run)
        "pushes_by_half": [layouts(ps)["packed"] for ps in (int4["up"][:half], int4["up"][half:])],
        "synthetic": synthetic(),
        "throughput": throughput(),
    }
    for d, rows in study["levels"].items():
        for x in rows:
            print(
                f"{d:4s} level {x['level']:3d}: codes {x['codes_ratio']:.4f} wire {x['wire_ratio']:.4f} "
                f"compress {x['compress_MBps']:7.1f} MB/s decompress {x['decompress_MBps']:7.1f} MB/s"
            )
    for x in study["throughput"][:-1]:
        print(
            f"8 MiB of codes, level {x['level']:3d}: ratio {x['codes_ratio']:.4f} compress {x['compress_MBps']:7.1f} "
            f"MB/s decompress {x['decompress_MBps']:7.1f} MB/s"
        )
    print(json.dumps(study["layouts"], indent=1))
    return study


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_STEPS} steps per learner instead of {FULL_STEPS}")
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
    steps = QUICK_STEPS if a.quick else FULL_STEPS
    t["entropy"] = measure(steps) | {
        "command": "python benchmarks/bandwidth.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "zstandard": zstandard.__version__},
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(t, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
