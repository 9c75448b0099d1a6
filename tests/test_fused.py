"""The fused merge + outer pass (`outer.make_merge_step`, `kernels.combine_outer`) against its
reference, `merge.merge_fragment` followed by the jitted optax step (`outer.make_outer_step`):
the same Θ and outer state, bit for bit (float32 bits compared as integers, so −0 ≠ +0), on random
inputs of many sizes, every outer rule and both merge rules, subnormals included."""

from __future__ import annotations

import dataclasses

import numba
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from dloco import compress, config, kernels, merge, outer

pytestmark = pytest.mark.skipif(not kernels.FUSED, reason="the fused pass needs x86-64 with FMA")

PLAIN = config.OuterConfig()  # plain averaging: η 1, μ 0
SGD = config.OuterConfig(lr=0.7)  # Θ − η·Δ: a multiply-add that rounds once
NESTEROV = config.OuterConfig(lr=0.7, momentum=0.9, delay=1)
MOMENTUM = config.OuterConfig(lr=0.7, momentum=0.9, nesterov=False, delay=1)
DELAYED = config.OuterConfig(lr=0.7, momentum=0.9, delay=3)  # Delayed Nesterov, N = 3
CONFIGS = {"plain": PLAIN, "sgd": SGD, "nesterov": NESTEROV, "momentum": MOMENTUM, "delayed": DELAYED}


def bits(x) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.uint32)


def assert_same(got: tuple, want: tuple) -> None:
    """Θ (by name, in the same order) and the outer-state leaves, bit for bit."""
    (gv, gs), (wv, ws) = got, want
    assert list(gv) == list(wv)
    for k in wv:
        assert gv[k].shape == wv[k].shape and not gv[k].flags.writeable
        np.testing.assert_array_equal(bits(gv[k]), bits(wv[k]), err_msg=k)
    gl, wl = outer.state_to_numpy(gs), outer.state_to_numpy(ws)
    assert [x.shape for x in gl] == [x.shape for x in wl]
    for x, y in zip(gl, wl, strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(
            x.view(np.uint32) if x.dtype == np.float32 else x, y.view(np.uint32) if y.dtype == np.float32 else y
        )


def with_subnormals(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """`x` with about 1 value in 8 replaced by a subnormal, ±0 or the smallest normal."""
    special = np.array([1e-39, -1e-39, 1e-45, -0.0, 0.0, 1.1754944e-38, -1.1754944e-38, 5e-40], np.float32)
    pick = rng.random(x.shape) < 0.125
    return np.where(pick, rng.choice(special, x.shape), x).astype(np.float32)


def fragment(shapes: dict[str, tuple[int, ...]], rng: np.random.Generator, subnormal: bool) -> dict[str, np.ndarray]:
    out = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    return {k: with_subnormals(v, rng) for k, v in out.items()} if subnormal else out


def pushes(shapes, m, dtype, block, rng) -> list[dict[str, compress.Payload]]:
    """M packed pushes (values about 1e-3: float16 block scales about 1e-4)."""
    return [
        {
            k: compress.encode(rng.standard_normal(s).astype(np.float32) * np.float32(1e-3 * (1 + i)), dtype, block)
            for k, s in shapes.items()
        }
        for i in range(m)
    ]


def random_state(cfg, theta, rng, subnormal):
    """An outer state with nonzero momentum and buffer (what a few commits leave)."""
    state = outer.init(cfg, theta)
    leaves = [
        fragment({"x": x.shape}, rng, subnormal)["x"] * np.float32(1e-2) if x.ndim else x
        for x in outer.state_to_numpy(state)
    ]
    return outer.state_from_numpy(cfg, theta, leaves)


def run_both(cfg, theta, state, deltas, weights, rounds, **kw):
    """`rounds` commits (contributions n each) through both paths, each path carrying its own state."""
    ref, fused = outer.make_outer_step(cfg), outer.make_merge_step(cfg)
    a = b = (theta, state)
    for n in rounds:
        want = ref(a[0], a[1], merge.merge_fragment(deltas, weights, **kw), n)
        got = fused(b[0], b[1], deltas, weights, **kw, contributions=n)
        assert_same(got, want)
        a, b = want, got
    return b


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("rule", ["rda", "mean"])
def test_fused_is_the_jitted_step_on_the_merge(name, rule):
    cfg, rng = CONFIGS[name], np.random.default_rng(0)
    shapes = {"b": (7,), "w": (300, 257), "e": (33, 64), "z": (1,)}
    theta = fragment(shapes, rng, subnormal=False)
    deltas = pushes(shapes, 3, "int4", 128, rng)
    weights = merge.token_weights([100, 250, 80], [5, 10, 4])
    norms = [merge.tensor_norms({k: compress.decode(p) for k, p in d.items()}) for d in deltas]
    state = random_state(cfg, theta, rng, subnormal=False)
    # Delayed Nesterov with N = 3: counts 2 (hold), 4 ≥ 3 (fire), 1, 3 (fire)
    kw = {"rule": rule, "embedding": {"e"}, "norms": norms, "scale": 0.6}
    run_both(cfg, theta, state, deltas, weights, [2, 2, 1, 2], **kw)


@pytest.mark.slow
@settings(  # no shrinking: each example compiles a jitted step, and a failure reports its inputs as drawn
    max_examples=25,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    n=st.sampled_from([1, 2, 3, 63, 64, 65, 127, 128, 129, 255, 4097, 32_767, 32_768, 32_769, 65_537, 300_001]),
    dtype=st.sampled_from(["int8", "int4", "int2"]),
    block=st.sampled_from([4, 64, 128]),
    m=st.integers(1, 5),
    name=st.sampled_from(list(CONFIGS)),
    rule=st.sampled_from(["rda", "mean"]),
    scale=st.sampled_from([1.0, 0.37, 1e-3, 1e-35]),  # 1e-35: Δ about 1e-39, subnormal
    subnormal=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_fused_matches_on_random_inputs(n, dtype, block, m, name, rule, scale, subnormal, seed):
    cfg, rng = CONFIGS[name], np.random.default_rng(seed)
    shapes = {"a": (n,), "b": (3, 5)}
    theta = fragment(shapes, rng, subnormal)
    deltas = pushes(shapes, m, dtype, block, rng)
    weights = rng.uniform(0.1, 10.0, m)
    state = random_state(cfg, theta, rng, subnormal)
    run_both(cfg, theta, state, deltas, weights, [int(rng.integers(1, 4)) for _ in range(2)], rule=rule, scale=scale)


def test_subnormal_and_signed_zero_values_follow_xla():
    """XLA's CPU runtime flushes subnormal inputs and results to zero (and fuses multiply-adds);
    the kernel's update phase does the same, and its decode does not (the sum is numpy's)."""
    rng = np.random.default_rng(3)
    n = 50_000
    for cfg in CONFIGS.values():
        theta = {"x": with_subnormals(rng.standard_normal(n).astype(np.float32) * np.float32(1e-37), rng)}
        deltas = pushes({"x": (n,)}, 2, "int4", 128, rng)
        state = random_state(cfg, theta, rng, subnormal=True)
        for scale in (1.0, 1e-35):  # 1e-35: Δ about 1e-39, subnormal
            run_both(cfg, theta, state, deltas, [1.0, 3.0], [1, 2, 3], rule="mean", scale=scale)
    # the calling thread's floating-point mode is its own again: numpy keeps subnormals
    assert np.float32(1e-20) * np.float32(1e-20) > 0


def test_the_workers_floating_point_mode_is_restored():
    """After a fused pass, `combine` (no flushing) still gives the numpy path's subnormal values."""
    rng = np.random.default_rng(4)
    ps = pushes({"x": (100_000,)}, 3, "int4", 128, rng)
    flats = [p["x"] for p in ps]
    theta = {"x": rng.standard_normal(100_000).astype(np.float32)}
    outer.make_merge_step(PLAIN)(theta, outer.init(PLAIN, theta), ps, [1.0, 1.0, 1.0], rule="mean")
    got, _ = merge._combine(flats, [1e-35, 1e-35, 1e-35])
    want = merge._combine_chunks(flats, [1e-35, 1e-35, 1e-35])
    assert (np.abs(want[want != 0]) < 1.1754944e-38).any()  # the sum has subnormal values
    np.testing.assert_array_equal(bits(got), bits(want))


def test_results_do_not_depend_on_the_number_of_threads():
    rng = np.random.default_rng(5)
    shapes = {"w": (400_003,)}
    theta, deltas = fragment(shapes, rng, False), pushes(shapes, 4, "int4", 128, rng)
    step = outer.make_merge_step(DELAYED)
    state = random_state(DELAYED, theta, rng, False)
    runs = []
    for threads in (1, numba.config.NUMBA_NUM_THREADS):
        numba.set_num_threads(threads)
        try:
            runs.append(step(theta, state, deltas, [1.0, 2.0, 3.0, 4.0], contributions=3))
        finally:
            numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    assert_same(runs[0], runs[1])


def test_plan_falls_back_where_the_kernels_do_not_apply():
    """fp32 or bf16 pushes, float arrays and a mix of dtypes merge unfused (`plan_fragment` None), with
    the reference's bits; so does AdamW (dp), through the jitted step."""
    rng = np.random.default_rng(7)
    shapes = {"w": (1000,)}
    theta = fragment(shapes, rng, False)
    arrays = [{"w": rng.standard_normal(1000).astype(np.float32)} for _ in range(2)]
    for deltas in (
        [{"w": compress.encode(a["w"], "fp32")} for a in arrays],
        [{"w": compress.encode(a["w"], "bf16")} for a in arrays],
        arrays,
        [{"w": compress.encode(arrays[0]["w"], "int4")}, {"w": compress.encode(arrays[1]["w"], "int8")}],
    ):
        assert merge.plan_fragment(deltas, [1.0, 1.0]) is None
        run_both(NESTEROV, theta, outer.init(NESTEROV, theta), deltas, [1.0, 1.0], [1])
    coded = [{"w": compress.pack(compress.encode(np.repeat(a["w"][:10], 100), "int4"), "zstd")} for a in arrays]
    assert all(d["w"].entropy == "zstd" for d in coded)  # its codes are a zstd frame: never the kernels' input
    assert merge.plan_fragment(coded, [1.0, 1.0]) is None
    dp = config.InnerConfig()
    packed = [{"w": compress.encode(a["w"], "int4")} for a in arrays]
    run_both(dp, theta, outer.init(dp, theta), packed, [1.0, 1.0], [1, 1])


def test_plan_is_the_merge():
    """Δ from a plan (factor · Σ, the sum as `combine` computes it) is `merge_fragment`'s Δ, bit for
    bit; RDA's plan holds that sum, and its fallback to the mean is planned as the mean."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal(5000).astype(np.float32)
    cancel = [{"w": compress.encode(x, "int4")}, {"w": compress.encode(-x, "int4")}]
    plain = pushes({"w": (5000,)}, 3, "int4", 128, rng)
    for deltas, w in ((cancel, [1.0, 1.0]), (plain, [1.0, 2.0, 3.0])):
        for rule in ("rda", "mean"):
            plan = merge.plan_fragment(deltas, w, rule, scale=0.5)["w"]
            delta, _ = kernels.combine(plan.codes, plan.scales, 5000, plan.block, plan.dtype)
            if plan.summed is not None:
                np.testing.assert_array_equal(bits(plan.summed), bits(delta))
            if plan.factor is not None:
                delta = delta * plan.factor
            np.testing.assert_array_equal(bits(delta), bits(merge.merge_fragment(deltas, w, rule, scale=0.5)["w"]))
    rda = merge.plan_fragment(cancel, [1.0, 1.0], "rda")["w"]
    assert rda.factor is None and rda.summed is None  # the directions cancel: the mean, nothing summed yet


def test_delayed_counts_as_the_jitted_step():
    cfg = dataclasses.replace(DELAYED, delay=4)
    rng = np.random.default_rng(9)
    shapes = {"w": (2048,)}
    theta, deltas = fragment(shapes, rng, False), pushes(shapes, 2, "int4", 128, rng)
    _, state = run_both(cfg, theta, outer.init(cfg, theta), deltas, [1.0, 1.0], [1, 1, 1, 1, 3, 2, 5])
    assert int(state.count) == 0  # 1 + 1 + 1 + 1 fires, 3 holds, 3 + 2 fires, 5 fires


def test_warm_compiles_what_the_config_runs():
    """`outer.warm_merge_step` loads each kernel the config's fused step takes (none for AdamW); the
    step after it gives the reference's bits as before."""
    outer.warm_merge_step(DELAYED, "int4")
    outer.warm_merge_step(config.InnerConfig(), "int4")
    rng = np.random.default_rng(10)
    shapes = {"w": (4096,)}
    theta, deltas = fragment(shapes, rng, False), pushes(shapes, 2, "int4", 128, rng)
    run_both(DELAYED, theta, outer.init(DELAYED, theta), deltas, [1.0, 1.0], [1, 2])
