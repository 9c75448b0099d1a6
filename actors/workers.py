"""The environment of an actor's worker process (threads, compile cache, accelerator)."""

from __future__ import annotations

from pathlib import Path

from dloco.config import RunConfig

# The store and the syncer run at niceness 0. Ray starts every worker at niceness 15
# (`worker_niceness`), and the per-actor variable overrides it for that actor's process (as Ray's
# own job supervisor does). At 15 a restarted store or syncer got a 15th of the CPU share of any
# process at 0 beside it: measured in `benchmarks/soak.py --quick` on 2 busy cores, a syncer took
# 22–29 s and a store 24–51 s from kill to serving, and one run merged nothing in 190 s while
# both kept restarting. The learners stay at 15: under contention the few seconds of CPU that
# the control plane needs come first, and the learners, which never wait for it, lose little.
CONTROL_PLANE_ENV = {"RAY_worker_niceness": "0"}


def worker_env(cfg: RunConfig, accelerator: bool, shared_gpu: bool = False) -> dict[str, str]:
    """Environment of an actor's worker process; `accelerator` False pins JAX to the CPU.

    `shared_gpu` (a fractional ``num_gpus``): JAX allocates as it goes instead of taking 75 % of
    the device at start, so that the processes sharing the GPU fit beside each other.
    """
    n = cfg.learners.xla_threads
    env = {
        # XLA's CPU client has no thread-count flag; single-threaded Eigen is the one switch it reads.
        "XLA_FLAGS": f"--xla_cpu_multi_thread_eigen={'true' if n > 1 else 'false'}",
        "OMP_NUM_THREADS": str(n),
        "TF_CPP_MIN_LOG_LEVEL": "3",
    }
    if cfg.learners.compile_cache_dir:  # a restarted learner recompiles from disk, not from scratch
        env["JAX_COMPILATION_CACHE_DIR"] = str(Path(cfg.learners.compile_cache_dir).expanduser())
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    if not accelerator:
        env["JAX_PLATFORMS"] = "cpu"
    elif shared_gpu:
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    return env
