"""Merge rules (ALGORITHM.md §6): hand-computed values and property tests."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dloco import merge


def test_token_weights():
    np.testing.assert_array_equal(merge.token_weights([100, 200, 300], [10, 10, 30]), [1000.0, 4000.0, 3000.0])
    with pytest.raises(ValueError, match="must be > 0"):
        merge.token_weights([100, 0], [1, 1])


@pytest.mark.parametrize("m", [2, 4, 8, 16])
def test_rda_keeps_norm_of_orthogonal_deltas_while_mean_shrinks(m):
    r = 3.0
    deltas = [r * np.eye(m, dtype=np.float32)[i] for i in range(m)]
    w = np.ones(m)
    assert np.linalg.norm(merge.rda(deltas, w)) == pytest.approx(r, rel=1e-6)
    assert np.linalg.norm(merge.weighted_mean(deltas, w)) == pytest.approx(r / math.sqrt(m), rel=1e-6)


def test_rda_hand_example():
    # norms 3 and 4 → mean norm 3.5; unit directions [1,0], [0,1] → average direction [1,1]/√2.
    out = merge.rda([np.array([3.0, 0.0], np.float32), np.array([0.0, 4.0], np.float32)], [1, 1])
    np.testing.assert_allclose(out, [3.5 / math.sqrt(2)] * 2, rtol=1e-6)
    # weights 3:1 → mean norm (3·3 + 1·4)/4 = 3.25; direction ∝ [3/4, 1/4] → unit [3, 1]/√10.
    out = merge.rda([np.array([3.0, 0.0], np.float32), np.array([0.0, 4.0], np.float32)], [3, 1])
    np.testing.assert_allclose(out, 3.25 * np.array([3.0, 1.0]) / math.sqrt(10), rtol=1e-6)


def test_rda_zero_delta_has_zero_direction():
    # unit(0) = 0: norms 0 and 2 → mean norm 1; direction [1, 0].
    out = merge.rda([np.zeros(2, np.float32), np.array([2.0, 0.0], np.float32)], [1, 1])
    np.testing.assert_allclose(out, [1.0, 0.0], rtol=1e-6)


def test_rda_falls_back_to_mean_when_directions_cancel():
    out = merge.rda([np.array([1.0, 0.0], np.float32), np.array([-2.0, 0.0], np.float32)], [1, 1])
    np.testing.assert_allclose(out, [-0.5, 0.0])
    np.testing.assert_array_equal(merge.rda([np.zeros(3, np.float32)] * 2, [1, 1]), np.zeros(3))


def test_one_learner_reduces_to_its_own_delta():
    rng = np.random.default_rng(0)
    d = rng.normal(size=(7, 5)).astype(np.float32)
    np.testing.assert_allclose(merge.rda([d], [5.0]), d, rtol=1e-6)
    np.testing.assert_allclose(merge.weighted_mean([d], [5.0]), d, rtol=1e-6)
    out = merge.merge_fragment([{"a": d, "embed/embedding": d}], [2.0], rule="rda", embedding={"embed/embedding"})
    np.testing.assert_allclose(out["a"], d, rtol=1e-6)
    np.testing.assert_allclose(out["embed/embedding"], d, rtol=1e-6)


def test_merge_fragment_uses_mean_for_embedding_tensors():
    e = [np.array([1.0, 0.0], np.float32), np.array([0.0, 1.0], np.float32)]
    out = merge.merge_fragment(
        [{"embed/embedding": e[0], "w": e[0]}, {"embed/embedding": e[1], "w": e[1]}],
        [1, 1],
        embedding={"embed/embedding"},
    )
    np.testing.assert_allclose(out["embed/embedding"], [0.5, 0.5])
    np.testing.assert_allclose(out["w"], [1 / math.sqrt(2)] * 2, rtol=1e-6)
    out = merge.merge_fragment([{"w": e[0]}, {"w": e[1]}], [1, 1], rule="mean")
    np.testing.assert_allclose(out["w"], [0.5, 0.5])


def test_large_tensor_spanning_chunks_matches_float64_reference():
    rng = np.random.default_rng(1)
    deltas = [rng.normal(scale=s, size=200_003).astype(np.float32) for s in (1.0, 0.1, 3.0)]
    w = np.array([1.0, 2.0, 0.5])
    d64 = [x.astype(np.float64) for x in deltas]
    wn = w / w.sum()
    norms = np.array([np.linalg.norm(x) for x in d64])
    direction = sum(wi * x / n for wi, x, n in zip(wn, d64, norms, strict=True))
    expected = (wn @ norms) * direction / np.linalg.norm(direction)
    np.testing.assert_allclose(merge.rda(deltas, w), expected, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(
        merge.weighted_mean(deltas, w), sum(wi * x for wi, x in zip(wn, d64, strict=True)), rtol=1e-4, atol=1e-6
    )


def test_bad_inputs():
    with pytest.raises(ValueError, match="shapes differ"):
        merge.rda([np.zeros(2, np.float32), np.zeros(3, np.float32)], [1, 1])
    with pytest.raises(ValueError, match="weights"):
        merge.rda([np.zeros(2, np.float32)], [0.0])
    with pytest.raises(ValueError, match="different tensors"):
        merge.merge_fragment([{"a": np.zeros(1)}, {"b": np.zeros(1)}], [1, 1])


deltas_strategy = st.integers(1, 5).flatmap(
    lambda m: st.tuples(
        st.lists(hnp.arrays(np.float32, (6,), elements=st.floats(-1e3, 1e3, width=32)), min_size=m, max_size=m),
        st.lists(st.floats(0.01, 100.0), min_size=m, max_size=m),
    )
)


@settings(max_examples=200, deadline=None)
@given(deltas_strategy, st.sampled_from(["rda", "mean"]))
def test_finite_in_finite_out(data, rule):
    deltas, w = data
    out = merge.merge_fragment([{"t": d} for d in deltas], w, rule=rule)["t"]
    assert out.shape == (6,) and out.dtype == np.float32 and np.isfinite(out).all()


@settings(max_examples=200, deadline=None)
@given(deltas_strategy, st.sampled_from(["rda", "mean"]), st.randoms(use_true_random=False))
def test_permutation_invariance(data, rule, rnd):
    deltas, w = data
    order = list(range(len(deltas)))
    rnd.shuffle(order)
    a = merge.merge_fragment([{"t": d} for d in deltas], w, rule=rule)["t"]
    b = merge.merge_fragment([{"t": deltas[i]} for i in order], [w[i] for i in order], rule=rule)["t"]
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-3)


@settings(max_examples=200, deadline=None)
@given(deltas_strategy, st.sampled_from(["rda", "mean"]), st.floats(1e-3, 1e3))
def test_weight_scale_invariance(data, rule, c):
    deltas, w = data
    a = merge.merge_fragment([{"t": d} for d in deltas], w, rule=rule)["t"]
    b = merge.merge_fragment([{"t": d} for d in deltas], [c * x for x in w], rule=rule)["t"]
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-3)


@settings(max_examples=100, deadline=None)
@given(deltas_strategy)
def test_rda_norm_is_weighted_mean_norm(data):
    deltas, w = data
    norms = np.array([np.linalg.norm(d.astype(np.float64)) for d in deltas])
    wn = np.asarray(w) / np.sum(w)
    out = merge.rda(deltas, w)
    direction = sum(wi * d / n for wi, d, n in zip(wn, deltas, norms, strict=True) if n > 0)
    if np.linalg.norm(direction) >= 1e-3:  # away from the fallback threshold
        assert np.linalg.norm(out) == pytest.approx(wn @ norms, rel=1e-4, abs=1e-3)


def test_rda_reuses_validation_norms():
    rng = np.random.default_rng(4)
    deltas = [{"w": rng.normal(size=(5, 3)).astype(np.float32)} for _ in range(3)]
    norms = [merge.tensor_norms(d) for d in deltas]
    assert norms[0]["w"] == pytest.approx(float(np.linalg.norm(deltas[0]["w"])), rel=1e-6)
    a = merge.merge_fragment(deltas, [1, 2, 3])["w"]
    b = merge.merge_fragment(deltas, [1, 2, 3], norms=norms)["w"]
    np.testing.assert_array_equal(a, b)
    assert not np.isfinite(merge.tensor_norms({"x": np.array([np.inf], np.float32)})["x"])


@pytest.mark.parametrize("dtype", ["int4", "int8", "int2", "bf16", "fp32"])
@pytest.mark.parametrize("rule", ["rda", "mean"])
def test_payloads_merge_as_their_decoded_arrays_do(dtype, rule):
    """The syncer merges the packed payloads (decoded chunk by chunk into the sum); the result is
    the merge of the decoded arrays, over tensors that span several chunks and end in a partial block."""
    from dloco import compress

    rng = np.random.default_rng(7)
    shapes = {"w": (300, 701), "b": (13,), "e": (5, 64)}  # 210 300 values: four chunks of 65 536
    deltas = [{n: rng.standard_normal(s).astype(np.float32) * (1 + m) for n, s in shapes.items()} for m in range(3)]
    packed = [{n: compress.encode(x, dtype, block=64) for n, x in d.items()} for d in deltas]
    decoded = [{n: compress.decode(p) for n, p in d.items()} for d in packed]
    weights = [3.0, 1.0, 2.0]
    got = merge.merge_fragment(packed, weights, rule, embedding={"e"})
    want = merge.merge_fragment(decoded, weights, rule, embedding={"e"}, norms=[merge.tensor_norms(d) for d in decoded])
    for n in shapes:
        assert got[n].shape == shapes[n] and got[n].dtype == np.float32
        np.testing.assert_allclose(got[n], want[n], rtol=2e-5, atol=1e-6 * float(np.abs(want[n]).max()))
