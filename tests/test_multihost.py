"""A learner that spans two processes (two hosts of a TPU slice or a GPU group, here two CPU
processes on loopback): `jax.distributed` with the gloo CPU collectives joins them into one
mesh, and the learner's jitted train step runs over it as it runs over one process's devices.

What this shows and what it does not (docs/MULTIHOST.md): the train step, placement and
collectives work across processes with each process feeding its half of the global batch; the
learner around the step (pushes, installs, the data stream) is still one process's.
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from multihost_common import STEPS, batches, flat, model_and_params

from dloco import inner

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(180)
def test_two_processes_train_as_one_learner_with_two_devices(tmp_path):
    port, worker = free_port(), ROOT / "tests" / "multihost_worker.py"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), str(i), str(port), str(tmp_path / f"p{i}.npz")],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in (0, 1)
    ]
    outs = [p.communicate(timeout=150)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outs)
    a, b = (dict(np.load(tmp_path / f"p{i}.npz")) for i in (0, 1))

    # the reference: the same steps in this process over its two (virtual) CPU devices
    assert len(jax.devices()) >= 2, "conftest gives the in-process tests two CPU devices"
    model, params, cfg = model_and_params()
    mesh = inner.make_mesh(jax.devices()[:2])
    state = inner.init_state(params, cfg.inner, mesh)
    step = inner.make_train_step(model, cfg.inner, mesh)
    p, opt, losses = state.params, state.opt_state, []
    for t, batch in enumerate(batches()):
        p, opt, metrics = step(p, opt, inner.shard_batch(batch, mesh), t)
        losses.append(float(metrics["loss"]))
    ref = flat(p)

    assert int(a.pop("steps")) == int(b.pop("steps")) == STEPS
    la, lb = a.pop("losses"), b.pop("losses")
    np.testing.assert_array_equal(la, lb)  # one learner: both processes computed the same step
    np.testing.assert_allclose(la, losses, rtol=1e-5)
    assert set(a) == set(b) == set(ref)
    for k in ref:
        np.testing.assert_array_equal(a[k], b[k])  # replicated: identical on both hosts
        np.testing.assert_allclose(a[k], ref[k], rtol=1e-4, atol=1e-6)  # gloo's all-reduce order aside
    assert losses[-1] < losses[0]  # and it trained
