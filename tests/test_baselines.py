"""The data-parallel baselines in the same engine (ALGORITHM.md §9): dp is exactly lock-step AdamW,
elastic_dp drops a missing learner after its timeout and takes it back; configs imply their settings."""

import jax
import numpy as np
import optax
import pytest

from dloco import build, compress, config, fragments, inner, outer
from dloco.policy import ContributionMeta
from dloco.sim import run_local
from dloco.syncer import SyncerCore

DP_SAFE = ("sync.", "fragments.")  # the tiny-run overrides dp replaces with its own (H = P = 1, τ = 0)


def dp_cfg(tiny_run, *overrides):
    return config.load(overrides=(*[o for o in tiny_run if not o.startswith(DP_SAFE)], "algorithm=dp", *overrides))


def test_dp_config_implies_lock_step_settings_and_rejects_conflicts():
    c = config.load(overrides=("algorithm=dp", "learners.count=3"))
    assert (c.sync.every, c.sync.overlap, c.fragments.count, c.syncer.quorum) == (1, 0, 1, 3)
    assert (c.compression.dtype, c.merge.rule, c.syncer.max_staleness) == ("fp32", "mean", 0)
    assert config.load(overrides=("algorithm=streaming", "learners.count=2")).syncer.quorum == 2
    with pytest.raises(config.ConfigError, match=r"sync\.every=8 is invalid: must be 1 for algorithm=dp"):
        config.load(overrides=("algorithm=dp", "sync.every=8"))
    with pytest.raises(config.ConfigError, match=r"syncer\.quorum=1 is invalid: must equal learners\.count=4"):
        config.load(overrides=("algorithm=elastic_dp", "syncer.quorum=1"))
    with pytest.raises(config.ConfigError, match=r"algorithm='sgd' is invalid"):
        config.load(overrides=("algorithm=sgd",))


def plain_adamw(cfg, steps: int) -> dict[str, np.ndarray]:
    """Learner 0's stream trained for `steps` steps by the plain jitted AdamW step on one device, as
    a single fragment (what dp with one learner computes, up to the compiler's rounding)."""
    bp = build.blueprint(cfg)
    mesh = inner.make_mesh(jax.devices()[:1])
    stream = build.stream(cfg, bp.corpus.load_split("train"), 0)
    state = inner.init_state(bp.plan.join(list(bp.initial)), cfg.inner, mesh)
    step = inner.make_train_step(bp.model, cfg.inner, mesh)
    for t in range(steps):
        params, opt, _ = step(state.params, state.opt_state, inner.shard_batch(stream.next_batch(), mesh), t)
        state = inner.TrainState(params, opt, t + 1)
    return bp.plan.split(state.params)[0]


def split_adamw(cfg, steps: int) -> dict[str, np.ndarray]:
    """The same training as `plain_adamw` by the two compiled programs dp runs: the gradient step,
    then the outer AdamW step on the host's fragment (what dp with one learner must equal bit for
    bit: the wire, the mean of one gradient and the store add nothing). The fused step is one XLA
    program, and XLA may round a few elements one ulp apart from the two (seen on an AVX-512 CPU:
    5 of 512 values in a 4-step llama run), so against it dp is equal to within float32 rounding."""
    bp = build.blueprint(cfg)
    mesh = inner.make_mesh(jax.devices()[:1])
    stream = build.stream(cfg, bp.corpus.load_split("train"), 0)
    grad, step = inner.make_grad_step(bp.model, mesh), outer.make_outer_step(cfg.inner)
    frag = {k: np.asarray(v) for k, v in bp.plan.split(bp.plan.join(list(bp.initial)))[0].items()}
    state = outer.init(cfg.inner, frag)
    for _ in range(steps):
        g, _ = grad(inner.replicate(bp.plan.join([frag]), mesh), inner.shard_batch(stream.next_batch(), mesh))
        frag, state = step(frag, state, {k: np.asarray(v) for k, v in bp.plan.split(g)[0].items()})
    return frag


def assert_dp_is_adamw(run, cfg, steps: int) -> None:
    """dp's global model equals `split_adamw` bit for bit and the fused AdamW step to float32 rounding."""
    exact, fused = split_adamw(cfg, steps), plain_adamw(cfg, steps)
    assert sorted(exact) == sorted(fused) == sorted(run.store.fragment(0)[1])
    for n, x in exact.items():
        np.testing.assert_array_equal(run.store.fragment(0)[1][n], x)
        np.testing.assert_allclose(x, fused[n], rtol=1e-4, atol=1e-6)


def test_dp_with_one_learner_is_plain_adamw_training_bit_for_bit(tiny_run, tmp_path):
    cfg = dp_cfg(tiny_run, "learners.count=1")
    run = run_local(cfg, tmp_path, steps=8, devices=1)
    assert run.store.versions == [8]  # one global update per step
    assert_dp_is_adamw(run, cfg, 8)


def test_dp_with_two_learners_applies_adamw_to_the_mean_gradient(tiny_run, tmp_path):
    cfg = dp_cfg(tiny_run, "learners.count=2")
    run = run_local(cfg, tmp_path, steps=3, devices=1)
    bp = build.blueprint(cfg)
    mesh = inner.make_mesh(jax.devices()[:1])
    tokens = bp.corpus.load_split("train")
    streams = [build.stream(cfg, tokens, m) for m in range(2)]
    grad = inner.make_grad_step(bp.model, mesh)
    tx = outer.outer_optimizer(cfg.inner)  # AdamW and the inner schedule
    params = bp.plan.join(list(bp.initial))
    state = tx.init(params)
    for _ in range(3):
        g0, _ = grad(inner.replicate(params, mesh), inner.shard_batch(streams[0].next_batch(), mesh))
        g1, _ = grad(inner.replicate(params, mesh), inner.shard_batch(streams[1].next_batch(), mesh))
        mean = jax.tree_util.tree_map(lambda a, b: (np.asarray(a) + np.asarray(b)) / 2, g0, g1)
        updates, state = tx.update(mean, state, params)
        params = optax.apply_updates(params, updates)
    merges = [e for e in run.events if e["event"] == "merge"]
    assert len(merges) == 3 and all(e["contributors"] == [0, 1] for e in merges)
    assert all(e["weights"] == pytest.approx([0.5, 0.5]) for e in merges)
    for n, x in bp.plan.split(params)[0].items():
        np.testing.assert_allclose(run.store.fragment(0)[1][n], x, rtol=2e-5, atol=1e-7)


def elastic_syncer(timeout=2.0, algorithm="elastic_dp"):
    cfg = config.load(overrides=(f"algorithm={algorithm}", "learners.count=3", f"syncer.elastic_timeout_s={timeout}"))
    params = {"embed": {"embedding": np.zeros((2, 2), np.float32)}, "w": np.zeros(4, np.float32)}
    plan = fragments.partition(params, 1)
    frs = [(0, f, outer.state_to_numpy(outer.init(outer.outer_config(cfg), f))) for f in plan.split(params)]
    s = SyncerCore(cfg, plan, fragments.embedding_names(plan.names), frs, {0: 1, 1: 1, 2: 1})
    grad = {
        n: compress.encode(np.full(shape, 0.1, np.float32), "fp32") for n, shape in plan.fragments[0].shape_map.items()
    }
    return s, grad


def push(s, grad, m, now, inc=1):
    meta = ContributionMeta(m, inc, 0, s.versions[0], 100, 1, s.versions[0] + 1, 0.1, None)
    return s.push(meta, grad, now)


def close(s, now):
    due, _ = s.ready(now)
    assert due == [0]
    items, grace = s.take(0, now)
    out = s.merge(0, items, grace_used=grace)
    s.committed(out, 0.01)
    return out


def test_elastic_dp_drops_a_missing_learner_after_the_timeout_and_takes_it_back():
    s, g = elastic_syncer(timeout=2.0)
    for m in range(3):
        assert push(s, g, m, now=0.0).accept
    assert close(s, 0.0).event["contributors"] == [0, 1, 2]  # everyone in: closes at once
    push(s, g, 0, now=1.0)
    push(s, g, 1, now=1.1)
    assert s.ready(2.5) == ([], pytest.approx(0.5))  # learner 2 missing: wait until 1.0 + 2.0
    out = close(s, 3.0)
    assert out.event["contributors"] == [0, 1] and out.event["dropped"] == [2]
    # the next rounds expect only 0 and 1: they close as soon as both pushed
    push(s, g, 0, now=3.1)
    push(s, g, 1, now=3.2)
    assert close(s, 3.2).event["dropped"] == []
    # learner 2 restarted (incarnation 2) and pushes again: it is expected from now on
    s.update_registry({0: 1, 1: 1, 2: 2})
    push(s, g, 2, now=4.0, inc=2)
    push(s, g, 0, now=4.1)
    assert s.ready(4.2)[0] == []  # waiting for 1 again
    push(s, g, 1, now=4.3)
    assert close(s, 4.3).event["contributors"] == [0, 1, 2]


def test_dp_never_drops_anyone():
    s, g = elastic_syncer(algorithm="dp")  # the same core with a plain quorum K = M
    push(s, g, 0, now=0.0)
    push(s, g, 1, now=0.0)
    assert s.ready(1000.0, live_learners=3) == ([], None)  # waits for learner 2 forever
