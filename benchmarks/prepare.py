"""Tokenizing a corpus: ``dloco prepare`` (Ray Data) against today's `dloco.data.prepare_corpus`.

Generates a synthetic text corpus of ``--bytes`` (default 2 GB) as JSON Lines files in a temporary
directory (never committed; removed at the end unless ``--keep``): documents of 1–8 kB, each a
numbered slice of a 4 MB pool of words drawn from a Zipf law. A BPE of ``--vocab-size`` ids is
trained once on 4 MB of it and given to every variant as ``file:tokenizer.json`` (``--tokenizer
byte``: bytes), so all of them produce the same tokens. Then, each in a child process:

- ``dloco prepare`` (``dloco prepare jsonl:DIR/*.jsonl --out TMP``: a local Ray cluster started by
  the command, Ray Data reading and tokenizing, the driver writing shards; its wall time includes
  starting Ray);
- ``dloco.data.prepare`` in one process (`local_engine`: the same pipeline without Ray);
- ``prepare_corpus`` (today's path: every document and its tokens in memory, then the cache).

Each row records the wall time, the tokens (train + validation: equal across rows, checked),
tokens/s, the child's peak RSS (VmHWM of the process that ran it) and the peak PSS of its whole
process tree (Ray's GCS, raylet and workers included), sampled every 0.5 s from
``/proc/*/smaps_rollup``. Writes JSON:

    python benchmarks/prepare.py [--bytes 2e9] [--tokenizer bpe|byte] [--out benchmarks/results/prepare.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def generate(root: Path, total: int, seed: int = 0, file_bytes: int = 64 << 20) -> int:
    """Writes ~`total` bytes of documents as ``part-*.jsonl``; returns the documents written."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    words = ["".join(rng.choice(letters, size=int(n))) for n in rng.integers(1, 9, size=5000)]
    ranks = np.minimum(rng.zipf(1.3, size=800_000), len(words)) - 1
    pool = " ".join(words[r] for r in ranks)[: 4 << 20]
    written = docs = part = 0
    while written < total:
        with open(root / f"part-{part:05d}.jsonl", "w") as f:
            size = 0
            while size < file_bytes and written + size < total:
                n = int(rng.integers(1000, 8000))
                at = int(rng.integers(0, len(pool) - n))
                line = json.dumps({"text": f"document {docs}: {pool[at : at + n]}"}) + "\n"
                f.write(line)
                size += len(line)
                docs += 1
        written += size
        part += 1
    return docs


def _pss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _tree(pid: int) -> list[int]:
    """`pid` and its descendants, from /proc/*/stat."""
    parent = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    out, frontier = [pid], [pid]
    while frontier:
        frontier = [p for p, pp in parent.items() if pp in frontier]
        out += frontier
    return out


def run_child(variant: str, source: str, out: str, tokenizer: str) -> dict:
    """Runs one variant in a child process; returns its wall time, result and memory."""
    cmd = [sys.executable, __file__, "--child", variant, "--source", source, "--child-out", out]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    proc = subprocess.Popen([*cmd, "--tokenizer", tokenizer], env=env, stdout=subprocess.PIPE, text=True)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, sum(_pss_kb(p) for p in _tree(proc.pid)))
        time.sleep(0.5)
    wall = time.perf_counter() - start
    stdout = proc.stdout.read() if proc.stdout else ""
    if proc.returncode:
        raise SystemExit(f"{variant} failed ({proc.returncode}): {stdout[-2000:]}")
    result = json.loads(stdout.strip().splitlines()[-1])
    return {
        "variant": variant,
        "wall_s": round(wall, 2),
        "tokens": result["tokens"],
        "tokens_per_s": round(result["tokens"] / wall),
        "vmhwm_mb": round(result["vmhwm_kb"] / 1024, 1),
        "tree_peak_pss_mb": round(peak / 1024, 1),
    }


def child(variant: str, source: str, out: str, tokenizer: str) -> None:
    """In the child: runs the variant, prints ``{"tokens", "vmhwm_kb"}`` as its last line."""
    from dloco import data

    if variant == "dloco prepare":
        from actors.cli import main

        if main(["prepare", source, "--out", out, "--tokenizer", tokenizer, "--quiet"]) != 0:
            raise SystemExit(2)
        m = data.Manifest.from_json((Path(out) / "manifest.json").read_text(), out)
        tokens = m.tokens("train") + m.tokens("val")
    elif variant == "dloco.data.prepare (one process)":
        m = data.prepare(source, out, tokenizer=tokenizer)
        tokens = m.tokens("train") + m.tokens("val")
    else:
        c = data.prepare_corpus(source, tokenizer=tokenizer, cache_dir=out)
        tokens = c.train_tokens + c.val_tokens
    hwm = next(
        int(ln.split()[1]) for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith("VmHWM")
    )
    print(json.dumps({"tokens": tokens, "vmhwm_kb": hwm}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bytes", type=float, default=2e9, help="corpus size (default 2e9)")
    ap.add_argument("--tokenizer", default="bpe", help="bpe (one trained here, given as a file) or byte")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--tmp", help="where the temporary corpus and outputs go (default: the system's)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "prepare.json"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--source", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.source, args.child_out, args.tokenizer)

    tmp = Path(tempfile.mkdtemp(prefix="dloco-prepare-bench-", dir=args.tmp))
    try:
        corpus = tmp / "corpus"
        corpus.mkdir()
        t = time.perf_counter()
        docs = generate(corpus, int(args.bytes))
        size = sum(p.stat().st_size for p in corpus.iterdir())
        print(f"generated {size / 1e6:,.0f} MB, {docs:,} documents in {time.perf_counter() - t:.0f} s", file=sys.stderr)
        tokenizer = "byte"
        if args.tokenizer == "bpe":
            from dloco.data.tokenizer import train_bpe

            head = (corpus / "part-00000.jsonl").read_text()[: 4 << 20].splitlines()[:-1]
            tok = train_bpe([json.loads(line)["text"] for line in head], args.vocab_size)
            tok._backend.save(str(tmp / "tokenizer.json"))
            tokenizer = f"file:{tmp / 'tokenizer.json'}"
        source = f"jsonl:{corpus}/*.jsonl"
        rows = []
        for i, variant in enumerate(("dloco prepare", "dloco.data.prepare (one process)", "prepare_corpus")):
            rows.append(run_child(variant, source, str(tmp / f"out-{i}"), tokenizer))
            print(json.dumps(rows[-1]), file=sys.stderr)
        if len({r["tokens"] for r in rows}) != 1:
            raise SystemExit(f"the variants disagree on the token count: {rows}")
        import ray

        doc = {
            "config": {"bytes": size, "documents": docs, "tokenizer": args.tokenizer, "vocab_size": args.vocab_size},
            "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "load_1m": os.getloadavg()[0]},
            "versions": {"ray": ray.__version__},
            "rows": rows,
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
        for r in rows:
            print(
                f"{r['variant']:<34} {r['wall_s']:>8.1f} s {r['tokens_per_s']:>12,} tokens/s "
                f"VmHWM {r['vmhwm_mb']:>8,.0f} MB  tree PSS {r['tree_peak_pss_mb']:>8,.0f} MB"
            )
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
