"""Outer optimizer (ALGORITHM.md §6): Nesterov SGD on a known vector, state round trip."""

import numpy as np

from dloco import config, outer


def test_nesterov_outer_step_on_known_vector():
    cfg = config.OuterConfig(lr=0.7, momentum=0.9, nesterov=True)
    theta = {"w": np.array([1.0, 2.0], np.float32)}
    delta = {"w": np.array([0.5, -1.0], np.float32)}
    step, state = outer.make_outer_step(cfg), outer.init(cfg, theta)
    # m = Δ = [0.5, -1]; Θ ← Θ − 0.7·(Δ + 0.9·m) = [1 − 0.665, 2 + 1.33]
    theta, state = step(theta, state, delta)
    np.testing.assert_allclose(theta["w"], [0.335, 3.33], rtol=1e-6)
    # m = 0.9·[0.5, -1] + Δ = [0.95, -1.9]; Θ ← Θ − 0.7·(Δ + 0.9·m) = Θ − 0.7·[1.355, -2.71]
    theta, state = step(theta, state, delta)
    np.testing.assert_allclose(theta["w"], [0.335 - 0.9485, 3.33 + 1.897], rtol=1e-6)
    assert isinstance(theta["w"], np.ndarray)


def test_plain_sgd_without_momentum():
    cfg = config.OuterConfig(lr=1.0, momentum=0.0)
    theta = {"w": np.array([1.0, 2.0], np.float32)}
    step = outer.make_outer_step(cfg)
    theta, _ = step(theta, outer.init(cfg, theta), {"w": np.array([0.25, 0.5], np.float32)})
    np.testing.assert_allclose(theta["w"], [0.75, 1.5])


def test_state_round_trip_through_numpy():
    cfg = config.OuterConfig(lr=0.7, momentum=0.9, delay=1)
    theta = {"a": np.ones(3, np.float32), "b": np.zeros((2, 2), np.float32)}
    step = outer.make_outer_step(cfg)
    _, state = step(theta, outer.init(cfg, theta), {"a": np.full(3, 2.0, np.float32), "b": np.eye(2, dtype=np.float32)})
    leaves = outer.state_to_numpy(state)
    restored = outer.state_from_numpy(cfg, theta, leaves)
    for x, y in zip(leaves, outer.state_to_numpy(restored), strict=True):
        np.testing.assert_array_equal(x, y)
    # the momentum trace holds Δ after one step
    np.testing.assert_array_equal(sorted(x.sum() for x in leaves), [2.0, 6.0])


def _run(tx, deltas, counts):
    import jax.numpy as jnp

    theta = {"w": jnp.array([1.0, 2.0])}
    state = tx.init(theta)
    for d, n in zip(deltas, counts, strict=True):
        kw = {"contributions": n} if isinstance(tx, outer.optax.GradientTransformationExtraArgs) else {}
        up, state = tx.update({"w": jnp.asarray(d, jnp.float32)}, state, theta, **kw)
        theta = outer.optax.apply_updates(theta, up)
    return np.asarray(theta["w"]), state


def test_delayed_nesterov_with_delay_one_is_per_commit_nesterov():
    deltas = [[0.5, -1.0], [0.25, 0.5], [-0.1, 0.3]]
    ours, _ = _run(outer.delayed_nesterov(0.7, 0.9, 1), deltas, [1, 1, 1])
    ref, _ = _run(outer.optax.sgd(0.7, momentum=0.9, nesterov=True), deltas, [1, 1, 1])
    np.testing.assert_allclose(ours, ref, rtol=1e-6)


def test_delayed_nesterov_updates_momentum_once_per_n_contributions():
    # N = 4; commits merge 1, 2, 1 contributions (the momentum moves at the third), then 1.
    # η = 0.5, μ = 0.9, Θ0 = [1, 2]
    tx = outer.delayed_nesterov(0.5, 0.9, 4)
    d1, d2, d3, d4 = [0.2, 0.0], [0.4, -0.2], [0.2, 0.2], [1.0, 1.0]
    theta, state = _run(tx, [d1, d2], [1, 2])
    # two plain steps: Θ = Θ0 − 0.5·(d1 + d2) = [1 − 0.3, 2 + 0.1]
    np.testing.assert_allclose(theta, [0.7, 2.1], rtol=1e-6)
    np.testing.assert_allclose(state.buffer["w"], [0.6, -0.2], rtol=1e-6)
    assert int(state.count) == 3
    # third commit: c = 4 ≥ N: m = 0.9·0 + (d1 + d2 + d3) = [0.8, 0]; Θ −= 0.5·(d3 + 0.9·m) = 0.5·[0.92, 0.2]
    theta, state = _run(tx, [d1, d2, d3], [1, 2, 1])
    np.testing.assert_allclose(theta, [0.7 - 0.46, 2.1 - 0.1], rtol=1e-6)
    np.testing.assert_allclose(state.momentum["w"], [0.8, 0.0], rtol=1e-6)
    np.testing.assert_allclose(state.buffer["w"], [0.0, 0.0])
    assert int(state.count) == 0
    # fourth: a plain step again (the momentum is not applied between its updates)
    theta, _ = _run(tx, [d1, d2, d3, d4], [1, 2, 1, 1])
    np.testing.assert_allclose(theta, [0.24 - 0.5, 2.0 - 0.5], rtol=1e-6)


def test_one_period_of_partial_merges_equals_one_synchronous_nesterov_step():
    # M = 4 share-scaled partial merges of one learner each add up to the period's mean Δ; with
    # N = 4 the period ends where synchronous Nesterov on that mean ends (first period: m = 0).
    parts = [[0.1, 0.0], [0.0, 0.2], [0.3, -0.1], [0.2, 0.1]]
    total = np.sum(parts, axis=0)
    delayed, _ = _run(outer.delayed_nesterov(0.7, 0.9, 4), parts, [1, 1, 1, 1])
    sync, _ = _run(outer.optax.sgd(0.7, momentum=0.9, nesterov=True), [total], [4])
    np.testing.assert_allclose(delayed, sync, rtol=1e-6)
    per_commit, _ = _run(outer.optax.sgd(0.7, momentum=0.9, nesterov=True), parts, [1, 1, 1, 1])
    assert not np.allclose(per_commit, sync, rtol=1e-3)  # momentum compounded over the partial merges


def test_outer_config_resolves_the_delay_to_the_learner_count():
    cfg = config.load(overrides=("learners.count=6", "outer.momentum=0.9", "outer.lr=0.7"))
    assert outer.outer_config(cfg).delay == 6
    assert outer.outer_config(config.replace(cfg, "outer.delay=1")).delay == 1
    # its state round-trips through the store's numpy leaves
    theta = {"w": np.ones(2, np.float32)}
    ocfg = outer.outer_config(cfg)
    step = outer.make_outer_step(ocfg)
    _, state = step(theta, outer.init(ocfg, theta), {"w": np.full(2, 0.5, np.float32)}, 2)
    restored = outer.state_from_numpy(ocfg, theta, outer.state_to_numpy(state))
    assert int(restored.count) == 2
    np.testing.assert_array_equal(restored.buffer["w"], [0.5, 0.5])
