"""Wire compression of float32 pseudo-gradient deltas (ALGORITHM.md §7).

A delta ``x`` travels as a :class:`Payload` that holds only plain numpy arrays, so Ray's object store
can carry it zero-copy. Five wire dtypes:

* ``fp32``: identity, 4 bytes per value.
* ``bf16``: round-to-nearest-even cast to bfloat16, stored as its ``uint16`` bit pattern, 2 bytes.
* ``int8``: blockwise absmax quantization with ``L = 127`` levels per sign, 1 byte per value.
* ``int4``: the same with ``L = 7``, two values per byte (``q + 8`` in a nibble, even index low).
* ``int2``: the same with ``L = 1`` (ternary codes −1, 0, 1), four values per byte (``q + 1`` in
  two bits, index ``4j + k`` at bits ``2k``). The aggressive 2-bit variant for ablations.

For the integer dtypes the flattened ``x`` is zero-padded to a multiple of ``block`` and cut into
blocks ``b``. Each block gets one float16 scale and integer codes::

  s_b = ↑fp16(max_i |x_i| / L)          (fp16 rounding *up*, so s_b · L ≥ max_i |x_i|)
  q_i = clip(rint(x_i / s_b), −L, L)
  x̂_i = q_i · s_b

The scale that is stored is the scale that quantizes, hence no value is clipped and
``|x_i − x̂_i| ≤ s_b / 2`` up to the float32 rounding of ``x_i / s_b`` (relative excess < 2⁻¹⁶;
``q_i · s_b`` itself is exact in float32). A block of zeros has ``s_b = 0`` and decodes to exact
zeros; a tiny nonzero block rounds up to the smallest positive float16 (a subnormal), never to 0.

Error feedback (ALGORITHM.md §4) carries what the wire lost into the next push::

  e ← (δ + e) − Q⁻¹(Q(δ + e))

Entropy coding (`compression.entropy: zstd`) is lossless and comes on top: `pack` replaces a
payload's ``data`` by a zstd frame of its bytes where that is smaller (`dloco.entropy`), `unpack`
restores the very same arrays. A packed payload is what travels and what is counted; its receiver
unpacks it once (`validate` at the syncer, `decode` at a learner) before anything reads its codes.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from dloco import entropy

DTYPES = ("fp32", "bf16", "int8", "int4", "int2")

_LEVELS = {"int8": 127, "int4": 7, "int2": 1}
INTEGER_DTYPES = tuple(_LEVELS)  # the block-quantized wire dtypes (codes and scales)
# Codes per stored byte of the integer dtypes.
_PER_BYTE = {"int8": 1, "int4": 2, "int2": 4}
_FP16_MAX = float(np.finfo(np.float16).max)  # 65504
# Rows per chunk when (de)quantizing: 2**17 values (512 KiB of float32) keep the temporaries in
# cache, so each value crosses main memory once; the Python loop runs over chunks, never blocks.
_CHUNK_VALUES = 1 << 17


@dataclass(frozen=True, eq=False)
class Payload:
    """A compressed array as it travels on the wire.

    Attributes:
      dtype: one of :data:`DTYPES`.
      shape: shape of the original array; :func:`decode` restores it.
      data: ``float32`` of ``shape`` (fp32); ``uint16`` bf16 bit patterns of ``shape`` (bf16);
        ``int8`` codes of length ``n_pad`` (int8); ``uint8`` packed nibbles of length ``n_pad / 2``
        (int4); ``uint8`` packed 2-bit codes of length ``n_pad / 4`` (int2). ``n_pad`` is the
        value count rounded up to a multiple of ``block``; the padding codes are zeros and travel,
        so they are counted.
      scales: ``float16`` per-block scales ``s_b`` of length ``n_pad / block`` (int8, int4, int2),
        else ``None``.
      block: values per scale block (carried for every dtype, used by the integer dtypes).
      entropy: ``"none"``, or ``"zstd"``: ``data`` is then a ``uint8`` zstd frame of the bytes
        described above, strictly smaller than they are (`pack`; `unpack` restores them).

    Raises:
      ValueError: when the arrays do not match ``dtype``, ``shape``, ``block`` and ``entropy`` (a
        malformed payload is rejected here, before anything decodes it).
    """

    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray
    scales: np.ndarray | None
    block: int
    entropy: str = "none"

    def __post_init__(self):
        _check_dtype_block(self.dtype, self.block)
        if self.entropy not in entropy.CODINGS:
            raise ValueError(f"Payload entropy must be one of {entropy.CODINGS}, got {self.entropy!r}")
        expected, n_data = _data_layout(self.dtype, self.shape, self.block)
        if self.dtype in _LEVELS:
            n_blocks = n_data * _PER_BYTE[self.dtype] // self.block
            if self.scales is None or self.scales.dtype != np.float16 or self.scales.shape != (n_blocks,):
                raise ValueError(
                    f"Payload {self.dtype}: scales must be float16 of shape ({n_blocks},), got "
                    f"{None if self.scales is None else (self.scales.dtype, self.scales.shape)}"
                )
        elif self.scales is not None:
            raise ValueError(f"Payload {self.dtype}: scales must be None")
        if self.entropy != "none":
            raw = n_data * np.dtype(expected).itemsize
            if self.data.dtype != np.uint8 or self.data.ndim != 1 or not 0 < self.data.size < raw:
                raise ValueError(
                    f"Payload {self.dtype} ({self.entropy}): data must be a 1-D uint8 frame of fewer than "
                    f"{raw} bytes (the raw codes' size), got {self.data.dtype} of shape {self.data.shape}"
                )
        elif self.data.dtype != expected or self.data.size != n_data:
            raise ValueError(
                f"Payload {self.dtype}: data must be {np.dtype(expected)} with {n_data} values, "
                f"got {self.data.dtype} with {self.data.size}"
            )

    @property
    def nbytes(self) -> int:
        """Exact bytes of the arrays that travel: ``data.nbytes + scales.nbytes`` (an entropy-coded
        payload's ``data`` is its zstd frame, header and checksum included).

        The few bytes of pickled metadata (``dtype``, ``shape``, ``block``, ``entropy``) are not counted.
        """
        return int(self.data.nbytes + (self.scales.nbytes if self.scales is not None else 0))


def encode(x: np.ndarray, dtype: str, block: int = 128) -> Payload:
    """Compresses ``x`` for the wire.

    For int8/int4/int2, per block ``b`` of the flattened, zero-padded ``x``::

      s_b = ↑fp16(max_i |x_i| / L),   q_i = clip(rint(x_i / s_b), −L, L),   L ∈ {127, 7, 1}

    Args:
      x: array of any shape (0-d and empty included), cast to float32.
      dtype: wire dtype, one of :data:`DTYPES`.
      block: values per scale block; at least 2, even for int4, a multiple of 4 for int2.

    Returns:
      A :class:`Payload`. For ``fp32`` its ``data`` is ``x`` itself when ``x`` is already a
      C-contiguous float32 array (no copy).

    Raises:
      ValueError: unknown ``dtype``, bad ``block``, non-finite values in ``x``, or (integer dtypes) a
        block whose scale ``max|x| / L`` exceeds the float16 maximum 65504.
    """
    _check_dtype_block(dtype, block)
    x = np.asarray(x, dtype=np.float32, order="C")  # ascontiguousarray would make 0-d arrays 1-d
    shape = tuple(x.shape)
    if dtype in ("fp32", "bf16"):
        # min/max propagate NaN and expose ±inf without a boolean temporary the size of x.
        if x.size and not (np.isfinite(x.min()) and np.isfinite(x.max())):
            raise ValueError(f"non-finite values in the array passed to encode(dtype={dtype!r})")
        if dtype == "fp32":
            return Payload(dtype, shape, x, None, block)
        data = x.astype(ml_dtypes.bfloat16).view(np.uint16)
        return Payload(dtype, shape, data, None, block)

    levels = _LEVELS[dtype]
    flat = x.reshape(-1)
    n = flat.size
    n_full = n // block
    n_blocks = -(-n // block)
    scales = np.empty(n_blocks, np.float16)
    # Codes are written block row by block row; packed rows are 2 (int4) or 4 (int2) times narrower.
    row_bytes = block // _PER_BYTE[dtype]
    data = np.empty((n_blocks, row_bytes), np.int8 if dtype == "int8" else np.uint8)
    _quantize_rows(flat[: n_full * block].reshape(n_full, block), levels, scales[:n_full], data[:n_full], dtype)
    if n_blocks > n_full:  # the last, partial block: pad a copy of at most block − 1 values
        tail = np.zeros((1, block), np.float32)
        tail[0, : n - n_full * block] = flat[n_full * block :]
        _quantize_rows(tail, levels, scales[n_full:], data[n_full:], dtype)
    return Payload(dtype, shape, data.reshape(-1), scales, block)


def decode(p: Payload) -> np.ndarray:
    """Restores a float32 array of ``p.shape``: ``x̂_i = q_i · s_b`` for the integer dtypes.

    Args:
      p: a payload from :func:`encode`.

    Returns:
      A fresh, writable float32 array of shape ``p.shape``; it never aliases ``p.data``.

    Raises:
      ValueError: an entropy-coded ``p`` whose frame does not decode (`unpack`).
    """
    p = unpack(p)
    if p.dtype == "fp32":
        return np.array(p.data, dtype=np.float32, copy=True).reshape(p.shape)
    if p.dtype == "bf16":
        return p.data.view(ml_dtypes.bfloat16).astype(np.float32).reshape(p.shape)
    n = _size(p.shape)
    assert p.scales is not None  # Payload.__post_init__: the integer dtypes carry scales
    n_blocks = p.scales.shape[0]
    out = np.empty((n_blocks, p.block), np.float32)
    scales = p.scales.astype(np.float32)
    codes = p.data.reshape(n_blocks, p.block // _PER_BYTE[p.dtype])
    rows = max(1, _CHUNK_VALUES // p.block)
    for i in range(0, n_blocks, rows):
        _decode_rows(p.dtype, codes[i : i + rows], scales[i : i + rows, None], out[i : i + rows])
    return out.reshape(-1)[:n].reshape(p.shape)


def _decode_rows(dtype: str, c: np.ndarray, s: np.ndarray, o: np.ndarray) -> None:
    """Block rows of codes `c` times their float32 scales `s` (rows × 1) into `o` (rows × block)."""
    if dtype == "int8":
        np.multiply(c, s, out=o)
        return
    h = np.empty(c.shape, np.int8)
    if dtype == "int2":  # q = two bits − 1; index 4j + k sits at bits 2k of byte j
        for k in range(4):
            np.right_shift(c, 2 * k, out=h, casting="unsafe")
            np.bitwise_and(h, 0x03, out=h)
            np.subtract(h, 1, out=h)
            np.multiply(h, s, out=o[:, k::4])
        return
    # q = nibble − 8; the low nibble holds the even index, the high nibble the odd one.
    np.bitwise_and(c, 0x0F, out=h, casting="unsafe")
    np.subtract(h, 8, out=h)
    np.multiply(h, s, out=o[:, 0::2])
    np.right_shift(c, 4, out=h, casting="unsafe")
    np.subtract(h, 8, out=h)
    np.multiply(h, s, out=o[:, 1::2])


def decode_range(p: Payload, lo: int, hi: int, out: np.ndarray, factor: float = 1.0) -> np.ndarray:
    """``factor · decode(p).reshape(-1)[lo:hi]`` written into `out` (float32), without decoding the rest.

    For the integer dtypes `lo` must be a multiple of ``p.block`` and `out` hold whole blocks
    (``ceil((hi − lo) / block) · block`` values); the factor scales the block scales, so each code
    is read and multiplied once. Returns the view of `out` that holds the ``hi − lo`` values.
    An entropy-coded payload is refused (ValueError): `unpack` it once, not once per range.
    """
    _require_unpacked(p)
    f = np.float32(factor)
    if p.dtype == "fp32":
        return np.multiply(p.data.reshape(-1)[lo:hi], f, out=out[: hi - lo])
    if p.dtype == "bf16":
        o = out[: hi - lo]
        np.copyto(o, p.data.reshape(-1)[lo:hi].view(ml_dtypes.bfloat16), casting="unsafe")
        return np.multiply(o, f, out=o)
    if lo % p.block:
        raise ValueError(f"decode_range: lo={lo} is not a multiple of the block {p.block}")
    assert p.scales is not None
    b0, b1 = lo // p.block, -(-hi // p.block)
    codes = p.data.reshape(-1, p.block // _PER_BYTE[p.dtype])[b0:b1]
    scales = np.multiply(p.scales[b0:b1], f, dtype=np.float32)[:, None]
    _decode_rows(p.dtype, codes, scales, out[: (b1 - b0) * p.block].reshape(b1 - b0, p.block))
    return out[: hi - lo]


def sq_norm(p: Payload) -> float:
    """``‖decode(p)‖²`` (float64 accumulation) read from the codes, without decoding: for the integer
    dtypes Σ_b s_b² Σ_i q_i² (one compiled pass over the codes: `dloco.kernels`).
    Non-finite when a scale or value is. ValueError for an entropy-coded payload (`unpack` it first)."""
    _require_unpacked(p)
    flat = p.data.reshape(-1)
    total = 0.0
    if p.scales is None:
        buf = np.empty(min(flat.size, _CHUNK_VALUES), np.float32)
        for lo in range(0, flat.size, _CHUNK_VALUES):
            x = decode_range(p, lo, min(lo + _CHUNK_VALUES, flat.size), buf)
            total += float(np.dot(x.astype(np.float64), x.astype(np.float64)))
        return total
    from dloco import kernels  # numba: only the syncer's processes load it

    return kernels.sq_norm(flat, p.scales, p.block, p.dtype)


def validate(p: object) -> Payload:
    """`p` as a well-formed, unpacked `Payload`: checked again (unpickling skips ``__post_init__``),
    then, if it came entropy-coded, its codes restored (`unpack`). A frame that does not decode
    raises ValueError, as any other malformed payload does: the syncer rejects the push."""
    if not isinstance(p, Payload):
        raise ValueError(f"not a Payload: {type(p).__name__}")
    if not isinstance(p.data, np.ndarray) or not (p.scales is None or isinstance(p.scales, np.ndarray)):
        raise ValueError("Payload arrays must be numpy arrays")
    if not isinstance(p.shape, tuple) or not all(isinstance(d, int) and d >= 0 for d in p.shape):
        raise ValueError(f"Payload shape must be a tuple of sizes, got {p.shape!r}")
    Payload.__post_init__(p)
    return unpack(p)


def pack(p: Payload, coding: str = "zstd") -> Payload:
    """`p` with its ``data`` entropy-coded by `coding` where that makes it smaller (`dloco.entropy`),
    else `p` itself (``coding`` ``"none"``, an already packed `p`, or codes that do not compress:
    they travel raw, ``entropy`` ``"none"`` says so). The scales always travel raw."""
    if coding not in entropy.CODINGS:
        raise ValueError(f"unknown entropy coding {coding!r}; expected one of {entropy.CODINGS}")
    if coding == "none" or p.entropy != "none":
        return p
    frame = entropy.compress(p.data)
    if frame is None:
        return p
    return Payload(p.dtype, p.shape, np.frombuffer(frame, np.uint8), p.scales, p.block, coding)


def unpack(p: Payload) -> Payload:
    """The plain payload that `pack` coded: the same ``data`` bit for bit (read-only), or `p` itself
    if it is not entropy-coded. ValueError when the frame does not decode to exactly those bytes."""
    if p.entropy == "none":
        return p
    expected, n_data = _data_layout(p.dtype, p.shape, p.block)
    data = np.frombuffer(entropy.decompress(p.data, n_data * np.dtype(expected).itemsize), expected)
    # fp32 and bf16 data have the payload's shape (as `encode` makes them); the codes are flat
    return Payload(p.dtype, p.shape, data if p.scales is not None else data.reshape(p.shape), p.scales, p.block)


def encode_with_feedback(
    x: np.ndarray, residual: np.ndarray | None, dtype: str, block: int = 128, coding: str = "none"
) -> tuple[Payload, np.ndarray]:
    """Compresses ``x`` = δ with error feedback (ALGORITHM.md §4): ``y = δ + e``, payload ``Q(y)``,
    ``e ← y − Q⁻¹(Q(y))``, so the running sum of decoded payloads tracks the running sum of inputs
    within one quantization step. `residual`: ``e`` from the previous call, or ``None`` for zeros.
    `coding`: the entropy coding of the payload (`pack`, after the residual is taken: it is lossless).

    Returns ``(payload, new_residual)``, the residual a fresh float32 array of ``x``'s shape.
    ValueError: as :func:`encode`, or when ``residual``'s shape differs from ``x``'s.
    """
    x = np.asarray(x, dtype=np.float32)
    if residual is None:
        y = x
    else:
        residual = np.asarray(residual, dtype=np.float32)
        if residual.shape != x.shape:
            raise ValueError(
                f"residual shape {residual.shape} differs from delta shape {x.shape}; pass the "
                "residual returned for this same tensor, or None"
            )
        y = x + residual
    payload = encode(y, dtype, block)
    # Write into the decoded copy: for fp32 the payload's data may be y itself.
    decoded = decode(payload)
    return pack(payload, coding), np.subtract(y, decoded, out=decoded)


def max_abs_error(p: Payload) -> np.ndarray | None:
    """Per-block bound on the round-trip error: ``s_b / 2`` as float32 (int8, int4, int2).

    ``|x_i − x̂_i| ≤ s_b / 2`` holds up to a relative excess below 2⁻¹⁶ from the float32 rounding
    of ``x_i / s_b``.

    Args:
      p: a payload from :func:`encode`.

    Returns:
      A float32 array with one entry per block, or ``None`` for ``fp32`` (exact) and ``bf16``
      (whose error is relative, ``|x − x̂| ≤ 2⁻⁹ |x|``, not per block).
    """
    if p.scales is None:
        return None
    return p.scales.astype(np.float32) / np.float32(2)


def _quantize_rows(blocks: np.ndarray, levels: int, scales: np.ndarray, data: np.ndarray, dtype: str) -> None:
    """Quantizes float32 ``blocks`` (rows) into ``scales`` and ``data`` rows, chunk by chunk."""
    n_rows, block = blocks.shape
    rows = max(1, _CHUNK_VALUES // block)
    work = np.empty((min(rows, n_rows), block), np.float32)
    if dtype in ("int4", "int2"):
        nibbles = np.empty((min(rows, n_rows), block), np.uint8)
    for i in range(0, n_rows, rows):
        b = blocks[i : i + rows]
        w = work[: b.shape[0]]
        np.abs(b, out=w)
        s16 = _scales_fp16(w.max(axis=1), levels, dtype)
        scales[i : i + rows] = s16
        divisor = s16.astype(np.float32)
        divisor[divisor == 0] = 1  # an all-zero block: 0 / 1 = 0, no 0 / 0
        np.divide(b, divisor[:, None], out=w)
        np.rint(w, out=w)
        np.clip(w, -levels, levels, out=w)  # a no-op given ↑fp16, kept as a guard on the range
        if dtype == "int8":
            np.copyto(data[i : i + rows], w, casting="unsafe")
            continue
        u = nibbles[: b.shape[0]]
        np.add(w, 8 if dtype == "int4" else 1, out=w)  # unsigned codes: q + 8 (int4), q + 1 (int2)
        np.copyto(u, w, casting="unsafe")
        d = data[i : i + rows]
        if dtype == "int2":
            np.left_shift(u[:, 3::4], 6, out=d)
            for k in (2, 1):
                np.bitwise_or(d, np.left_shift(u[:, k::4], 2 * k), out=d)
            np.bitwise_or(d, u[:, 0::4], out=d)
            continue
        np.left_shift(u[:, 1::2], 4, out=d)
        np.bitwise_or(d, u[:, 0::2], out=d)


def _scales_fp16(absmax: np.ndarray, levels: int, dtype: str) -> np.ndarray:
    """``↑fp16(absmax / L)``: the float16 scale rounded up, so that ``s · L ≥ absmax``."""
    if not np.isfinite(absmax).all():
        raise ValueError(f"non-finite values in the array passed to encode(dtype={dtype!r})")
    s = absmax / np.float32(levels)
    if s.size and s.max() > _FP16_MAX:
        raise ValueError(
            f"block absmax {float(absmax.max()):.6g} needs scale {float(s.max()):.6g} > float16 "
            f"max {_FP16_MAX:g}: this delta is out of range for dtype {dtype!r}; use 'bf16' or "
            "'fp32'"
        )
    s16 = s.astype(np.float16)
    # Round-to-nearest went down, or to 0 for a tiny absmax (absmax / L may even underflow float32).
    low = (s16.astype(np.float32) < s) | ((s16 == 0) & (absmax > 0))
    if low.any():
        s16[low] = np.nextafter(s16[low], np.float16(np.inf))
    return s16


def _check_dtype_block(dtype: str, block: int) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"unknown compression dtype {dtype!r}; expected one of {DTYPES}")
    try:
        block = operator.index(block)
    except TypeError:
        raise ValueError(f"block must be an integer, got {block!r}") from None
    if block < 2:
        raise ValueError(f"block must be >= 2, got {block}")
    if dtype in _PER_BYTE and block % _PER_BYTE[dtype]:
        n = _PER_BYTE[dtype]
        raise ValueError(f"block must be a multiple of {n} for {dtype} ({n} values per byte), got {block}")


def _size(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64))


def _data_layout(dtype: str, shape: tuple[int, ...], block: int) -> tuple[type[np.generic], int]:
    """(numpy dtype, element count) of a plain payload's ``data``: the codes of the zero-padded
    blocks for the integer dtypes, one value per element for fp32 and bf16."""
    n = _size(shape)
    if dtype in _LEVELS:
        return (np.int8 if dtype == "int8" else np.uint8), -(-n // block) * block // _PER_BYTE[dtype]
    return (np.float32 if dtype == "fp32" else np.uint16), n


def _require_unpacked(p: Payload) -> None:
    if p.entropy != "none":
        raise ValueError(f"an entropy-coded ({p.entropy}) payload: unpack it before reading its codes")
