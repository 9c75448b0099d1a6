"""Model and inner step: causality, the lr schedule, data-parallel equivalence on 1 vs 2 devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dloco import config, inner, model


@pytest.fixture(scope="module")
def setup():
    cfg = config.load(overrides=("model.d_model=32", "model.n_heads=2", "model.n_layers=1", "inner.batch_size=4"))
    m = model.build(cfg.model, vocab_size=50)
    return cfg, m, model.init_params(m, seed=0, seq_len=16)


def test_shapes_and_causality(setup):
    _, m, params = setup
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50, size=(2, 16))
    logits = m.apply({"params": params}, tokens)
    assert logits.shape == (2, 16, 50)
    changed = tokens.copy()
    changed[:, 10:] = (changed[:, 10:] + 1) % 50
    logits2 = m.apply({"params": params}, changed)
    np.testing.assert_allclose(logits[:, :10], logits2[:, :10], rtol=1e-5, atol=1e-5)
    assert not np.allclose(logits[:, 10:], logits2[:, 10:])


def test_same_seed_same_params_and_tied_embedding(setup):
    cfg, m, params = setup
    again = model.init_params(m, seed=0, seq_len=16)
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(again), strict=True):
        np.testing.assert_array_equal(a, b)
    assert params["embed"]["embedding"].shape == (50, 32)
    assert "head" not in params  # the output head is tied to the embedding
    # 1 layer d32: embed 1600 + qkv 3072 + out 1024 + mlp 2·4096 + 3 norms of 32
    assert model.count_params(params) == 1600 + 3072 + 1024 + 8192 + 96


def test_initial_loss_is_near_uniform(setup):
    _, m, params = setup
    batch = jnp.asarray(np.random.default_rng(1).integers(0, 50, size=(4, 17)))
    total, count = inner.lm_loss(m, params, batch)
    assert float(count) == 64
    assert float(total / count) == pytest.approx(np.log(50), abs=0.1)


def test_schedule_warmup_then_cosine():
    cfg = config.InnerConfig(lr=1e-3, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    lr = inner.schedule(cfg)
    assert float(lr(0)) == 0.0
    assert float(lr(5)) == pytest.approx(5e-4)
    assert float(lr(10)) == pytest.approx(1e-3)
    assert float(lr(60)) == pytest.approx(1e-4 + 0.5 * 9e-4, rel=1e-5)  # half-way through the cosine
    assert float(lr(110)) == pytest.approx(1e-4)


def _train(m, cfg, params, batches, devices):
    mesh = inner.make_mesh(devices)
    state = inner.init_state(params, cfg.inner, mesh)
    step = inner.make_train_step(m, cfg.inner, mesh)
    losses = []
    p, o = state.params, state.opt_state
    for t, b in enumerate(batches):
        p, o, metrics = step(p, o, inner.shard_batch(b, mesh), t)
        losses.append(float(metrics["loss"]))
    return jax.device_get(p), losses


def test_data_parallel_on_two_devices_matches_one_device(setup):
    cfg, m, params = setup
    assert len(jax.devices()) == 2, "conftest sets --xla_force_host_platform_device_count=2"
    rng = np.random.default_rng(2)
    batches = [rng.integers(0, 50, size=(4, 17)).astype(np.int32) for _ in range(5)]
    p1, l1 = _train(m, cfg, params, batches, jax.devices()[:1])
    p2, l2 = _train(m, cfg, params, batches, jax.devices())
    np.testing.assert_allclose(l1, l2, rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(p1), jax.tree_util.tree_leaves(p2), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_training_lowers_loss_on_a_repeated_batch(setup):
    cfg, m, params = setup
    cfg = config.replace(cfg, "inner.warmup_steps=2", "inner.lr=0.01")
    batch = np.tile(np.arange(17, dtype=np.int32), (4, 1)) % 50
    _, losses = _train(m, cfg, params, [batch] * 30, jax.devices())
    assert losses[-1] < 0.5 * losses[0]


def test_batch_must_divide_by_devices():
    mesh = inner.make_mesh()
    with pytest.raises(ValueError, match="batch size 3 must be a multiple of the 2 devices"):
        inner.shard_batch(np.zeros((3, 5), np.int32), mesh)


def test_evaluate_averages_over_tokens(setup):
    _, m, params = setup
    mesh = inner.make_mesh()
    rng = np.random.default_rng(3)
    batches = [rng.integers(0, 50, size=(2, 9)).astype(np.int32) for _ in range(3)]
    ev = inner.make_eval_step(m, mesh)
    expected = sum(float(inner.lm_loss(m, params, jnp.asarray(b))[0]) for b in batches) / (3 * 2 * 8)
    assert inner.evaluate(ev, inner.replicate(params, mesh), batches, mesh) == pytest.approx(expected, rel=1e-5)


def test_gradient_accumulation_takes_the_same_steps_as_the_whole_batch(setup):
    """inner.accum_steps=4 splits each batch of 8 into 4 micro-batches of 2 (rows i, i+4: each
    spread over both devices) and averages their gradients: the same losses and parameters as one
    pass over the batch, up to float rounding; the dp gradient step too; a batch that does not
    split evenly is refused naming the field."""
    cfg, m, params = setup
    rng = np.random.default_rng(3)
    batches = [rng.integers(0, 50, size=(8, 17)).astype(np.int32) for _ in range(3)]
    whole = config.replace(cfg, "inner.batch_size=8")
    accum = config.replace(cfg, "inner.batch_size=8", "inner.accum_steps=4")
    p1, l1 = _train(m, whole, params, batches, jax.devices())
    p4, l4 = _train(m, accum, params, batches, jax.devices())
    np.testing.assert_allclose(l4, l1, rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(p4), jax.tree_util.tree_leaves(p1), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    mesh = inner.make_mesh()
    g1, _ = inner.make_grad_step(m, mesh)(inner.replicate(params, mesh), inner.shard_batch(batches[0], mesh))
    g4, _ = inner.make_grad_step(m, mesh, accum=4)(inner.replicate(params, mesh), inner.shard_batch(batches[0], mesh))
    for a, b in zip(jax.tree_util.tree_leaves(g4), jax.tree_util.tree_leaves(g1), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)
    with pytest.raises(
        config.ConfigError, match=r"inner.batch_size=6 is invalid: must be a multiple of inner.accum_steps=4"
    ):
        config.replace(cfg, "inner.batch_size=6", "inner.accum_steps=4")
