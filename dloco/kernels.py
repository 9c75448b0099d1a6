"""Compiled kernels of the syncer's merge path (numba): the packed codes read once, in one pass.

Two kernels over the integer wire dtypes of `dloco.compress` (int8, int4, int2: codes packed
``per`` to a byte, one float32 scale per block of ``block`` values):

* `sq_norm`: ``Σ_b s_b² Σ_i q_i²`` from the bytes through a 256-entry table of Σ q² per byte (no
  value is decoded).
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

The kernels compile on first use (a few seconds) and are cached beside this file (`__pycache__`),
so a later process loads them in well under a second. Only the syncer and the store import this
module; a learner never pays for numba.
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


@numba.njit(parallel=True, cache=True)
def _sq_norm(codes, scales, per_row, lut, partial):  # pragma: no cover - compiled
    for b in numba.prange(scales.size):
        acc = 0
        base = b * per_row
        for j in range(per_row):
            acc += lut[codes[base + j]]
        s = np.float64(scales[b])
        partial[b] = s * s * acc


@numba.njit(parallel=True, cache=True)
def _combine(codes, scales, out, n, block, lp, bits, mask, flip, off, partial):  # pragma: no cover - compiled
    m_count = len(codes)
    n_blocks = scales[0].size
    per_row = block >> lp
    sub = (1 << lp) - 1
    for ch in numba.prange((n_blocks + _CHUNK_BLOCKS - 1) // _CHUNK_BLOCKS):
        b0 = ch * _CHUNK_BLOCKS
        b1 = min(b0 + _CHUNK_BLOCKS, n_blocks)
        for m in range(m_count):
            c = codes[m]
            s = scales[m]
            for b in range(b0, b1):
                sb = s[b]
                o = out[b * block : (b + 1) * block]
                cc = c[b * per_row : (b + 1) * per_row]
                if m == 0:
                    for i in range(block):
                        v = np.int32(cc[i >> lp])
                        o[i] = np.float32((((v >> ((i & sub) * bits)) & mask) ^ flip) - off) * sb
                else:
                    for i in range(block):
                        v = np.int32(cc[i >> lp])
                        o[i] += np.float32((((v >> ((i & sub) * bits)) & mask) ^ flip) - off) * sb
        acc = 0.0
        for i in range(b0 * block, min(b1 * block, n)):
            x = np.float64(out[i])
            acc += x * x
        partial[ch] = acc


def sq_norm(codes: np.ndarray, scales: np.ndarray, block: int, dtype: str, lut: np.ndarray) -> float:
    """``Σ_b s_b² Σ_i q_i²`` (float64) of one payload's codes (`lut`: Σ q² per byte value)."""
    scales32 = scales.astype(np.float32)
    partial = np.empty(scales32.size, np.float64)
    with _LOCK, np.errstate(over="ignore", invalid="ignore"):
        _sq_norm(codes.reshape(-1).view(np.uint8), scales32, block >> _LAYOUT[dtype][0], lut, partial)
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
    lp, bits, mask, flip, off = _LAYOUT[dtype]
    with _LOCK:
        _combine(
            List([c.reshape(-1).view(np.uint8) for c in codes]),
            List([np.ascontiguousarray(s, np.float32) for s in scales]),
            *(out, n, block, lp, bits, mask, flip, off, partial),
        )
    return out[:n], float(partial.sum())
