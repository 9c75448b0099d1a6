"""A real two-node Ray cluster (two network namespaces on this machine) running `dloco train`
through `ray job submit`: learner 0 must run on the head (region_a), learner 1 on the worker
(region_b); the worker's node must tokenize its own copy of the corpus with the tokenizer the
driver trained and sent, and, once one of its files differs, its learner must refuse to start with
one line while the head's trains on. See scripts/two_node_job.sh; it needs root and `ip netns`
and exits 77 (skip) without.
"""

import re
from pathlib import Path

import pytest
from conftest import run_privileged_script

REPO = Path(__file__).resolve().parents[1]
SCRIPT = "scripts/two_node_job.sh"
SUCCESS = "two_node_job: OK: learner 0 on head 10.231.7.1, learner 1 on worker 10.231.7.2"
GIVEN = "corpus key {key}: head tokenizer trained, worker tokenizer given"
REFUSED = "two_node_job: OK: the worker with a changed corpus was refused; learner 0 merged"


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_node_job():
    rc, out = run_privileged_script(["bash", SCRIPT], REPO, timeout=540)
    assert rc == 0, f"{SCRIPT} exited with {rc}:\n{out}"
    assert SUCCESS in out and "the worker tokenized with the driver's tokenizer" in out, out
    assert re.search(re.escape(GIVEN).replace(re.escape("{key}"), "[0-9a-f]{16}"), out), out
    assert REFUSED in out, out
