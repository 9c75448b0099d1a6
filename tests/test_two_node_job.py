"""A real two-node Ray cluster (two network namespaces on this machine) running `dloco train`
through `ray job submit`: learner 0 must run on the head (region_a), learner 1 on the worker
(region_b). See scripts/two_node_job.sh; it needs root and `ip netns` and exits 77 (skip) without.
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = "scripts/two_node_job.sh"
SUCCESS = "two_node_job: OK: learner 0 on head 10.231.7.1, learner 1 on worker 10.231.7.2"


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_node_job():
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(
        ["bash", SCRIPT], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        out, _ = proc.communicate(timeout=540)
    except subprocess.TimeoutExpired:
        # SIGTERM first: the script's trap stops both Ray nodes and deletes its namespaces.
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=45)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        pytest.fail(f"{SCRIPT} did not finish within 540 s:\n{out}")
    if proc.returncode == 77:
        pytest.skip(out.strip().splitlines()[-1] if out.strip() else f"{SCRIPT} skipped")
    assert proc.returncode == 0, f"{SCRIPT} exited with {proc.returncode}:\n{out}"
    assert SUCCESS in out, out
