"""The learner's algorithm without transport (ALGORITHM.md §4): pushes, receive modes, and the
one-learner reduction of the outer loop to plain inner training."""

import jax
import numpy as np
import pytest

from dloco import build, compress, config, inner, merge, outer
from dloco.learner import LearnerCore

SMALL = ("model.d_model=32", "model.n_heads=2", "model.n_layers=1", "inner.batch_size=4", "data.seq_len=16")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("data"))


def make(cache, *overrides, learner_id=0):
    cfg = config.load(overrides=(*SMALL, f"data.cache_dir={cache}", "data.max_bytes=300000", *overrides))
    bp = build.blueprint(cfg)
    stream = build.stream(cfg, bp.corpus.load_split("train"), learner_id)
    core = LearnerCore(
        cfg, learner_id, 1, bp.model, inner.make_mesh(), bp.plan, list(bp.initial), [0] * bp.plan.count, stream
    )
    return cfg, bp, core


def test_one_learner_every_step_outer_lr_one_equals_plain_training(cache):
    cfg, bp, core = make(
        cache,
        "learners.count=1",
        "fragments.count=1",
        "sync.every=1",
        "sync.overlap=0",
        "syncer.quorum=1",
        "outer.lr=1.0",
        "outer.momentum=0.0",
        "compression.dtype=fp32",
    )
    theta = dict(bp.initial[0])
    state, outer_step = outer.init(cfg.outer, theta), outer.make_outer_step(cfg.outer)
    for version in range(12):
        _, pushes = core.step()
        assert len(pushes) == 1 and pushes[0].meta.base_version == version
        push = pushes[0]
        delta = {n: compress.decode(p) for n, p in push.payload.items()}
        w = merge.token_weights([push.meta.tokens], [push.meta.steps])
        merged = merge.merge_fragment([delta], w, rule=cfg.merge.rule, embedding=bp.embedding)
        theta, state = outer_step(theta, state, merged)
        core.install(0, version + 1, theta, included_step=push.meta.step)

    # the same 12 batches through the plain jitted step
    mesh = inner.make_mesh()
    ref = inner.init_state(bp.plan.join(list(bp.initial)), cfg.inner, mesh)
    step_fn = inner.make_train_step(bp.model, cfg.inner, mesh)
    stream = build.stream(cfg, bp.corpus.load_split("train"), 0)
    params, opt_state = ref.params, ref.opt_state
    for t in range(12):
        params, opt_state, _ = step_fn(params, opt_state, inner.shard_batch(stream.next_batch(), mesh), t)
    ours = bp.plan.split(core.state.params)[0]
    plain = bp.plan.split(params)[0]
    moved = max(float(np.abs(plain[n] - bp.initial[0][n]).max()) for n in plain)
    assert moved > 1e-3  # training really moved the parameters
    for n in plain:
        np.testing.assert_allclose(ours[n], plain[n], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(theta[n], plain[n], rtol=1e-5, atol=1e-6)


def _run_until_push(core, fragment_id):
    while True:
        _, pushes = core.step()
        for p in pushes:
            if p.meta.fragment_id == fragment_id:
                return p


def test_push_carries_pseudo_gradient_and_counters(cache):
    cfg, bp, core = make(cache, "sync.every=8", "fragments.count=2", "compression.dtype=int8", "sync.overlap=1")
    assert len(jax.devices()) == 2 and core.mesh.devices.size == 2  # a two-device learner
    push = _run_until_push(core, 1)  # o_1 = 4: first due after 4 steps
    assert (push.meta.step, push.meta.steps, push.meta.tokens, push.meta.base_version) == (4, 4, 4 * 4 * 16, 0)
    assert push.meta.cursor == core.cursor.to_dict() and push.meta.learner_id == 0 and push.meta.incarnation == 1
    theta = bp.plan.extract(core.state.params, 1)
    for n, pl in push.payload.items():
        err = np.abs(compress.decode(pl) - (bp.initial[1][n] - theta[n]))
        assert err.max() <= np.repeat(compress.max_abs_error(pl), pl.block)[: err.size].max() * 1.001
    assert push.nbytes == sum(p.data.nbytes + p.scales.nbytes for p in push.payload.values())


@pytest.mark.parametrize("mode", ["overwrite", "blend", "rebase_included", "rebase_not_included"])
def test_receive_modes(cache, mode):
    receive = mode.split("_")[0]
    cfg, bp, core = make(
        cache,
        "sync.every=4",
        "fragments.count=2",
        "sync.overlap=1",
        f"learner.receive={receive}",
        "learner.blend_alpha=0.25",
    )
    push = _run_until_push(core, 0)  # step 4
    theta_push = bp.plan.extract(core.state.params, 0)
    core.step()  # step 5: progress after the push
    theta_now = bp.plan.extract(core.state.params, 0)
    anchor = {n: a.copy() for n, a in core.anchors[0].items()}
    merged = {n: a + 0.5 for n, a in anchor.items()}
    included = push.meta.step if mode != "rebase_not_included" else None
    core.install(0, 1, merged, included_step=included)
    got = bp.plan.extract(core.state.params, 0)
    expected = {
        "overwrite": merged,
        "blend": {n: 0.25 * theta_now[n] + 0.75 * merged[n] for n in merged},
        "rebase_included": {n: merged[n] + theta_now[n] - theta_push[n] for n in merged},
        "rebase_not_included": {n: merged[n] + theta_now[n] - anchor[n] for n in merged},
    }[mode]
    for n in merged:
        np.testing.assert_allclose(got[n], expected[n], rtol=1e-5, atol=1e-6)
    tokens_per_step = 4 * 16
    assert (core.c_steps[0], core.c_tok[0]) == {
        "overwrite": (0, 0),
        "blend": (0, 0),
        "rebase_included": (1, tokens_per_step),
        "rebase_not_included": (5, 5 * tokens_per_step),
    }[mode]
    assert core.versions[0] == 1 and all(np.array_equal(core.anchors[0][n], merged[n]) for n in merged)
    # a repeated or older publish changes nothing
    core.install(0, 1, {n: a + 9.0 for n, a in merged.items()}, included_step=None)
    np.testing.assert_array_equal(bp.plan.extract(core.state.params, 0)["embed/embedding"], got["embed/embedding"])


def test_rebase_on_a_merge_of_an_older_pending_push(cache):
    """A round trip longer than H steps: the merge of push A comes back after push B (which
    contains A) was sent. The learner rebases on A, not on its old anchor: A's steps are not kept
    a second time on top of the merge that holds them, and its next push covers only what came
    after A (the syncer rejects B, which overlaps A)."""
    cfg, bp, core = make(cache, "sync.every=4", "fragments.count=2", "sync.overlap=1", "learner.receive=rebase")
    a = _run_until_push(core, 0)  # step 4
    theta_a = bp.plan.extract(core.state.params, 0)
    b = _run_until_push(core, 0)  # step 8: δ_B covers steps 0..8, A's included
    assert (a.meta.step, b.meta.step, b.meta.steps) == (4, 8, 8)
    core.step()  # step 9
    theta_now = bp.plan.extract(core.state.params, 0)
    merged = {n: x + 0.5 for n, x in core.anchors[0].items()}
    core.install(0, 1, merged, included_step=a.meta.step)
    got = bp.plan.extract(core.state.params, 0)
    for n in merged:
        np.testing.assert_allclose(got[n], merged[n] + theta_now[n] - theta_a[n], rtol=1e-5, atol=1e-6)
    assert core.c_steps[0] == 5 and core.last_pushes[0] is None
    c = _run_until_push(core, 0)  # step 12: covers 4..12
    assert (c.meta.step, c.meta.steps, c.meta.base_version) == (12, 8, 1)


def test_tiny_preset_single_learner_validation_loss_falls(cache, capsys):
    cfg = config.load(overrides=(f"data.cache_dir={cache}", "data.max_bytes=3000000"))
    bp = build.blueprint(cfg)
    mesh = inner.make_mesh()
    core = LearnerCore(
        cfg,
        0,
        1,
        bp.model,
        mesh,
        bp.plan,
        list(bp.initial),
        [0] * bp.plan.count,
        build.stream(cfg, bp.corpus.load_split("train"), 0),
    )
    ev, batches = inner.make_eval_step(bp.model, mesh), build.eval_set(cfg, bp.corpus)
    before = inner.evaluate(ev, core.state.params, batches, mesh)
    for _ in range(60):
        core.step()
    after = inner.evaluate(ev, core.state.params, batches, mesh)
    with capsys.disabled():
        print(f"\ntiny preset, one learner, 60 steps: validation loss {before:.3f} -> {after:.3f}")
    assert before == pytest.approx(np.log(257), abs=0.15)  # uniform over the byte vocabulary
    assert after < before - 2.0


def test_flush_pushes_each_fragments_unpushed_progress_off_schedule_after_its_push_in_flight(cache):
    """A preemption notice (`LearnerCore.flush`): a fragment with progress and no push in flight is
    pushed now with all of it (δ = anchor − θ, tokens and steps since the anchor); one with a push
    in flight waits for that merge (a push now would overlap it), then its remainder goes; blocking
    algorithms flush nothing."""
    cfg, bp, core = make(cache, "fragments.count=2", "sync.every=8", "sync.overlap=1", "compression.dtype=fp32")
    pushed_at = {}
    for _ in range(5):  # streaming offsets: fragment 1 is due at step 4 (every 8, P = 2), fragment 0 not yet
        for push in core.step()[1]:
            pushed_at[push.meta.fragment_id] = push.meta.step
    assert pushed_at == {1: 4} and core.step_count == 5
    tps = cfg.inner.batch_size * cfg.data.seq_len
    (push,) = core.flush()
    assert (push.meta.fragment_id, push.meta.step, push.meta.tokens, push.meta.steps) == (0, 5, 5 * tps, 5)
    theta = bp.plan.extract(core.state.params, 0)
    delta = {n: compress.decode(q) for n, q in push.payload.items()}
    for n in theta:
        np.testing.assert_allclose(delta[n], bp.initial[0][n] - np.asarray(theta[n]), rtol=0, atol=1e-6)
    assert core.flush() == []  # fragment 0 in flight now; fragment 1's step-4 push still is
    core.install(1, 1, dict(bp.initial[1]), included_step=4)  # fragment 1's merge of its step-4 push
    (rest,) = core.flush()
    assert (rest.meta.fragment_id, rest.meta.step, rest.meta.tokens, rest.meta.steps) == (1, 5, tps, 1)
    _, _, dp = make(cache, "algorithm=dp")
    dp.step()
    assert dp.flush() == []


def test_dynamic_schedule_follows_the_syncers_word_for_its_newest_push_only(cache):
    """sync.dynamic: pushes start on the plan's offsets, then fall due where `retime` puts them;
    a decision on an older push, or one without dynamic, changes nothing."""
    cfg, bp, core = make(cache, "sync.every=8", "fragments.count=2", "sync.overlap=1", "sync.dynamic=true")
    due = {}
    for _ in range(30):
        _, pushes = core.step()
        for push in pushes:
            due.setdefault(push.meta.fragment_id, []).append(push.meta.step)
            if push.meta.fragment_id == 1 and push.meta.step == 4:
                core.retime(1, 4, 5)  # the syncer: next push of fragment 1 in 5 steps
            if push.meta.fragment_id == 0 and push.meta.step == 8:
                core.retime(0, 8, 11)
                core.retime(0, 7, 1)  # an older push's decision: ignored
        for p, records in enumerate(core.pending_pushes):  # every push merged at once, as alone
            if records:
                core.install(p, core.versions[p] + 1, core.anchors[p], included_step=records[-1].step)
    # fragment 1: offset 4, then +5 (told), then H = 8 (nothing told); fragment 0: 8, +11, then +8
    assert due == {1: [4, 9, 17, 25], 0: [8, 19, 27]}
    _, _, static = make(cache, "sync.every=8", "fragments.count=2", "sync.overlap=1", "sync.dynamic=false")
    steps = []
    for _ in range(17):
        _, pushes = static.step()
        steps += [(p.meta.fragment_id, p.meta.step) for p in pushes]
        for push in pushes:
            static.retime(push.meta.fragment_id, push.meta.step, 1)  # no effect without sync.dynamic
    assert steps == [(1, 4), (0, 8), (1, 12), (0, 16)]
