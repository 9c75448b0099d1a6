"""The llama family (`model.family: llama`) and the mixture of experts: parameter counts by hand,
grouped-query attention against a plain reference, bfloat16 compute over float32 parameters, the
experts' combination and balance loss by hand, and training: dp is plain AdamW bit for bit,
decoupled lowers the loss."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_baselines import assert_dp_is_adamw

from dloco import build, config, inner, model
from dloco.sim import run_local

# on the `micro` test preset (d_model 32, 2 heads): one key/value head for two query heads, untied
LLAMA = ("model.family=llama", "model.n_kv_heads=1", "model.tie_embeddings=false")


def by_hand(d, layers, heads, kv, vocab, ratio=4, tied=False):
    """Parameters of a llama model: per layer q, out (d²), k, v (d·kv·hd), SwiGLU 3·d·f, 2 norms;
    the embedding, an untied head and the final norm."""
    hd = d // heads
    f = -(-(2 * ratio * d // 3 + (2 * ratio * d % 3 > 0)) // 8) * 8
    layer = 2 * d * d + 2 * d * kv * hd + 3 * d * f + 2 * d
    return layers * layer + vocab * d * (1 if tied else 2) + d


@pytest.mark.parametrize(
    "preset, dims, expected",
    [
        ("llama-micro", (32, 1, 4, 2, 257), 28_064),
        ("llama-125m", (768, 12, 12, 4, 32768), 125_848_320),
        ("llama-350m", (1024, 24, 16, 8, 32768), 344_376_320),
        ("llama-1b", (2048, 20, 32, 8, 32768), 1_015_433_216),
    ],
)
def test_preset_parameter_counts_by_hand(preset, dims, expected):
    c = config.load(overrides=(f"preset={preset}",))
    d, layers, heads, kv, vocab = dims
    assert (c.model.d_model, c.model.n_layers, c.model.n_heads, c.model.n_kv_heads) == (d, layers, heads, kv)
    shapes = jax.eval_shape(functools.partial(model.init_params, model.build(c.model, vocab), 0, 8))
    assert model.count_params(shapes) == by_hand(d, layers, heads, kv, vocab) == expected
    assert shapes["lm_head"]["kernel"].shape == (d, vocab) and shapes["embed"]["embedding"].dtype == jnp.float32


def test_grouped_query_attention_matches_a_plain_reference():
    cfg = config.load(overrides=("model.family=llama", "model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2"))
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 7, 32))
    att = model.GQAttention(cfg.model)
    p = att.init(jax.random.PRNGKey(0), x)["params"]
    got = att.apply({"params": p}, x)
    q = model.rotary((x @ p["q"]["kernel"]).reshape(2, 7, 4, 8), cfg.model.rope_base)
    k = model.rotary((x @ p["k"]["kernel"]).reshape(2, 7, 2, 8), cfg.model.rope_base)
    v = (x @ p["v"]["kernel"]).reshape(2, 7, 2, 8)
    k, v = jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2)  # query heads 0, 1 share kv head 0; 2, 3 head 1
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(8.0)
    s = jnp.where(jnp.tril(jnp.ones((7, 7), bool)), s, -jnp.inf)
    ref = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v).reshape(2, 7, 32) @ p["out"]["kernel"]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_bfloat16_compute_keeps_float32_parameters_and_the_loss_close():
    tokens = jnp.asarray(np.arange(2 * 33).reshape(2, 33) % 257)
    out = {}
    for dtype in ("float32", "bfloat16"):
        c = config.load(overrides=("preset=llama-micro", f"model.dtype={dtype}"))
        m = model.build(c.model, 257)
        params = model.init_params(m, 0, 32)  # the same seed: the same float32 parameters
        assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(params))
        out[dtype] = (m.apply({"params": params}, tokens[:, :-1]).dtype, inner.lm_loss(m, params, tokens))
    assert out["float32"][0] == jnp.float32 and out["bfloat16"][0] == jnp.bfloat16
    (l32, n), (l16, _) = out["float32"][1], out["bfloat16"][1]
    assert float(l16 / n) == pytest.approx(float(l32 / n), rel=0.01)  # bf16 keeps ~3 significant digits


def test_dp_with_one_learner_trains_llama_as_plain_adamw_bit_for_bit(tiny_run, tmp_path):
    overrides = [o for o in tiny_run if not o.startswith(("sync.", "fragments."))]
    cfg = config.load(overrides=(*overrides, *LLAMA, "algorithm=dp", "learners.count=1"))
    run = run_local(cfg, tmp_path, steps=4, devices=1)
    assert "lm_head/kernel" in run.store.fragment(0)[1]
    assert_dp_is_adamw(run, cfg, 4)


def test_decoupled_training_of_llama_lowers_the_validation_loss(tiny_run, tmp_path):
    cfg = config.load(overrides=(*tiny_run, *LLAMA, "learners.count=2"))
    run = run_local(cfg, tmp_path, steps=48)
    bp = build.blueprint(cfg)
    mesh = inner.make_mesh()
    step, batches = inner.make_eval_step(bp.model, mesh), build.eval_set(cfg, bp.corpus)
    before = inner.evaluate(step, inner.replicate(bp.plan.join(list(bp.initial)), mesh), batches, mesh)
    theta = bp.plan.join([run.store.fragment(p)[1] for p in range(bp.plan.count)])
    after = inner.evaluate(step, inner.replicate(theta, mesh), batches, mesh)
    assert before == pytest.approx(np.log(257), abs=0.1) and after < before - 0.5


MOE = ("model.n_experts=4", "model.experts_per_token=2")


def test_a_mixture_of_experts_combines_the_top_k_experts_by_hand():
    cfg = config.load(overrides=("preset=llama-micro", *MOE)).model
    x = jax.random.normal(jax.random.PRNGKey(1), (1, 3, 32))
    moe = model.MoE(cfg)
    p = moe.init(jax.random.PRNGKey(0), x)["params"]
    got, sown = moe.apply({"params": p}, x, mutable=["losses"])
    probs = jax.nn.softmax(x @ p["router"]["kernel"], axis=-1)
    for t in range(3):
        top = np.argsort(-np.asarray(probs[0, t]))[:2]
        gates = np.asarray(probs[0, t])[top] / np.asarray(probs[0, t])[top].sum()
        want = sum(
            g * (jax.nn.silu(x[0, t] @ p["w_gate"][e]) * (x[0, t] @ p["w_in"][e])) @ p["w_out"][e]
            for g, e in zip(gates, top, strict=True)
        )
        np.testing.assert_allclose(got[0, t], want, rtol=1e-5, atol=1e-6)
    # the balance loss by hand: E · Σ_e (share of the 6 routed slots to e) · (mean probability of e)
    idx = np.argsort(-np.asarray(probs[0]), axis=-1)[:, :2]
    share = np.bincount(idx.ravel(), minlength=4) / 6
    (balance,) = jax.tree_util.tree_leaves(sown)
    assert float(balance) == pytest.approx(0.01 * 4 * float(np.sum(share * np.asarray(probs[0]).mean(0))), rel=1e-5)


def test_balanced_routing_costs_exactly_the_weight_and_evaluation_leaves_it_out():
    cfg = config.load(overrides=("preset=llama-micro", *MOE, "model.moe_aux_weight=0.5")).model
    m = model.build(cfg, 257)
    params = model.init_params(m, 0, 8)
    zero = jax.tree_util.tree_map(jnp.zeros_like, params["block_0"]["moe"]["router"])  # uniform routing
    params = {**params, "block_0": {**params["block_0"], "moe": {**params["block_0"]["moe"], "router": zero}}}
    batch = jnp.asarray(np.arange(18).reshape(2, 9))
    (train, n), (ce, _) = inner.lm_loss(m, params, batch, aux=True), inner.lm_loss(m, params, batch)
    assert float(train / n - ce / n) == pytest.approx(0.5, abs=1e-6)  # E·Σ f·P = 1 when P is uniform


def test_a_mixture_of_experts_trains_decoupled_with_its_expert_tensors_in_fragments(tiny_run, tmp_path):
    cfg = config.load(overrides=(*tiny_run, *LLAMA, *MOE, "learners.count=2"))
    bp = build.blueprint(cfg)
    shapes = {n: s for f in bp.plan.fragments for n, s in zip(f.names, f.shapes, strict=True)}
    assert shapes["block_0/moe/w_in"] == (4, 32, 88) and shapes["block_0/moe/w_out"] == (4, 88, 32)
    run = run_local(cfg, tmp_path, steps=48)
    assert all(v >= 2 for v in run.store.versions)  # every fragment merged, expert tensors included
    mesh = inner.make_mesh()
    step, batches = inner.make_eval_step(bp.model, mesh), build.eval_set(cfg, bp.corpus)
    before = inner.evaluate(step, inner.replicate(bp.plan.join(list(bp.initial)), mesh), batches, mesh)
    theta = bp.plan.join([run.store.fragment(p)[1] for p in range(bp.plan.count)])
    assert inner.evaluate(step, inner.replicate(theta, mesh), batches, mesh) < before - 0.5
