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
    cfg = config.OuterConfig()
    theta = {"a": np.ones(3, np.float32), "b": np.zeros((2, 2), np.float32)}
    step = outer.make_outer_step(cfg)
    _, state = step(theta, outer.init(cfg, theta), {"a": np.full(3, 2.0, np.float32), "b": np.eye(2, dtype=np.float32)})
    leaves = outer.state_to_numpy(state)
    restored = outer.state_from_numpy(cfg, theta, leaves)
    for x, y in zip(leaves, outer.state_to_numpy(restored), strict=True):
        np.testing.assert_array_equal(x, y)
    # the momentum trace holds Δ after one step
    np.testing.assert_array_equal(sorted(x.sum() for x in leaves), [2.0, 6.0])
