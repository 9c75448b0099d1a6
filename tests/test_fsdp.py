"""`learners.sharding: fsdp`: a learner's parameters and AdamW state split over its devices (the two
virtual CPU devices of the test environment), trained to the same model as replicated."""

import jax
import numpy as np
import pytest

from dloco import config, inner
from dloco.inner import DATA_AXIS
from dloco.sim import run_local


def test_each_array_is_split_along_its_first_axis_the_devices_divide():
    mesh = inner.make_mesh()
    assert mesh.devices.size == 2
    spec = {s: inner.leaf_sharding(s, mesh, "fsdp").spec for s in [(4, 6), (3, 4), (3,), (), (1, 1)]}
    assert spec[(4, 6)] == jax.sharding.PartitionSpec(DATA_AXIS)
    assert spec[(3, 4)] == jax.sharding.PartitionSpec(None, DATA_AXIS)
    assert spec[(3,)] == spec[()] == spec[(1, 1)] == jax.sharding.PartitionSpec()
    assert inner.leaf_sharding((4, 6), mesh, "replicate").spec == jax.sharding.PartitionSpec()
    x = inner.place({"w": np.arange(24, dtype=np.float32).reshape(4, 6)}, mesh, "fsdp")["w"]
    assert [s.data.shape for s in x.addressable_shards] == [(2, 6), (2, 6)]  # half on each device
    np.testing.assert_array_equal(np.asarray(x), np.arange(24).reshape(4, 6))


@pytest.mark.parametrize("algorithm", ["decoupled", "dp"])
def test_fsdp_trains_the_same_model_as_replicated(tiny_run, tmp_path, algorithm):
    base = [o for o in tiny_run if algorithm == "decoupled" or not o.startswith(("sync.", "fragments."))]
    runs = {}
    for mode in ("replicate", "fsdp"):
        cfg = config.load(overrides=(*base, f"algorithm={algorithm}", "learners.count=2", f"learners.sharding={mode}"))
        runs[mode] = run_local(cfg, tmp_path / mode, steps=16)  # each learner on both devices
    core = runs["fsdp"].services[0].core
    kernel = core.state.params["block_0"]["mlp_in"]["kernel"]  # [32, 128]: 16 rows on each device
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(DATA_AXIS)
    assert [s.data.shape for s in kernel.addressable_shards] == [(16, 128), (16, 128)]
    mu = jax.tree_util.tree_leaves(core.state.opt_state)
    assert any(getattr(x, "sharding", None) is not None and DATA_AXIS in str(x.sharding.spec) for x in mu)
    a, b = runs["replicate"].store, runs["fsdp"].store
    assert a.versions == b.versions
    for p in range(len(a.versions)):
        for n, x in a.fragment(p)[1].items():
            np.testing.assert_allclose(b.fragment(p)[1][n], x, rtol=2e-4, atol=2e-6)
