"""benchmarks/bandwidth.py: wire bytes from real payload sizes (ALGORITHM.md §7)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
bandwidth = pytest.importorskip("bandwidth")


def test_int4_both_ways_at_h24_is_about_186x_less_than_fp32_ring_allreduce():
    t = bandwidth.table("tiny")
    n = t["params"]
    rows = {(r["algorithm"], r["H"], r.get("dtype"), r.get("publish")): r for r in t["rows"]}
    ring = rows[("dp (ring all-reduce reference)", 1, None, None)]
    assert ring["up"] + ring["down"] == 8 * n
    r = rows[("decoupled", 24, "int4", "delta")]
    # per block of 128 values: 64 bytes of nibbles + a 2-byte scale, each way, once every H steps
    assert r["up"] == r["down"] > 0.5156 * n / 24
    assert 150 < r["ratio_to_dp"] <= 8 * 24 / (2 * 0.515625) + 1e-9
    assert rows[("decoupled", 24, "fp32", "full")]["ratio_to_dp"] == pytest.approx(24.0)
    assert rows[("decoupled", 96, "int4", "delta")]["ratio_to_dp"] == pytest.approx(4 * r["ratio_to_dp"])
