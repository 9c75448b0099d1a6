"""A real two-node Ray cluster (two network namespaces on this machine) running `dloco train`
through `ray job submit`: learner 0 must run on the head (region_a), learner 1 on the worker
(region_b). See scripts/two_node_job.sh; it needs root and `ip netns` and exits 77 (skip) without.
"""

from pathlib import Path

import pytest
from conftest import run_privileged_script

REPO = Path(__file__).resolve().parents[1]
SCRIPT = "scripts/two_node_job.sh"
SUCCESS = "two_node_job: OK: learner 0 on head 10.231.7.1, learner 1 on worker 10.231.7.2"


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_node_job():
    rc, out = run_privileged_script(["bash", SCRIPT], REPO, timeout=540)
    assert rc == 0, f"{SCRIPT} exited with {rc}:\n{out}"
    assert SUCCESS in out, out
