"""Merging pseudo-gradients of one fragment (ALGORITHM.md §6).

For contributions m with pseudo-gradients δ_m (float32) and weights w_m:

    w_m = c_tok[m]² / c_steps[m]                              (token weighting)
    mean: Δ = Σ w_m δ_m / Σ w_m
    RDA:  Δ = (Σ w_m ‖δ_m‖ / Σ w_m) · unit(Σ w_m unit(δ_m) / Σ w_m),  unit(x) = x/‖x‖, unit(0) = 0

RDA (radial-directional averaging) is applied per tensor. It keeps the merged norm at the
learners' weighted mean norm, where a plain mean of M nearly orthogonal deltas shrinks by ~1/√M.
When the averaged direction vanishes (‖Σ w_m unit(δ_m)‖ / Σ w_m < `DIRECTION_EPS`) the tensor
falls back to the weighted mean. Embedding tensors always use the weighted mean.

The loops run over cache-sized chunks and no full-size temporary is allocated. A contribution may
be a `compress.Payload` as it arrived (int4, int8, …): its norm is read from the codes
(`compress.sq_norm`) and each chunk is decoded, scaled by its coefficient and added in cache
(`compress.decode_range`), so every packed input is read once per weighted sum and never expanded
to a float32 copy of the fragment. Payloads of one integer dtype (what a syncer receives) take the
compiled kernel (`dloco.kernels.combine`): one pass over all contributions' codes per chunk, the
same bits, with ‖Σ‖² computed on the way.

`plan_fragment` states the same merge in the form the fused merge + outer pass takes
(`dloco.kernels.combine_outer`, `outer.make_merge_step`): per tensor, each payload's codes with its
scales times its coefficient, and RDA's radial factor with the sum Σ it scales (computed by
`combine`, which the norm needs first), so that Δ itself is never stored.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple, Union

import numpy as np

from dloco import compress

Delta = Union[np.ndarray, compress.Payload]  # noqa: UP007  (a runtime alias)

DIRECTION_EPS = 1e-6
_CHUNK = 1 << 16  # elements per chunk: 256 KiB of float32 per operand stays in cache


def token_weights(tokens: Sequence[int] | np.ndarray, steps: Sequence[int] | np.ndarray) -> np.ndarray:
    """w_m = tokens_m² / steps_m ("quantity × quality": tokens × tokens per step), float64.

    Raises:
      ValueError: if any tokens or steps count is not positive.
    """
    t, s = np.asarray(tokens, dtype=np.float64), np.asarray(steps, dtype=np.float64)
    if t.shape != s.shape or t.ndim != 1:
        raise ValueError(f"tokens {t.shape} and steps {s.shape} must be 1-D of equal length")
    if (t <= 0).any() or (s <= 0).any():
        raise ValueError(f"tokens and steps must be > 0, got tokens={t.tolist()} steps={s.tolist()}")
    return t * t / s


def _normalized(weights: Sequence[float] | np.ndarray, m: int) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (m,):
        raise ValueError(f"got {w.size} weights for {m} deltas")
    if not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"weights must be finite, >= 0 and not all zero, got {w.tolist()}")
    return w / w.sum()


def _flat(deltas: Sequence[Delta]) -> tuple[list[Delta], tuple[int, ...]]:
    """The deltas as flat float32 arrays (payloads as they are), and their common shape."""
    shape = tuple(deltas[0].shape) if isinstance(deltas[0], compress.Payload) else np.shape(deltas[0])
    flats: list[Delta] = []
    for d in deltas:
        if (tuple(d.shape) if isinstance(d, compress.Payload) else np.shape(d)) != shape:
            raise ValueError(f"delta shapes differ: {d.shape} vs {shape}")
        flats.append(d if isinstance(d, compress.Payload) else np.ascontiguousarray(d, np.float32).reshape(-1))
    return flats, shape


def _reader(x: Delta) -> Callable[[int, int, np.ndarray, float], np.ndarray]:
    """(lo, hi, buf, c) → c · x[lo:hi] as float32, in `buf` (a view of it) or a fresh temporary."""
    if isinstance(x, compress.Payload):
        return lambda lo, hi, buf, c: compress.decode_range(x, lo, hi, buf, c)
    return lambda lo, hi, buf, c: np.multiply(x[lo:hi], np.float32(c), out=buf[: hi - lo])


def _packable(flats: list[Delta]) -> bool:
    """Whether every contribution is a payload of one integer dtype and block, its codes unpacked
    (what a syncer merges after `compress.validate`): the input of the compiled kernels. An
    entropy-coded payload is not: the numpy path refuses it (`compress.decode_range`)."""
    first = flats[0]
    if not (isinstance(first, compress.Payload) and first.scales is not None):
        return False
    kind = (first.dtype, first.block, "none")
    return all(isinstance(f, compress.Payload) and (f.dtype, f.block, f.entropy) == kind for f in flats)


def _packed(flats: list[Delta], coefs: Sequence[float] | np.ndarray) -> tuple[list, list]:
    """Each payload's codes, and its float32 scales times its coefficient (`_packable` flats)."""
    codes, scales = [], []
    for f, c in zip(flats, coefs, strict=True):
        assert isinstance(f, compress.Payload) and f.scales is not None  # `_packable`
        codes.append(f.data)
        scales.append(np.multiply(f.scales, np.float32(c), dtype=np.float32))
    return codes, scales


def _combine(flats: list[Delta], coefs: Sequence[float] | np.ndarray) -> tuple[np.ndarray, float | None]:
    """Σ_m coefs[m] · flats[m] (float32), and its squared norm where the compiled path computed it.

    Payloads of one integer dtype and block (what a syncer receives) go through `dloco.kernels`:
    one pass over every contribution's codes, the same bits as the chunked numpy path
    (`_combine_chunks`), which takes everything else (float32 arrays, fp32 and bf16 payloads, a mix).
    """
    first = flats[0]
    if _packable(flats):
        from dloco import kernels  # numba: only the processes that merge load it

        assert isinstance(first, compress.Payload)  # `_packable`: all are
        return kernels.combine(*_packed(flats, coefs), _size(first), first.block, first.dtype)
    return _combine_chunks(flats, coefs), None


def _size(x: Delta) -> int:
    return int(np.prod(x.shape)) if isinstance(x, compress.Payload) else x.size


def _combine_chunks(flats: list[Delta], coefs: Sequence[float] | np.ndarray) -> np.ndarray:
    """Σ_m coefs[m] · flats[m], float32, chunked (a payload's chunk decoded straight into the sum)."""
    blocks = [f.block for f in flats if isinstance(f, compress.Payload) and f.scales is not None]
    step = math.lcm(*blocks) if blocks else 1
    chunk = max(step, _CHUNK - _CHUNK % step)
    n = _size(flats[0])
    out = np.empty(n + step, dtype=np.float32)  # + step: a payload's last chunk is decoded in whole blocks
    tmp = np.empty(min(n, chunk) + step, dtype=np.float32)
    readers = [_reader(f) for f in flats]
    for lo in range(0, n, chunk):
        hi = min(lo + chunk, n)
        acc = readers[0](lo, hi, out[lo:], float(coefs[0]))
        for r, c in zip(readers[1:], coefs[1:], strict=True):
            acc += r(lo, hi, tmp, float(c))
    return out[:n]


def _norm(x: Delta) -> float:
    if isinstance(x, compress.Payload):
        return math.sqrt(compress.sq_norm(x))
    return float(np.sqrt(float(np.dot(x, x))))


def weighted_mean(deltas: Sequence[Delta], weights: Sequence[float] | np.ndarray, scale: float = 1.0) -> np.ndarray:
    """Δ = scale · Σ w_m δ_m / Σ w_m, float32, shaped like the deltas (`scale` folded into the w_m)."""
    flats, shape = _flat(deltas)
    return _combine(flats, scale * _normalized(weights, len(flats)))[0].reshape(shape)


def rda(
    deltas: Sequence[Delta],
    weights: Sequence[float] | np.ndarray,
    norms: Sequence[float] | None = None,
    scale: float = 1.0,
) -> np.ndarray:
    """Radial-directional average of one tensor's deltas (see module docstring), times `scale`, float32.

    `norms` may pass the ‖δ_m‖ already computed while validating the contributions (`tensor_norms`),
    which saves one read of every delta. `scale` rides on the final radial factor, so it costs no pass.
    """
    flats, shape = _flat(deltas)
    w, r, unit_coefs = _rda_coefs(flats, weights, norms)
    direction, sq = _combine(flats, unit_coefs)  # Σ w̃_m unit(δ_m)
    dnorm = _norm(direction) if sq is None else math.sqrt(sq)
    if dnorm < DIRECTION_EPS:
        return _combine(flats, scale * w)[0].reshape(shape)
    direction *= _radial(w, r, dnorm, scale)
    return direction.reshape(shape)


def _rda_coefs(
    flats: list[Delta], weights: Sequence[float] | np.ndarray, norms: Sequence[float] | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(w̃, ‖δ‖, w̃_m / ‖δ_m‖): the normalized weights, the norms, the coefficients of Σ w̃_m unit(δ_m)."""
    w = _normalized(weights, len(flats))
    r = np.array([_norm(f) for f in flats] if norms is None else norms, dtype=np.float64)
    return w, r, np.divide(w, r, out=np.zeros_like(w), where=r > 0)


def _radial(w: np.ndarray, r: np.ndarray, dnorm: float, scale: float) -> np.float32:
    """The factor that takes Σ w̃_m unit(δ_m) (norm `dnorm`) to RDA's Δ: scale · (Σ w̃_m ‖δ_m‖) / dnorm."""
    return np.float32(scale * float(w @ r) / dnorm)


def tensor_norms(delta: Mapping[str, np.ndarray]) -> dict[str, float]:
    """‖δ‖ per tensor of one contribution (non-finite if any value is; never raises)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return {n: _norm(np.ascontiguousarray(x, dtype=np.float32).reshape(-1)) for n, x in delta.items()}


def merge_fragment(
    deltas: Sequence[Mapping[str, Delta]],
    weights: Sequence[float] | np.ndarray,
    rule: str = "rda",
    embedding: frozenset[str] | set[str] = frozenset(),
    norms: Sequence[Mapping[str, float]] | None = None,
    scale: float = 1.0,
) -> dict[str, np.ndarray]:
    """Merges one fragment's contributions tensor by tensor, times `scale` (a partial round's share).

    Args:
      deltas: one flat dict ``{tensor name: δ_m}`` per contribution, all with the same names (arrays,
        or `compress.Payload`s as they arrived).
      weights: w_m per contribution (e.g. `token_weights`, or ones for uniform weighting).
      rule: ``"rda"`` or ``"mean"`` for non-embedding tensors.
      embedding: tensor names that always use the weighted mean.
      norms: optional `tensor_norms` of each contribution, reused by RDA.
      scale: multiplies every merged tensor, folded into the coefficients (no pass of its own).

    Returns:
      ``{tensor name: Δ}`` in float32.
    """
    if rule not in ("rda", "mean"):
        raise ValueError(f"merge.rule={rule!r} is invalid: must be rda or mean")
    if not deltas:
        raise ValueError("merge_fragment needs at least one contribution")
    names = list(deltas[0])
    for d in deltas[1:]:
        if set(d) != set(names):
            raise ValueError(f"contributions name different tensors: {sorted(d)} vs {sorted(names)}")
    out = {}
    for n in names:
        tensors = [d[n] for d in deltas]
        if rule == "mean" or n in embedding:
            out[n] = weighted_mean(tensors, weights, scale)
        else:
            out[n] = rda(tensors, weights, None if norms is None else [nm[n] for nm in norms], scale)
    return out


class TensorPlan(NamedTuple):
    """One tensor's Δ as the fused pass computes it: ``Δ = factor · Σ_m decode(codes_m, scales_m)``
    (the sum in float32, in the order of the contributions; no factor for the weighted mean)."""

    codes: list[np.ndarray]  # each payload's packed codes
    scales: list[np.ndarray]  # each payload's float32 block scales times its coefficient
    shape: tuple[int, ...]
    dtype: str
    block: int
    factor: np.float32 | None
    summed: np.ndarray | None  # Σ, where RDA computed it for its norm (float32, flat); else None


def plan_fragment(
    deltas: Sequence[Mapping[str, Delta]],
    weights: Sequence[float] | np.ndarray,
    rule: str = "rda",
    embedding: frozenset[str] | set[str] = frozenset(),
    norms: Sequence[Mapping[str, float]] | None = None,
    scale: float = 1.0,
) -> dict[str, TensorPlan] | None:
    """`merge_fragment`'s merge as `TensorPlan`s, or None unless every tensor of every contribution is
    a payload of one integer dtype and block (the kernels' input; anything else merges unfused).

    Arguments as `merge_fragment`, and the same arithmetic: the coefficients are `merge_fragment`'s,
    and RDA's Σ w̃_m unit(δ_m) and its norm come from the same `kernels.combine`, so the plan gives
    Δ bit for bit as `merge_fragment` does. The weighted mean costs nothing here; RDA costs its pass
    over the codes (Σ is kept in the plan, and the fused pass writes Θ' over it).
    """
    if rule not in ("rda", "mean"):
        raise ValueError(f"merge.rule={rule!r} is invalid: must be rda or mean")
    if not deltas or any(set(d) != set(deltas[0]) for d in deltas[1:]):
        return None  # `merge_fragment` raises the error
    from dloco import kernels  # numba: only the processes that merge load it

    tensors = {name: _flat([d[name] for d in deltas]) for name in deltas[0]}
    if not all(_packable(flats) for flats, _ in tensors.values()):
        return None
    plans = {}
    for name, (flats, shape) in tensors.items():
        first = flats[0]
        assert isinstance(first, compress.Payload)  # `_packable`: all are
        factor, summed = None, None
        if rule == "mean" or name in embedding:
            packed = _packed(flats, scale * _normalized(weights, len(flats)))
        else:
            w, r, unit_coefs = _rda_coefs(flats, weights, None if norms is None else [nm[name] for nm in norms])
            packed = _packed(flats, unit_coefs)
            summed, sq = kernels.combine(*packed, _size(first), first.block, first.dtype)
            dnorm = math.sqrt(sq)
            if dnorm < DIRECTION_EPS:
                packed, summed = _packed(flats, scale * w), None
            else:
                factor = _radial(w, r, dnorm, scale)
        plans[name] = TensorPlan(*packed, shape, first.dtype, first.block, factor, summed)
    return plans
