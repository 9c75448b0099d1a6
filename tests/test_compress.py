"""Tests for dloco.compress: hand-computed values, exact byte counts, error bounds, error feedback."""

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dloco.compress import (
    DTYPES,
    Payload,
    decode,
    decode_range,
    encode,
    encode_with_feedback,
    max_abs_error,
    pack,
    sq_norm,
    validate,
)

# Float32 rounding of x / s can push the round-trip error past s / 2 by a relative 255 · 2⁻²⁴.
SLACK = 1 + 2.0**-16
PLAIN_DTYPES = {np.dtype(t) for t in (np.uint8, np.int8, np.uint16, np.float16, np.float32)}


def _assert_within_half_step(x, p):
    """|x − decode(p)| ≤ s_b / 2 for every value, s_b the stored float16 scale of its block."""
    x64 = np.asarray(x, np.float64).reshape(-1)
    y = decode(p)
    assert y.dtype == np.float32 and y.shape == np.shape(x)
    assert np.isfinite(y).all()
    err = np.zeros(p.scales.size * p.block)
    err[: x64.size] = np.abs(x64 - y.astype(np.float64).reshape(-1))
    bound = p.scales.astype(np.float64) / 2 * SLACK
    assert (err.reshape(-1, p.block) <= bound[:, None]).all()


# --- hand-computed values -------------------------------------------------------------------------


def test_int2_hand_example_is_ternary_packed_four_per_byte():
    # absmax 1 → s = 1 (L = 1); q = rint(x) ∈ {−1, 0, 1}; code q + 1 of index 4j + k at bits 2k.
    x = np.array([0.3, -1.0, 0.6, 0.0, 1.0, -0.2, -0.7, 0.9], np.float32)
    p = encode(x, "int2", block=4)
    np.testing.assert_array_equal(p.scales, np.array([1.0, 1.0], np.float16))
    assert p.data.tolist() == [1 | 0 << 2 | 2 << 4 | 1 << 6, 2 | 1 << 2 | 0 << 4 | 2 << 6]
    np.testing.assert_array_equal(decode(p), np.array([0, -1, 1, 0, 1, 0, -1, 1], np.float32))
    assert p.nbytes == 2 + 2 * 2
    with pytest.raises(ValueError, match="block must be a multiple of 4 for int2"):
        encode(x, "int2", block=6)


def test_int4_hand_example():
    # absmax 3.5, s = 3.5 / 7 = 0.5 (exact in fp16), q = [0, 2, -4, 7], nibbles q + 8 = [8, 10, 4, 15].
    p = encode(np.array([0.0, 1.0, -2.0, 3.5], np.float32), "int4", block=4)
    np.testing.assert_array_equal(p.scales, np.array([0.5], np.float16))
    # byte 0 = 8 | 10 << 4 = 168, byte 1 = 4 | 15 << 4 = 244 (low nibble = even index).
    np.testing.assert_array_equal(p.data, np.array([168, 244], np.uint8))
    np.testing.assert_array_equal(decode(p), np.array([0.0, 1.0, -2.0, 3.5], np.float32))
    assert p.nbytes == 2 + 2


def test_int4_hand_example_with_padding_and_scale_rounded_up():
    # Padded to [1, 2, 3, 0]; 3 / 7 = 0.428571… lies between fp16 1755/4096 and 1756/4096 and is
    # nearer the first, but the scale must round up: s = 1756/4096 = 0.4287109375.
    # q = rint([2.3326, 4.6651, 6.9977, 0]) = [2, 5, 7, 0]; nibbles [10, 13, 15, 8].
    p = encode(np.array([1.0, 2.0, 3.0], np.float32), "int4", block=4)
    assert float(p.scales[0]) == 1756 / 4096
    np.testing.assert_array_equal(p.data, np.array([10 | 13 << 4, 15 | 8 << 4], np.uint8))
    np.testing.assert_array_equal(decode(p), np.array([2, 5, 7], np.float32) * (1756 / 4096))


def test_int8_hand_example_exact_scale_and_half_to_even():
    # absmax 127 → s = 1; rint(-63.5) = -64 and rint(2.5) = 2 (round half to even).
    x = np.array([0.0, 127.0, -63.5, 2.5], np.float32)
    p = encode(x, "int8", block=4)
    np.testing.assert_array_equal(p.scales, np.array([1.0], np.float16))
    np.testing.assert_array_equal(p.data, np.array([0, 127, -64, 2], np.int8))
    np.testing.assert_array_equal(decode(p), np.array([0.0, 127.0, -64.0, 2.0], np.float32))


def test_int8_hand_example_scale_rounded_up():
    # 3.5 / 127 = 0.0275591 = 1806.04 · 2⁻¹⁶ (fp16 spacing in [2⁻⁶, 2⁻⁵)); round up → 1807 · 2⁻¹⁶.
    # q = rint([0, 36.268, -72.536, 126.938]) = [0, 36, -73, 127].
    p = encode(np.array([0.0, 1.0, -2.0, 3.5], np.float32), "int8", block=4)
    s = 1807 * 2.0**-16
    assert float(p.scales[0]) == s
    np.testing.assert_array_equal(p.data, np.array([0, 36, -73, 127], np.int8))
    np.testing.assert_array_equal(decode(p), np.array([0, 36, -73, 127], np.float32) * np.float32(s))


def test_bf16_hand_values_round_half_to_even():
    # bf16 spacing at 1 is 2⁻⁷: 1 + 2⁻⁸ ties to 1.0 (0x3F80); 1 + 3 · 2⁻⁸ ties to 1 + 2⁻⁶ (0x3F82).
    x = np.array([1 + 2.0**-8, 1 + 3 * 2.0**-8, -2.0], np.float32)
    p = encode(x, "bf16")
    np.testing.assert_array_equal(p.data, np.array([0x3F80, 0x3F82, 0xC000], np.uint16))
    np.testing.assert_array_equal(decode(p), np.array([1.0, 1 + 2.0**-6, -2.0], np.float32))


# --- byte counts and payload arrays ---------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, expected",
    [("fp32", 4000), ("bf16", 2000), ("int8", 1024 + 8 * 2), ("int4", 512 + 8 * 2), ("int2", 256 + 8 * 2)],
)
def test_nbytes_exact(dtype, expected):
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    p = encode(x, dtype, block=128)
    assert p.nbytes == expected
    assert p.nbytes == p.data.nbytes + (p.scales.nbytes if p.scales is not None else 0)
    assert type(p.data) is np.ndarray and p.data.dtype in PLAIN_DTYPES
    assert p.scales is None or (type(p.scales) is np.ndarray and p.scales.dtype == np.float16)
    assert p.shape == (1000,) and p.block == 128


def test_fp32_is_identity_without_copy_and_decode_is_fresh():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    p = encode(x, "fp32")
    assert p.data is x or np.shares_memory(p.data, x)
    y = decode(p)
    np.testing.assert_array_equal(y, x)
    assert not np.shares_memory(y, p.data) and y.flags.writeable


def test_bf16_matches_ml_dtypes_round_trip():
    x = (np.random.default_rng(1).standard_normal((7, 33)) * 1e3).astype(np.float32)
    p = encode(x, "bf16")
    assert p.data.dtype == np.uint16 and p.data.shape == x.shape
    np.testing.assert_array_equal(p.data, x.astype(ml_dtypes.bfloat16).view(np.uint16))
    np.testing.assert_array_equal(decode(p), x.astype(ml_dtypes.bfloat16).astype(np.float32))


# --- error bound ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["int8", "int4", "int2"])
@pytest.mark.parametrize("n, block", [(1000, 128), (4096, 128), (77, 8), (130, 2)])
def test_round_trip_within_half_step_across_magnitudes(dtype, n, block):
    if dtype == "int2" and block % 4:
        block = 4
    rng = np.random.default_rng(n + block)
    n_blocks = -(-n // block)
    magnitude = np.repeat(10.0 ** rng.uniform(-6, 3, n_blocks), block)[:n]
    x = (rng.standard_normal(n) * magnitude).astype(np.float32)
    p = encode(x, dtype, block=block)
    _assert_within_half_step(x, p)
    levels = {"int8": 127, "int4": 7, "int2": 1}[dtype]
    # The scale is the smallest fp16 with s · L ≥ absmax (up to the float32 rounding of absmax / L).
    absmax = np.zeros(n_blocks * block)
    absmax[:n] = np.abs(x)
    absmax = absmax.reshape(-1, block).max(axis=1)
    s = p.scales.astype(np.float64)
    below = np.nextafter(p.scales, np.float16(0)).astype(np.float64)
    assert (s * levels >= absmax * (1 - 2.0**-23)).all()
    assert (below * levels < absmax * (1 + 2.0**-23)).all()
    np.testing.assert_array_equal(max_abs_error(p), (s / 2).astype(np.float32))


def test_zeros_empty_and_zero_dim():
    for dtype in DTYPES:
        z = decode(encode(np.zeros((3, 50), np.float32), dtype, block=16))
        np.testing.assert_array_equal(z, np.zeros((3, 50), np.float32))
        for shape in [(0,), (3, 0)]:
            p = encode(np.zeros(shape, np.float32), dtype)
            assert p.nbytes == 0 and decode(p).shape == shape
        p = encode(np.float32(-2.5), dtype)
        assert p.shape == () and decode(p).shape == ()
        if p.scales is None:
            assert float(decode(p)) == -2.5  # exact in bf16
        else:
            # q = −L: int8 −127; int4 low nibble −7 + 8 = 1, high nibble the padding 0 + 8;
            # int2 bits 0-1 hold −1 + 1 = 0, the three padding codes 0 + 1 = 1 the higher bits.
            assert p.data[0] == {"int8": -127, "int4": 1 | 8 << 4, "int2": 1 << 2 | 1 << 4 | 1 << 6}[dtype]
            _assert_within_half_step(np.float32(-2.5), p)
    p = encode(np.zeros(256, np.float32), "int8")
    np.testing.assert_array_equal(p.scales, np.zeros(2, np.float16))
    np.testing.assert_array_equal(p.data, np.zeros(256, np.int8))


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_tiny_values_get_smallest_subnormal_scale(dtype):
    x = np.full(128, 1e-9, np.float32)
    x[::2] = -3e-9
    p = encode(x, dtype)
    assert float(p.scales[0]) == 2.0**-24  # smallest positive float16, not 0
    _assert_within_half_step(x, p)
    sub = np.array([1e-45, -3e-44], np.float32)  # absmax / L underflows float32 to 0
    p = encode(sub, dtype, block=2)
    assert float(p.scales[0]) == 2.0**-24
    _assert_within_half_step(sub, p)
    y = np.full(64, 1e-7, np.float32)  # 1e-7 / 2⁻²⁴ = 1.68 → q = 2
    np.testing.assert_array_equal(decode(encode(y, dtype)), np.full(64, 2 * 2.0**-24, np.float32))


# --- validation -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_raises(dtype, bad):
    x = np.ones(300, np.float32)
    x[257] = bad
    with pytest.raises(ValueError, match="non-finite values"):
        encode(x, dtype)


def test_unknown_dtype_and_bad_block_raise():
    with pytest.raises(ValueError, match=r"unknown compression dtype 'fp8'.*'int4'"):
        encode(np.ones(4, np.float32), "fp8")
    with pytest.raises(ValueError, match="block must be >= 2, got 1"):
        encode(np.ones(4, np.float32), "int8", block=1)
    with pytest.raises(ValueError, match="block must be a multiple of 2 for int4"):
        encode(np.ones(4, np.float32), "int4", block=3)
    _assert_within_half_step(np.ones(4, np.float32), encode(np.ones(4, np.float32), "int8", block=3))


@pytest.mark.parametrize("dtype, levels", [("int8", 127), ("int4", 7)])
def test_fp16_scale_overflow_raises(dtype, levels):
    at_max = np.array([levels * 65504.0, 1.0], np.float32)  # s = 65504, the fp16 maximum: fine
    expected = np.array([levels * 65504.0, 0.0], np.float32)  # 1 / 65504 rounds to q = 0
    np.testing.assert_array_equal(decode(encode(at_max, dtype, block=2)), expected)
    with pytest.raises(ValueError, match=f"out of range for dtype '{dtype}'"):
        encode(np.array([levels * 65504.0 * 1.01, 1.0], np.float32), dtype, block=2)


def test_malformed_payload_rejected():
    p = encode(np.ones(300, np.float32), "int4")
    with pytest.raises(ValueError, match="scales must be float16 of shape"):
        Payload("int4", p.shape, p.data, p.scales[:2], p.block)
    with pytest.raises(ValueError, match="data must be uint8 with 192 values"):
        Payload("int4", p.shape, p.data[:10], p.scales, p.block)
    with pytest.raises(ValueError, match="data must be float32"):
        Payload("fp32", (3,), np.zeros(3, np.float64), None, 128)


# --- error feedback -------------------------------------------------------------------------------


def test_error_feedback_keeps_running_sum_within_one_step():
    rng = np.random.default_rng(3)
    delta = (rng.uniform(-1, 1, 256) * np.repeat([1.0, 1e-3], 128)).astype(np.float32)
    steps = 200
    residual = None
    sent, sent_plain = np.zeros(256), np.zeros(256)
    max_step = np.zeros(2)  # per block, the largest scale seen
    max_drift = np.zeros(2)
    for t in range(1, steps + 1):
        p, residual = encode_with_feedback(delta, residual, "int4")
        sent += decode(p)
        sent_plain += decode(encode(delta, "int4"))
        max_step = np.maximum(max_step, p.scales.astype(np.float64))
        drift = np.abs(t * delta.astype(np.float64) - sent).reshape(2, 128).max(axis=1)
        max_drift = np.maximum(max_drift, drift)
        assert (drift <= max_step).all()  # bounded: the residual is at most one step
    np.testing.assert_allclose(sent + residual, steps * delta.astype(np.float64), rtol=1e-5, atol=1e-7)

    # Without feedback the same per-step error repeats: the drift is exactly linear in t.
    per_step = delta.astype(np.float64) - decode(encode(delta, "int4"))
    expected = steps * delta.astype(np.float64)
    np.testing.assert_allclose(expected - sent_plain, steps * per_step, rtol=1e-6, atol=1e-9)
    drift_plain = np.abs(steps * per_step).reshape(2, 128).max(axis=1)
    assert (drift_plain > 20 * max_drift).all()
    assert (drift_plain > 20 * max_step).all()


def test_error_feedback_residual_is_exact_difference():
    x = np.linspace(-1, 1, 100, dtype=np.float32).reshape(10, 10)
    e = np.full((10, 10), 0.01, np.float32)
    p, new_e = encode_with_feedback(x, e, "int8", block=16)
    np.testing.assert_array_equal(new_e, (x + e) - decode(p))
    p, new_e = encode_with_feedback(x, None, "fp32")
    np.testing.assert_array_equal(new_e, np.zeros((10, 10), np.float32))
    np.testing.assert_array_equal(decode(p), x)
    with pytest.raises(ValueError, match="residual shape"):
        encode_with_feedback(x, np.zeros(100, np.float32), "int8")


# --- properties -----------------------------------------------------------------------------------

_arrays = hnp.arrays(
    np.float32,
    hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=40),
    elements=st.floats(-1e4, 1e4, width=32),
)


@settings(max_examples=150, deadline=None)
@given(x=_arrays, dtype=st.sampled_from(["int8", "int4"]), block=st.sampled_from([2, 4, 16, 128]))
def test_property_quantized_round_trip(x, dtype, block):
    p = encode(x, dtype, block=block)
    assert p.shape == x.shape
    assert p.nbytes == p.data.nbytes + p.scales.nbytes
    _assert_within_half_step(x, p)


@settings(max_examples=100, deadline=None)
@given(x=_arrays, dtype=st.sampled_from(["fp32", "bf16"]))
def test_property_float_round_trip(x, dtype):
    y = decode(encode(x, dtype))
    assert y.shape == x.shape and y.dtype == np.float32 and np.isfinite(y).all()
    expected = x if dtype == "fp32" else x.astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(y, expected)


@settings(max_examples=100, deadline=None)
@given(x=_arrays, dtype=st.sampled_from(DTYPES), block=st.sampled_from([4, 16, 128]))
def test_property_entropy_coding_is_lossless_and_never_larger(x, dtype, block):
    p = encode(x, dtype, block=block)
    q = pack(p)  # `compression.entropy: zstd`
    assert q.nbytes < p.nbytes if q.entropy == "zstd" else q is p
    r = validate(q)  # what the syncer merges
    assert r.entropy == "none" and r.data.dtype == p.data.dtype and r.shape == p.shape
    np.testing.assert_array_equal(r.data, p.data)
    np.testing.assert_array_equal(decode(q), decode(p))  # what a learner installs


def test_sq_norm_is_read_from_the_codes_by_hand():
    # int4, block 4: scale 0.5, codes [1, −2, 0, 7]; scale 2, codes [−7, 7, 0, 0]
    # ‖x̂‖² = 0.25 · (1 + 4 + 0 + 49) + 4 · (49 + 49) = 13.5 + 392 = 405.5
    p = encode(np.array([0.5, -1.0, 0.0, 3.5, -14.0, 14.0, 0.0, 0.0], np.float32), "int4", block=4)
    np.testing.assert_array_equal(p.scales, np.array([0.5, 2.0], np.float16))
    assert sq_norm(p) == 405.5
    assert sq_norm(encode(np.array([0.5, -1.0, 0.0, 3.5], np.float32), "int2", block=4)) == 3.5**2  # codes [0, 0, 0, 1]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 127, 128, 300_001])
def test_sq_norm_and_decode_range_match_decode(dtype, n):
    rng = np.random.default_rng(n)
    p = encode(rng.standard_normal(n).astype(np.float32) * 3, dtype, block=128)
    full = decode(p).reshape(-1).astype(np.float64)
    assert sq_norm(p) == pytest.approx(float(full @ full), rel=1e-6)
    out = np.empty(2048 + 128, np.float32)
    for lo in range(0, n, 2048):  # chunk by chunk, as `merge` reads it, scaled on the way
        hi = min(lo + 2048, n)
        np.testing.assert_allclose(decode_range(p, lo, hi, out, -0.5), -0.5 * full[lo:hi], rtol=1e-6, atol=0)


def test_sq_norm_of_a_non_finite_scale_is_non_finite_and_decode_range_needs_block_starts():
    p = encode(np.ones(256, np.float32), "int4", block=128)
    bad = Payload("int4", p.shape, p.data, np.array([np.nan, 1], np.float16), 128)
    assert math.isnan(sq_norm(bad))
    assert math.isinf(sq_norm(Payload("int4", p.shape, p.data, np.array([np.inf, 1], np.float16), 128)))
    with pytest.raises(ValueError, match="lo=3 is not a multiple of the block 128"):
        decode_range(p, 3, 10, np.empty(256, np.float32))


def test_validate_checks_again_what_unpickling_skipped():
    import pickle

    p = encode(np.ones(256, np.float32), "int4", block=128)
    assert validate(pickle.loads(pickle.dumps(p))) is not None
    cut = pickle.loads(pickle.dumps(p))
    object.__setattr__(cut, "data", cut.data[:10])  # what a forged pickle can carry: __post_init__ never ran
    with pytest.raises(ValueError, match="data must be uint8 with 128 values, got uint8 with 10"):
        validate(cut)
    with pytest.raises(ValueError, match="not a Payload: ndarray"):
        validate(np.ones(3))
