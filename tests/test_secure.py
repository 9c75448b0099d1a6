"""A local cluster started by dloco: token authentication on, loopback only, a private temp dir.

The check runs in a subprocess with the user's environment as a user would have it (no
``RAY_AUTH_MODE``, no ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``: the test session sets both) and a
home directory of its own, so Ray generates the token there, not in the tester's home.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = r"""
import json, os, stat, subprocess, sys
import psutil
import ray  # imported before dloco sets anything: as a notebook would
from actors.launch import connect
from actors.health import auth_mode

owns = connect(None, num_cpus=1, object_store_mb=80)
addr = ray.get_runtime_context().gcs_address
ours = {p.pid for p in psutil.Process().children(recursive=True)} | {os.getpid()}
listening = sorted({c.laddr.ip for c in psutil.net_connections("inet") if c.status == "LISTEN" and c.pid in ours})
parent = os.path.dirname(ray._private.worker._global_node.get_temp_dir_path())
ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
status = {
    mode: subprocess.run([ray_cli, "status", "--address", addr], env={**env, "RAY_AUTH_MODE": mode},
                         capture_output=True, text=True, timeout=120).returncode
    for mode in ("disabled", "token")
}
out = {"owns": owns, "auth": auth_mode(), "addr": addr, "listening": listening,
       "parent": parent, "parent_mode": stat.S_IMODE(os.stat(parent).st_mode), "status": status}
ray.shutdown()
print("RESULT " + json.dumps(out))
"""


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_local_cluster_has_token_auth_listens_on_loopback_and_keeps_its_temp_dir_private(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ENABLE_WINDOWS", "RAY_ADDRESS"))}
    env.update(HOME=str(tmp_path), RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=str(Path(__file__).parents[1]))
    r = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=280)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and line, r.stderr[-3000:]
    out = json.loads(line[0][len("RESULT ") :])
    assert out["owns"] and out["auth"] == "token"
    assert (tmp_path / ".ray" / "auth_token").exists()  # Ray generated the token for this user
    # a client without the token is refused; with it, served
    assert out["status"] == {"disabled": 1, "token": 0}
    assert out["addr"].startswith("127.0.0.1:")
    assert out["listening"] and all(ip in ("127.0.0.1", "::ffff:127.0.0.1", "::1") for ip in out["listening"])
    assert out["parent"].endswith(f"dloco-{os.getuid()}") and out["parent_mode"] == 0o700


def test_an_explicit_auth_mode_is_respected_and_recorded():
    """The test session runs with RAY_AUTH_MODE=disabled, chosen by the user (conftest): dloco
    accepts it and reports it; `auth_mode` reads Ray's own setting, not a guess."""
    from actors.health import auth_mode

    assert os.environ["RAY_AUTH_MODE"] == "disabled"
    assert auth_mode() == "disabled"
