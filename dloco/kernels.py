"""Compiled kernels of the syncer's merge path (numba): the packed codes read once, in one pass.

Kernels over the integer wire dtypes of `dloco.compress` (int8, int4, int2: codes packed ``per``
to a byte, one scale per block of ``block`` values):

* `sq_norm`: ``Σ_b s_b² Σ_i q_i²`` from the codes (integer arithmetic; no value is scaled).
* `combine`: ``out = Σ_m decode(payload_m)`` with each scale already multiplied by its coefficient
  c_m, block by block: a chunk of 256 blocks of ``out`` (128 KiB at block 128) stays in cache while
  every contribution's codes for it are decoded and added, in the order of the contributions, and
  ``Σ out²`` (float64) comes with it, so RDA needs no pass of its own for ‖Σ‖.
* `combine_outer`: the fused merge + outer step. Each chunk of Σ is decoded as `combine` decodes
  it, into the chunk of Θ's new array, times RDA's radial factor where there is one (Δ), and the
  outer optimizer's update (`OuterRule`) reads Θ and its state for the chunk and writes Θ' and the
  new state while it is in cache. Δ is never stored as an array of its own: a commit reads each
  contribution's codes, Θ and the state once and writes Θ' and the state once. RDA cannot scale
  before it knows ‖Σ‖, so there `combine` first writes Σ (with ‖Σ‖²) into the buffer that becomes
  Θ', and `combine_outer` scales and updates it in place (``summed``). Measured on 2 cores, that
  beat reading the codes twice (once for ‖Σ‖² alone, storing nothing): decoding M = 4 int4
  contributions costs more than writing and reading back 4 bytes per parameter.

Each value is computed as numpy computes it on the chunked path (`compress.decode_range`,
`merge._combine_chunks`): ``float32(q) · (float32(s_b) · c_m)`` summed in float32 in contribution
order, so both paths give the same bits. The outer update is computed as the jitted optax step
(`outer.make_outer_step`) computes it on this machine's XLA: the same operations in the same order,
with XLA's contractions of a multiply into the add that consumes it (fused multiply-add, one
rounding: ``fma(a, b, c) = a·b + c``) and with its runtime's floating-point mode, which treats
subnormal inputs and results as zero (MXCSR's flush-to-zero and denormals-are-zero bits, set for
the update phase of each chunk and restored after it; the decode runs in the default mode, as
numpy does). x86-64 with FMA only (`FUSED`); elsewhere the syncer keeps the unfused path. The sums of
squares are taken per block (or per chunk) into an array and added in a fixed order afterwards:
the result does not depend on how many threads ran. Calls are serialized by a lock (numba's
workqueue threading layer, its fallback, must not be entered from two threads at once).

Each code layout has kernels of its own with its constants compiled in (with the constants as
arguments LLVM did not vectorize the decode, and the sum ran at half the speed); `combine_outer`
has one per layout and outer rule. The kernels compile on first use (seconds each; `combine_outer`'s,
with the decode inlined, about ten on 2 busy cores) and are cached beside this file (`__pycache__`),
so a later process loads them in a fraction of a second. The cache keys a closure by the values it
captures, so the closures capture the layout's integers only, never another compiled function.
Only the processes that merge import this module; a learner never loads numba.
"""

from __future__ import annotations

import enum
import platform
import threading
from collections.abc import Iterable
from typing import NamedTuple

import numba
import numpy as np
from llvmlite import binding as llvm  # type: ignore[import-untyped]
from llvmlite import ir
from numba import types
from numba.extending import intrinsic
from numba.typed import List

# (log2 of codes per byte, bits per code, mask, sign flip, offset): q = ((b >> k·bits) & mask ^ flip) − offset
_LAYOUT = {"int8": (0, 8, 0xFF, 0x80, 128), "int4": (1, 4, 0x0F, 0, 8), "int2": (2, 2, 0x03, 0, 1)}
_CHUNK_BLOCKS = 256
_LOCK = threading.Lock()
_FTZ_DAZ = 0x8040  # MXCSR: flush-to-zero (bit 15) and denormals-are-zero (bit 6), as XLA's CPU runtime runs
# `combine_outer` runs where its arithmetic is XLA's: x86-64 (the MXCSR intrinsics) with FMA instructions (without
# them XLA would not contract a multiply into an add, and llvm.fma would round once where XLA rounds twice)
FUSED = platform.machine().lower() in ("x86_64", "amd64") and bool(llvm.get_host_cpu_features().get("fma"))


class OuterRule(enum.IntEnum):
    """The outer update of `combine_outer`, per value (Δ merged, η, μ; `dloco.outer` has the math).

    ``fma(a, b, c)`` is a·b + c rounded once; −η is passed as ``nlr``.
    """

    SGD = 0  # Θ' = fma(Δ, −η, Θ)
    MOMENTUM = 1  # m' = fma(m, μ, Δ);  Θ' = fma(m', −η, Θ)
    NESTEROV = 2  # m' = fma(m, μ, Δ);  Θ' = fma(fma(m', μ, Δ), −η, Θ)
    DELAYED_HOLD = 3  # A' = A + Δ;  Θ' = Θ + (−η)·Δ  (m unchanged)
    DELAYED_FIRE = 4  # m' = fma(m, μ, A + Δ);  Θ' = Θ + (−η)·fma(m', μ, Δ)  (A' = 0)


class Outer(NamedTuple):
    """One tensor's outer step for `combine_outer`: the rule, −η and μ as float32, and Θ with the
    state arrays the rule reads (``momentum`` m, ``buffer`` A; None where it reads none)."""

    rule: OuterRule
    nlr: np.float32
    mu: np.float32
    theta: np.ndarray
    momentum: np.ndarray | None = None
    buffer: np.ndarray | None = None


@intrinsic
def _fma(typingctx, a, b, c):  # pragma: no cover - compiled
    """a·b + c rounded once (llvm.fma.f32: the FMA instruction where the CPU has one)."""
    return types.float32(types.float32, types.float32, types.float32), lambda ctx, bld, sig, args: bld.fma(*args)


@intrinsic
def _get_mxcsr(typingctx):  # pragma: no cover - compiled
    def codegen(context, builder, signature, args):
        slot = builder.alloca(ir.IntType(32))
        fn = builder.module.declare_intrinsic("llvm.x86.sse.stmxcsr", fnty=ir.FunctionType(ir.VoidType(), [slot.type]))
        builder.call(fn, [slot])
        return builder.load(slot)

    return types.uint32(), codegen


@intrinsic
def _set_mxcsr(typingctx, value):  # pragma: no cover - compiled
    def codegen(context, builder, signature, args):
        slot = builder.alloca(ir.IntType(32))
        builder.store(args[0], slot)
        fn = builder.module.declare_intrinsic("llvm.x86.sse.ldmxcsr", fnty=ir.FunctionType(ir.VoidType(), [slot.type]))
        builder.call(fn, [slot])
        return context.get_dummy_value()

    return types.void(types.uint32), codegen


@numba.njit(inline="always")
def _q(c, shift, mask, flip, off):  # pragma: no cover - compiled
    """float32(q) of the code at bit `shift` of byte `c`: ((c >> shift) & mask ^ flip) − off, in int32
    (numba widens integer arithmetic to int64; the casts let LLVM keep 8 codes to a vector)."""
    i32 = np.int32
    return np.float32(i32(i32(i32(i32(c) >> i32(shift)) & i32(mask)) ^ i32(flip)) - i32(off))


@numba.njit(inline="always")
def _sweep(ca_, cb_, sa_, sb_, out, base, n, block, b0, b1, mode, lp, bits, mask, flip, off):  # pragma: no cover
    """One sweep over blocks b0 … b1 − 1 (values j < n) of ``out[j − base]`` with two contributions
    a, b: mode 0 ``o = a`` (b unused), 1 ``o = a + b``, 2 ``o = (o + a) + b``, each value a
    float32(q) · s. A byte's ``1 << lp`` codes are decoded together (LLVM vectorizes it, where it
    did not vectorize one code at a time). Inlined into each kernel with the layout's constants."""
    per, sub = 1 << lp, (1 << lp) - 1
    per_row = block >> lp
    for b in range(b0, b1):
        sa, sb = sa_[b], sb_[b]
        k = min(block, n - b * block)
        rows = k >> lp  # whole bytes; the codes of a last, partial byte come after
        o = out[b * block - base : b * block - base + k]
        ca, cb = ca_[b * per_row : b * per_row + rows], cb_[b * per_row : b * per_row + rows]
        if mode == 0:
            for j in range(rows):
                for t in range(per):
                    o[j * per + t] = _q(ca[j], t * bits, mask, flip, off) * sa
        elif mode == 1:
            for j in range(rows):
                for t in range(per):
                    x = _q(ca[j], t * bits, mask, flip, off) * sa
                    o[j * per + t] = x + _q(cb[j], t * bits, mask, flip, off) * sb
        else:
            for j in range(rows):
                for t in range(per):
                    x = o[j * per + t] + _q(ca[j], t * bits, mask, flip, off) * sa
                    o[j * per + t] = x + _q(cb[j], t * bits, mask, flip, off) * sb
        for i in range(rows * per, k):
            r = b * per_row + (i >> lp)
            x = _q(ca_[r], (i & sub) * bits, mask, flip, off) * sa
            if mode == 0:
                o[i] = x
            else:
                y = _q(cb_[r], (i & sub) * bits, mask, flip, off) * sb
                o[i] = x + y if mode == 1 else (o[i] + x) + y


@numba.njit(inline="always")
def _decode_sum(codes, scales, out, base, n, block, b0, b1, lp, bits, mask, flip, off):  # pragma: no cover
    """``out[j − base] = Σ_m float32(q_mj) · s_m,b`` for the values j < n of blocks b0 … b1 − 1,
    added in the order of the contributions: two per sweep, ``(o + a) + b`` in float32, the same
    bits as one at a time (an odd count starts with contribution 0 alone)."""
    first = len(codes) % 2
    if first:
        _sweep(codes[0], codes[0], scales[0], scales[0], out, base, n, block, b0, b1, 0, lp, bits, mask, flip, off)
    for m in range(first, len(codes), 2):
        ca, cb, sa, sb = codes[m], codes[m + 1], scales[m], scales[m + 1]
        _sweep(ca, cb, sa, sb, out, base, n, block, b0, b1, 1 if m == 0 else 2, lp, bits, mask, flip, off)


def _kernels(lp: int, bits: int, mask: int, flip: int, off: int):
    """(sq_norm, combine) compiled for one code layout (closures over its integers only: a captured
    dispatcher pickles differently in each process, and the cache would never hit)."""
    per = 1 << lp

    @numba.njit(parallel=True, cache=True)
    def sq_norm(codes, scales, block, partial):  # pragma: no cover - compiled
        per_row = block >> lp
        for b in numba.prange(scales.size):
            cc = codes[b * per_row : (b + 1) * per_row]
            acc = np.int64(0)
            for j0 in range(0, per_row, 8192):  # int32 sums of at most 8192 bytes' q² (< 2³¹), exact
                acc32 = np.int32(0)
                for j in range(j0, min(j0 + 8192, per_row)):
                    c = np.int32(cc[j])
                    for t in range(per):
                        q = (((c >> (t * bits)) & mask) ^ flip) - off
                        acc32 += q * q
                acc += acc32
            s = np.float64(scales[b])
            partial[b] = s * s * acc

    @numba.njit(parallel=True, cache=True)
    def combine(codes, scales, out, n, block, partial):  # pragma: no cover - compiled
        for ch in numba.prange(partial.size):
            b0 = ch * _CHUNK_BLOCKS
            b1 = min(b0 + _CHUNK_BLOCKS, scales[0].size)
            _decode_sum(codes, scales, out, 0, n, block, b0, b1, lp, bits, mask, flip, off)
            partial[ch] = _sum_sq(out, b0 * block, min(b1 * block, n))

    return sq_norm, combine


@numba.njit(cache=True)
def _sum_sq(x, lo, hi):  # pragma: no cover - compiled
    """Σ x[lo:hi]² in float64: eight running sums over the values i ≡ 0 … 7 (mod 8) from lo, added
    pairwise at the end, then the tail in order (independent sums: 2.6× the speed of one)."""
    x = x[lo:hi]  # indexed from 0: no negative-index checks in the loop
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = 0.0
    end = x.size - x.size % 8
    for i in range(0, end, 8):
        v0, v1, v2, v3 = np.float64(x[i]), np.float64(x[i + 1]), np.float64(x[i + 2]), np.float64(x[i + 3])
        v4, v5, v6, v7 = np.float64(x[i + 4]), np.float64(x[i + 5]), np.float64(x[i + 6]), np.float64(x[i + 7])
        a0, a1, a2, a3 = a0 + v0 * v0, a1 + v1 * v1, a2 + v2 * v2, a3 + v3 * v3
        a4, a5, a6, a7 = a4 + v4 * v4, a5 + v5 * v5, a6 + v6 * v6, a7 + v7 * v7
    acc = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))
    for i in range(end, x.size):
        v = np.float64(x[i])
        acc += v * v
    return acc


def _fused(lp: int, bits: int, mask: int, flip: int, off: int, rule: int):
    """`combine_outer`'s kernel for one code layout and one `OuterRule`."""

    @numba.njit(parallel=True, cache=True)
    def kernel(
        codes, scales, n, block, decode, factor, scaled, nlr, mu, theta, mom, buf, out, mom_out, buf_out
    ):  # pragma: no cover - compiled
        for ch in numba.prange(-(-scales[0].size // _CHUNK_BLOCKS)):
            b0 = ch * _CHUNK_BLOCKS
            b1 = min(b0 + _CHUNK_BLOCKS, scales[0].size)
            lo, hi = b0 * block, min(b1 * block, n)
            if decode:
                _decode_sum(codes, scales, out, 0, n, block, b0, b1, lp, bits, mask, flip, off)  # Σ into Θ' (cache)
            # slices, indexed from 0: a loop over range(lo, hi) keeps numba's negative-index check, and
            # LLVM does not vectorize it
            k, o, th = hi - lo, out[lo:hi], theta[lo:hi]
            m0, a0, m1, a1 = mom[lo:hi], buf[lo:hi], mom_out[lo:hi], buf_out[lo:hi]  # empty where unused
            if scaled:
                for i in range(k):
                    o[i] *= factor
            mode: int = _get_mxcsr()  # type: ignore[call-arg]  # the intrinsic's typing context is numba's
            _set_mxcsr(mode | np.uint32(_FTZ_DAZ))
            if rule == 0:
                for i in range(k):
                    o[i] = _fma(o[i], nlr, th[i])
            elif rule == 1:
                for i in range(k):
                    m = _fma(m0[i], mu, o[i])
                    m1[i] = m
                    o[i] = _fma(m, nlr, th[i])
            elif rule == 2:
                for i in range(k):
                    d = o[i]
                    m = _fma(m0[i], mu, d)
                    m1[i] = m
                    o[i] = _fma(_fma(m, mu, d), nlr, th[i])
            elif rule == 3:  # the update −η·Δ is a branch's output in XLA: rounded before the add
                for i in range(k):
                    d = o[i]
                    a1[i] = a0[i] + d
                    o[i] = th[i] + nlr * d
            else:
                for i in range(k):
                    d = o[i]
                    m = _fma(m0[i], mu, a0[i] + d)
                    m1[i] = m
                    a1[i] = 0.0
                    o[i] = th[i] + nlr * _fma(m, mu, d)
            _set_mxcsr(mode)

    return kernel


_KERNELS = {dtype: _kernels(*layout) for dtype, layout in _LAYOUT.items()}
_FUSED: dict[tuple[str, int], object] = {}  # (dtype, rule) → combine_outer's kernel, built on first use


def _readonly(a: np.ndarray) -> np.ndarray:
    """A read-only flat view of `a`: every call reaches the kernels with one array type. Numba
    compiles a read-only array (a payload fetched from Ray's object store) and a writable one
    (built in-process) separately, and a typed list holds one type."""
    v = a.reshape(-1).view()  # a new array object: `a` itself keeps its flags
    v.flags.writeable = False
    return v


def _packed(codes: list[np.ndarray], scales: list[np.ndarray]) -> tuple[List, List]:
    return (
        List([_readonly(c.reshape(-1).view(np.uint8)) for c in codes]),
        List([_readonly(np.ascontiguousarray(s, np.float32)) for s in scales]),
    )


def warm(dtype: str, rules: Iterable[OuterRule] = ()) -> None:
    """Compiles (or loads from the cache) `dtype`'s two kernels on a one-block input, so the first
    merge does not pay for it (about 3 s on a fresh checkout, 0.7 s from the cache, on 2 cores), and
    `combine_outer`'s kernel for each of `rules` (`outer.warm_merge_step`; measured on 2 busy cores:
    about 10 s each to compile, 0.03 s from the cache)."""
    codes, scales = np.zeros(64 >> _LAYOUT[dtype][0], np.uint8), np.ones(1, np.float32)
    sq_norm(codes, scales, 64, dtype)
    combine([codes], [scales], 64, 64, dtype)
    theta = np.zeros(64, np.float32)
    for rule in rules:
        combine_outer(
            [codes], [scales], 64, 64, dtype, None, Outer(rule, np.float32(-1), np.float32(0), theta, theta, theta)
        )


def sq_norm(codes: np.ndarray, scales: np.ndarray, block: int, dtype: str) -> float:
    """``Σ_b s_b² Σ_i q_i²`` (float64) of one payload's codes and (float16) scales."""
    scales32 = scales.astype(np.float32)
    partial = np.empty(scales32.size, np.float64)
    with _LOCK, np.errstate(over="ignore", invalid="ignore"):
        _KERNELS[dtype][0](_readonly(codes.reshape(-1).view(np.uint8)), _readonly(scales32), block, partial)
        return float(partial.sum())


def combine(
    codes: list[np.ndarray], scales: list[np.ndarray], n: int, block: int, dtype: str
) -> tuple[np.ndarray, float]:
    """``(Σ_m decode_m[:n], Σ (Σ_m decode_m[:n])²)`` for payloads of one `dtype` and `block`.

    Args:
      codes: each payload's packed codes (``Payload.data``), one flat array per contribution.
      scales: each payload's float32 block scales, each already multiplied by its coefficient c_m.
      n: values in the tensor (the codes hold ``ceil(n / block) · block``).

    Returns:
      The float32 sum (a view of length n of a buffer of whole blocks) and its float64 squared norm.
    """
    n_blocks = scales[0].size
    out = np.empty(n_blocks * block, np.float32)
    partial = np.empty(-(-n_blocks // _CHUNK_BLOCKS), np.float64)
    with _LOCK:
        _KERNELS[dtype][1](*_packed(codes, scales), out, n, block, partial)
    return out[:n], float(partial.sum())


def combine_outer(
    codes: list[np.ndarray],
    scales: list[np.ndarray],
    n: int,
    block: int,
    dtype: str,
    factor: float | None,
    outer: Outer,
    summed: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """The outer step on ``Δ = factor · Σ_m decode_m[:n]`` (`combine`'s sum, times `factor` in
    float32 when given), in one pass: ``(Θ', state')`` as flat float32 arrays of length n.

    Args:
      codes, scales, n, block, dtype: as `combine` (each scale multiplied by its coefficient).
      factor: RDA's radial factor, or None (the weighted mean: Δ is the sum itself).
      outer: the rule and the arrays it reads (flat, float32, length n).
      summed: `combine`'s sum of these codes and scales, if it was computed (RDA's norm needs it):
        it is not decoded again, and Θ' is written over it (the array returned is a view of it).

    Returns:
      (Θ', m', A'), None for a state array the rule does not write: SGD writes neither, MOMENTUM and
      NESTEROV m', DELAYED_HOLD A' (m is unchanged), DELAYED_FIRE both (A' = 0).
    """
    if not FUSED:
        raise RuntimeError(f"combine_outer needs an x86-64 CPU with FMA, this is {platform.machine()}")
    rule = OuterRule(outer.rule)
    key = (dtype, int(rule))
    if key not in _FUSED:
        _FUSED[key] = _fused(*_LAYOUT[dtype], int(rule))
    empty = _readonly(np.empty(0, np.float32))

    def flat(x: np.ndarray | None) -> np.ndarray:
        return empty if x is None else _readonly(np.ascontiguousarray(x, np.float32))

    out = np.empty(n, np.float32) if summed is None else summed.reshape(-1)[:n]
    if not out.flags.writeable or out.size != n:
        raise ValueError(f"combine_outer: summed must be a writable float32 array of at least {n} values")
    moves = rule in (OuterRule.MOMENTUM, OuterRule.NESTEROV, OuterRule.DELAYED_FIRE)
    mom_out = np.empty(n, np.float32) if moves else None
    buf_out = np.empty(n, np.float32) if rule in (OuterRule.DELAYED_HOLD, OuterRule.DELAYED_FIRE) else None
    spare = np.empty(0, np.float32)
    with _LOCK:
        _FUSED[key](  # type: ignore[operator]
            *_packed(codes, scales),
            *(n, block, summed is None, np.float32(1.0 if factor is None else factor), factor is not None),
            *(np.float32(outer.nlr), np.float32(outer.mu)),
            *(flat(outer.theta), flat(outer.momentum), flat(outer.buffer)),
            *(out, spare if mom_out is None else mom_out, spare if buf_out is None else buf_out),
        )
    return out, mom_out, buf_out
