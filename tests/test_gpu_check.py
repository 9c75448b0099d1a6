"""benchmarks/gpu_check.py in its tiny mode on CPU: both shardings over two emulated devices, the
bare loop and the learner actor, the FLOPs per token against a hand count, and MFU without a peak.

The ratio actor / bare is only checked to be a number: on a loaded 2-core CPU a step of the micro
model takes milliseconds and the ratio is noise (the script's target, >= 0.97, is for a GPU).
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(240)]

# llama-micro with the script's tiny overrides: d = 32, 4 query heads and 2 key/value heads of 8,
# 1 layer, untied embeddings, vocabulary 512, T = 32; SwiGLU hidden size ceil((2/3)·4·32 / 8)·8 = 88.
D, KV_DIM, LAYERS, VOCAB, T, HIDDEN = 32, 2 * 8, 1, 512, 32, 88
BLOCK = (D * D + D * KV_DIM + D * KV_DIM + D * D) + 3 * D * HIDDEN + 2 * D  # q, k, v, out; gate, up, down; 2 norms
N_MATMUL = LAYERS * BLOCK + D + D * VOCAB  # + final norm + lm_head (the embedding table is a lookup)
PARAMS = N_MATMUL + VOCAB * D
FLOPS_PER_TOKEN = 6 * N_MATMUL + 12 * LAYERS * D * T


def test_hand_count():
    assert (BLOCK, N_MATMUL, PARAMS, FLOPS_PER_TOKEN) == (11_584, 28_000, 44_384, 180_288)


def test_tiny_mode_on_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "OMP_NUM_THREADS": "1",
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--tiny", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=220,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["mode"] == "tiny" and d["machine"]["platform"] == "cpu"
    assert [r["sharding"] for r in d["rows"]] == ["replicate", "fsdp"]
    for r in d["rows"]:
        assert r["devices"] == r["actor_devices"] == 2, r["sharding"]  # FSDP really splits over two devices
        assert r["bare_tokens_per_s"] > 0 and r["actor_tokens_per_s"] > 0
        assert math.isfinite(r["ratio"]) and r["ratio"] > 0
        assert math.isfinite(r["paired_ratio_median"]) and r["paired_ratio_median"] > 0
        assert r["pairs"] >= 1
        # both paths trained the same timed steps; the actor pushed through the store's path
        steps = {k: sum(c["steps"] for c in r["chunks"][k]) for k in ("bare", "actor")}
        assert steps["bare"] == steps["actor"] == r["timed_steps"] > 0
        assert r["actor_pushes_received_by_syncer"] > 0
        assert math.isfinite(r["bare_loss"])
        assert (r["params"], r["flops_params"], r["flops_per_token"]) == (PARAMS, N_MATMUL, FLOPS_PER_TOKEN)
        assert r["bare_mfu"] is None and r["actor_mfu"] is None
    assert d["peak_tflops_per_device"] is None
    assert "'cpu'" in d["mfu_reason"] and "--peak-tflops" in d["mfu_reason"]
    assert "MFU: null" in proc.stdout

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import report
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    text = "\n".join(report.gpu_check_section(d))
    r = d["rows"][1]
    assert f"| fsdp | 2 | {r['bare_tokens_per_s']:,.0f} | {r['actor_tokens_per_s']:,.0f} | {r['ratio']:.3f} |" in text
    assert "Not run: needs a GPU" in "\n".join(report.gpu_check_section(None))
