"""The emulated multi-region benchmark (benchmarks/wan.py) runs end to end in its tiny mode.

It needs root, `ip` and `tc` for its network namespaces and capped veth pair, and exits 77 (skip)
without them. Values are checked, not timings: nothing here asserts how fast anything was.
"""

import json
import sys
from pathlib import Path

import pytest
from conftest import run_privileged_script

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_wan_tiny_writes_both_runs(tmp_path):
    out = tmp_path / "wan.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "wan.py"), "--tiny", "--out", str(out)]
    # conftest's two virtual devices (XLA_FLAGS) are for in-process tests only
    rc, text = run_privileged_script(cmd, ROOT, timeout=380, drop_env=("RAY_ADDRESS", "XLA_FLAGS"))
    assert rc == 0, text[-4000:]

    d = json.loads(out.read_text())
    assert {"command", "target", "publish", "link", "runs", "speedup", "scaling", "table", "versions"} <= set(d)
    assert "--tiny" in d["command"] and d["publish"] == "delta"
    assert d["link"]["mbit"] > 0 and "tbf" in d["link"]["qdisc"] and d["link"]["latency_s"] > 0
    runs = {r["algorithm"]: r for r in d["runs"]}
    assert set(runs) == {"dp", "decoupled"}
    for name, r in runs.items():
        assert r["config"]["algorithm"] == name and len(r["config_hash"]) == 12
        assert r["tokens"] > 0 and r["steps"] > 0 and r["evals"], name
        assert r["bytes_up"] > 0 and r["bytes_down"] > 0, name
        assert r["link_up"] > 0 and r["link_down"] > 0, name  # the veth counters saw the run's traffic
        assert r["wan_payload_up"] + r["wan_payload_down"] > 0, name  # the remote learner crossed the link
        assert r["compute_s"] > 0 and r["step_s"] >= r["compute_s"], name
        ips = {p["ip"] for p in r["placement"].values()}
        assert ips == {"10.231.9.1", "10.231.9.2"}, ips  # one learner per region
    # fp32 gradients every step against int4 pseudo-gradients every H/P steps
    assert runs["dp"]["bytes_per_token"] > runs["decoupled"]["bytes_per_token"]
    assert runs["dp"]["config"]["compression"]["dtype"] == "fp32"
    assert runs["decoupled"]["config"]["compression"]["dtype"] == "int4"
    assert runs["decoupled"]["config"]["compression"]["publish"] == d["publish"]

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import wan
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    md = wan.report(d)
    assert md.startswith("## ") and "netem" in md and d["command"] in md and "| dp |" in md
