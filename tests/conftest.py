"""Test environment: JAX on CPU with two virtual devices, few threads, no Ray started here."""

import os
import signal
import subprocess
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a local Ray listens on 127.0.0.1 only

import pytest  # noqa: E402

# The `micro` preset (a 21k-parameter model on 400 kB of the stdlib corpus) compiles in about a
# second, so that tests of runs (in-process, Ray, CLI) spend their time on the system under test.
TINY_RUN = (
    "preset=micro",
    "sync.every=8",
    "fragments.count=2",
    "sync.overlap=1",
)


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    """One tokenized-corpus cache for the whole session."""
    return str(tmp_path_factory.mktemp("data-cache"))


@pytest.fixture(scope="session")
def tiny_run(data_cache):
    """Dotted overrides for a tiny, fast run using the session's data cache."""
    return (*TINY_RUN, f"data.cache_dir={data_cache}")


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster for one test module (4 CPUs, an ``evaluator`` resource, two region
    resources for store/syncer shards, 512 MiB object store, loopback only)."""
    import ray

    ray.init(
        address="local",
        num_cpus=4,
        resources={"evaluator": 1, "region_a": 1, "region_b": 1},
        include_dashboard=False,
        object_store_memory=512 * 1024**2,
        log_to_driver=False,
    )
    yield
    ray.shutdown()


def wait_for(pred, timeout=120.0, every=0.25, fail=True):
    """Polls `pred` until it returns something truthy (returned) or `timeout` seconds pass (fails,
    or with ``fail=False`` returns the last falsy value, for a caller that explains the failure)."""
    end = time.time() + timeout
    value = None
    while time.time() < end:
        value = pred()
        if value:
            return value
        time.sleep(every)
    if fail:
        raise AssertionError(f"condition not met within {timeout} s")
    return value


def run_privileged_script(cmd, cwd, timeout, drop_env=("RAY_ADDRESS",)):
    """Runs a script that builds network namespaces (exit 77: skip); returns (returncode, output).

    On timeout it sends SIGTERM first, so the script's own cleanup stops its Ray nodes and deletes
    its namespaces, then SIGKILL, and fails the test."""
    env = {k: v for k, v in os.environ.items() if k not in drop_env}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        pytest.fail(f"{cmd} did not finish within {timeout} s:\n{out[-4000:]}")
    if proc.returncode == 77:
        pytest.skip(out.strip().splitlines()[-1] if out.strip() else f"{cmd} skipped")
    return proc.returncode, out
