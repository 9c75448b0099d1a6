"""Compiled kernels of the syncer's merge path (numba): the packed codes read once, in one pass.

Two kernels over the integer wire dtypes of `dloco.compress` (int8, int4, int2: codes packed
``per`` to a byte, one scale per block of ``block`` values):

* `sq_norm`: ``Σ_b s_b² Σ_i q_i²`` from the codes (integer arithmetic; no value is scaled).
* `combine`: ``out = Σ_m decode(payload_m)`` with each scale already multiplied by its coefficient
  c_m, block by block: a chunk of 256 blocks of ``out`` (128 KiB at block 128) stays in cache while
  every contribution's codes for it are decoded and added, in the order of the contributions, and
  ``Σ out²`` (float64) comes with it, so RDA needs no pass of its own for ‖Σ‖.

Each value is computed as numpy computes it on the chunked path (`compress.decode_range`,
`merge._combine_chunks`): ``float32(q) · (float32(s_b) · c_m)`` summed in float32 in contribution
order, so both paths give the same bits. The sums of squares are taken per block (or per chunk)
into an array and added in a fixed order afterwards: the result does not depend on how many
threads ran. Calls are serialized by a lock (numba's workqueue threading layer, its fallback,
must not be entered from two threads at once).

Each code layout has kernels of its own with its constants compiled in (with the constants as
arguments LLVM did not vectorize the decode, and the sum ran at half the speed). The kernels
compile on first use (about a second each) and are cached beside this file (`__pycache__`), so a
later process loads them in a fraction of a second. Only the processes that merge import this
module; a learner never loads numba.
"""

from __future__ import annotations

import threading

import numba
import numpy as np
from numba.typed import List

# (log2 of codes per byte, bits per code, mask, sign flip, offset): q = ((b >> k·bits) & mask ^ flip) − offset
_LAYOUT = {"int8": (0, 8, 0xFF, 0x80, 128), "int4": (1, 4, 0x0F, 0, 8), "int2": (2, 2, 0x03, 0, 1)}
_CHUNK_BLOCKS = 256
_LOCK = threading.Lock()


def _kernels(lp: int, bits: int, mask: int, flip: int, off: int):
    """(sq_norm, combine) compiled for one code layout."""
    sub = (1 << lp) - 1

    @numba.njit(parallel=True, cache=True)
    def sq_norm(codes, scales, block, partial):  # pragma: no cover - compiled
        per_row = block >> lp
        for b in numba.prange(scales.size):
            cc = codes[b * per_row : (b + 1) * per_row]
            acc = np.int64(0)
            for i in range(block):
                q = (((np.int32(cc[i >> lp]) >> ((i & sub) * bits)) & mask) ^ flip) - off
                acc += q * q
            s = np.float64(scales[b])
            partial[b] = s * s * acc

    @numba.njit(parallel=True, cache=True)
    def combine(codes, scales, out, n, block, partial):  # pragma: no cover - compiled
        n_blocks = scales[0].size
        per_row = block >> lp
        for ch in numba.prange((n_blocks + _CHUNK_BLOCKS - 1) // _CHUNK_BLOCKS):
            b0 = ch * _CHUNK_BLOCKS
            b1 = min(b0 + _CHUNK_BLOCKS, n_blocks)
            for m in range(len(codes)):
                c, s = codes[m], scales[m]
                for b in range(b0, b1):
                    sb = s[b]
                    o = out[b * block : (b + 1) * block]
                    cc = c[b * per_row : (b + 1) * per_row]
                    if m == 0:
                        for i in range(block):
                            o[i] = (
                                np.float32((((np.int32(cc[i >> lp]) >> ((i & sub) * bits)) & mask) ^ flip) - off) * sb
                            )
                    else:
                        for i in range(block):
                            o[i] += (
                                np.float32((((np.int32(cc[i >> lp]) >> ((i & sub) * bits)) & mask) ^ flip) - off) * sb
                            )
            acc = 0.0
            for i in range(b0 * block, min(b1 * block, n)):
                x = np.float64(out[i])
                acc += x * x
            partial[ch] = acc

    return sq_norm, combine


_KERNELS = {dtype: _kernels(*layout) for dtype, layout in _LAYOUT.items()}


def _readonly(a: np.ndarray) -> np.ndarray:
    """A read-only flat view of `a`: every call reaches the kernels with one array type. Numba
    compiles a read-only array (a payload fetched from Ray's object store) and a writable one
    (built in-process) separately, and a typed list holds one type."""
    v = a.reshape(-1).view()  # a new array object: `a` itself keeps its flags
    v.flags.writeable = False
    return v


def warm(dtype: str) -> None:
    """Compiles (or loads from the cache) `dtype`'s two kernels on a one-block input, so the first
    merge does not pay for it (about 3 s on a fresh checkout, 0.7 s from the cache, on 2 cores)."""
    codes, scales = np.zeros(64 >> _LAYOUT[dtype][0], np.uint8), np.ones(1, np.float32)
    sq_norm(codes, scales, 64, dtype)
    combine([codes], [scales], 64, 64, dtype)


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
        _KERNELS[dtype][1](
            List([_readonly(c.reshape(-1).view(np.uint8)) for c in codes]),
            List([_readonly(np.ascontiguousarray(s, np.float32)) for s in scales]),
            *(out, n, block, partial),
        )
    return out[:n], float(partial.sum())
