"""One process of a two-process learner (`tests/test_multihost.py`): the learner's jitted train step
(`dloco.inner.make_train_step`) over a mesh whose devices live in two processes, joined by
`jax.distributed` with the gloo CPU collectives.

Usage: python tests/multihost_worker.py PROCESS_ID PORT OUT.npz
Each process holds its half of every global batch; both end with the same replicated parameters.
"""

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.pop("XLA_FLAGS", None)  # one CPU device per process

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from multihost_common import STEPS, batches, flat, model_and_params  # noqa: E402

from dloco import inner  # noqa: E402


def main() -> None:
    pid, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid, initialization_timeout=60)
    mesh = inner.make_mesh()  # all devices of all processes: one learner
    assert mesh.devices.size == 2 and len(jax.local_devices()) == 1
    model, params, cfg = model_and_params()
    state = inner.init_state(params, cfg.inner, mesh)
    step = inner.make_train_step(model, cfg.inner, mesh)
    p, opt, losses = state.params, state.opt_state, []
    for t, batch in enumerate(batches()):
        half = batch.shape[0] // 2
        local = batch[pid * half : (pid + 1) * half]  # this host's rows of the global batch
        g = jax.make_array_from_process_local_data(NamedSharding(mesh, P(inner.DATA_AXIS)), local)
        p, opt, metrics = step(p, opt, g, t)
        losses.append(float(np.asarray(metrics["loss"].addressable_data(0))))
    np.savez(out, losses=np.array(losses), steps=STEPS, **flat(p))
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
