"""Emulated hosts (actors.isolation): a learner process capped at its CPU share by a cgroup."""

import subprocess
import sys
import uuid

import pytest

from actors import isolation

try:
    isolation.cgroup_root()
    AVAILABLE = True
except RuntimeError:
    AVAILABLE = False

CHILD = """
import sys
from actors import isolation
group = isolation.limit_cpu(sys.argv[1], 0.25)
print(group)
print((group / "cpu.cfs_quota_us").read_text().strip() if (group / "cpu.cfs_quota_us").exists()
      else (group / "cpu.max").read_text().split()[0])
print(open("/proc/self/cgroup").read())
"""


@pytest.mark.skipif(not AVAILABLE, reason="no writable cgroup cpu controller on this machine")
def test_a_process_is_moved_into_its_capped_cgroup_and_the_cgroup_is_released(tmp_path):
    name = f"pytest-{uuid.uuid4().hex[:8]}"
    out = subprocess.run([sys.executable, "-c", CHILD, name], capture_output=True, text=True, check=True).stdout
    path, quota, cgroups = out.split("\n", 2)
    assert path.endswith(f"dloco/{name}")
    assert quota == "25000"  # 0.25 cores of a 100 ms period
    assert f"dloco/{name}" in cgroups  # the process ran inside it
    isolation.release(name)  # the process has exited: its cgroup goes
    assert not (isolation.cgroup_root()[0] / name).exists()


def test_a_negative_limit_is_a_config_error():
    from dloco import config

    with pytest.raises(config.ConfigError, match=r"learners\.cpu_limit=-1\.0 is invalid"):
        config.load(overrides=("learners.cpu_limit=-1",))
