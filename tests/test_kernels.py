"""The compiled merge kernels (`dloco.kernels`) against the numpy path and by hand."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from dloco import compress, kernels, merge


def _payloads(dtype: str, n: int, m: int, block: int = 64, seed: int = 0) -> list[compress.Payload]:
    rng = np.random.default_rng(seed)
    return [compress.encode(rng.standard_normal(n).astype(np.float32) * (1 + i), dtype, block) for i in range(m)]


def test_combine_by_hand():
    """int4, block 4: codes (q + 8 in nibbles, even index low), scales times their coefficients."""

    # contribution 0: q = [1, -2, 3, 0 | 7, -7, 0, 0], s = [0.5, 2] · c 2 → values [1, -2, 3, 0, 28, -28, 0, 0]
    # contribution 1: q = [-1, -1, -1, -1 | 1, 1, 1, 1], s = [1, 0.25] · c 4 → [-4, -4, -4, -4, 1, 1, 1, 1]
    def pack(q):
        u = np.asarray(q) + 8
        return (u[0::2] | (u[1::2] << 4)).astype(np.uint8)

    codes = [pack([1, -2, 3, 0, 7, -7, 0, 0]), pack([-1] * 4 + [1] * 4)]
    scales = [np.array([1.0, 4.0], np.float32), np.array([4.0, 1.0], np.float32)]
    out, sq = kernels.combine(codes, scales, 7, 4, "int4")  # n = 7: the last value is padding
    np.testing.assert_array_equal(out, [-3, -6, -1, -4, 29, -27, 1])
    assert sq == 9 + 36 + 1 + 16 + 29**2 + 27**2 + 1


@pytest.mark.parametrize("dtype", ["int4", "int8", "int2"])
@pytest.mark.parametrize("n", [1, 63, 64, 16_385, 300_001])
def test_combine_is_the_numpy_path_bit_for_bit(dtype, n):
    ps = _payloads(dtype, n, 3)
    coefs = [0.25, 1.5, -0.75]
    got, sq = merge._combine(ps, coefs)
    want = merge._combine_chunks(ps, coefs)
    assert got.shape == (n,) and got.dtype == np.float32
    np.testing.assert_array_equal(got, want)
    assert sq == pytest.approx(float(np.dot(want.astype(np.float64), want.astype(np.float64))), rel=1e-12)


@pytest.mark.parametrize("dtype", ["int4", "int8", "int2"])
def test_sq_norm_is_the_norm_of_the_decoded_values(dtype):
    for n in (1, 127, 128, 300_001):
        p = _payloads(dtype, n, 1, block=128)[0]
        x = compress.decode(p).astype(np.float64)
        assert compress.sq_norm(p) == pytest.approx(float(x @ x), rel=1e-12)
    bad = compress.Payload("int4", (4,), np.full(64, 0x99, np.uint8), np.array([np.inf], np.float16), 128)
    assert not np.isfinite(compress.sq_norm(bad))


def test_results_do_not_depend_on_the_number_of_threads():
    ps = _payloads("int4", 1_000_003, 4, block=128)
    runs = []
    for threads in (1, numba.config.NUMBA_NUM_THREADS):
        numba.set_num_threads(threads)
        try:
            out, sq = merge._combine(ps, [0.1, 0.2, 0.3, 0.4])
            runs.append((out.copy(), sq, [compress.sq_norm(p) for p in ps]))
        finally:
            numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    assert runs[0][1:] == runs[1][1:]


def test_scale_is_folded_into_the_merge():
    ps = _payloads("int4", 5_000, 3)
    d = {"w": ps}
    for rule in ("rda", "mean"):
        one = merge.merge_fragment([{"w": p} for p in d["w"]], [1.0, 2.0, 3.0], rule)["w"]
        half = merge.merge_fragment([{"w": p} for p in d["w"]], [1.0, 2.0, 3.0], rule, scale=0.5)["w"]
        np.testing.assert_allclose(half, one * np.float32(0.5), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("dtype", ["int4", "int8"])
def test_read_only_payloads_merge_like_writable_ones_in_one_call(dtype):
    """Payloads fetched from Ray's object store are read-only arrays; built in-process, writable.
    Both (and a mix of both in one round) give the same bits, through one compiled signature."""
    ps = _payloads(dtype, 10_000, 3)
    coefs = [0.5, -1.0, 2.0]
    want, want_sq = merge._combine(ps, coefs)
    frozen = []
    for p in ps[:2]:
        codes, scales = p.data.copy(), p.scales.copy()
        codes.flags.writeable = scales.flags.writeable = False
        frozen.append(compress.Payload(p.dtype, p.shape, codes, scales, p.block))
    for mix in (frozen + ps[2:], ps[:1] + frozen[1:] + ps[2:]):
        got, sq = merge._combine(mix, coefs)
        np.testing.assert_array_equal(got, want)
        assert sq == want_sq
        assert [compress.sq_norm(p) for p in mix] == [compress.sq_norm(p) for p in ps]
    assert [len(k.signatures) for k in kernels._KERNELS[dtype]] == [1, 1]
