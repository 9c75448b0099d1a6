"""Merging pseudo-gradients of one fragment (ALGORITHM.md §6).

For contributions m with pseudo-gradients δ_m (float32) and weights w_m:

    w_m = c_tok[m]² / c_steps[m]                              (token weighting)
    mean: Δ = Σ w_m δ_m / Σ w_m
    RDA:  Δ = (Σ w_m ‖δ_m‖ / Σ w_m) · unit(Σ w_m unit(δ_m) / Σ w_m),  unit(x) = x/‖x‖, unit(0) = 0

RDA (radial-directional averaging) is applied per tensor. It keeps the merged norm at the
learners' weighted mean norm, where a plain mean of M nearly orthogonal deltas shrinks by ~1/√M.
When the averaged direction vanishes (‖Σ w_m unit(δ_m)‖ / Σ w_m < `DIRECTION_EPS`) the tensor
falls back to the weighted mean. Embedding tensors always use the weighted mean.

The loops run over cache-sized chunks so that each input is read about twice (norm, then the
weighted sum) and no full-size temporary is allocated.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

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


def _flat(deltas: Sequence[np.ndarray]) -> tuple[list[np.ndarray], tuple[int, ...]]:
    shape = np.shape(deltas[0])
    flats = []
    for d in deltas:
        if np.shape(d) != shape:
            raise ValueError(f"delta shapes differ: {np.shape(d)} vs {shape}")
        flats.append(np.ascontiguousarray(d, dtype=np.float32).reshape(-1))
    return flats, shape


def _combine(flats: list[np.ndarray], coefs: Sequence[float] | np.ndarray) -> np.ndarray:
    """Σ_m coefs[m] · flats[m], float32, chunked."""
    n = flats[0].size
    out = np.empty(n, dtype=np.float32)
    tmp = np.empty(min(n, _CHUNK), dtype=np.float32)
    for lo in range(0, n, _CHUNK):
        hi = min(lo + _CHUNK, n)
        acc, t = out[lo:hi], tmp[: hi - lo]
        np.multiply(flats[0][lo:hi], np.float32(coefs[0]), out=acc)
        for f, c in zip(flats[1:], coefs[1:], strict=True):
            np.multiply(f[lo:hi], np.float32(c), out=t)
            acc += t
    return out


def _norm(x: np.ndarray) -> float:
    return float(np.sqrt(float(np.dot(x, x))))


def weighted_mean(deltas: Sequence[np.ndarray], weights: Sequence[float] | np.ndarray) -> np.ndarray:
    """Δ = Σ w_m δ_m / Σ w_m, float32, shaped like the deltas."""
    flats, shape = _flat(deltas)
    return _combine(flats, _normalized(weights, len(flats))).reshape(shape)


def rda(
    deltas: Sequence[np.ndarray], weights: Sequence[float] | np.ndarray, norms: Sequence[float] | None = None
) -> np.ndarray:
    """Radial-directional average of one tensor's deltas (see module docstring), float32.

    `norms` may pass the ‖δ_m‖ already computed while validating the contributions (`tensor_norms`),
    which saves one read of every delta.
    """
    flats, shape = _flat(deltas)
    w = _normalized(weights, len(flats))
    r = np.array([_norm(f) for f in flats] if norms is None else norms, dtype=np.float64)
    unit_coefs = np.divide(w, r, out=np.zeros_like(w), where=r > 0)
    direction = _combine(flats, unit_coefs)  # Σ w̃_m unit(δ_m)
    dnorm = _norm(direction)
    if dnorm < DIRECTION_EPS:
        return _combine(flats, w).reshape(shape)
    direction *= np.float32(float(w @ r) / dnorm)
    return direction.reshape(shape)


def tensor_norms(delta: Mapping[str, np.ndarray]) -> dict[str, float]:
    """‖δ‖ per tensor of one contribution (non-finite if any value is; never raises)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return {n: _norm(np.ascontiguousarray(x, dtype=np.float32).reshape(-1)) for n, x in delta.items()}


def merge_fragment(
    deltas: Sequence[Mapping[str, np.ndarray]],
    weights: Sequence[float] | np.ndarray,
    rule: str = "rda",
    embedding: frozenset[str] | set[str] = frozenset(),
    norms: Sequence[Mapping[str, float]] | None = None,
) -> dict[str, np.ndarray]:
    """Merges one fragment's contributions tensor by tensor.

    Args:
      deltas: one flat dict ``{tensor name: δ_m}`` per contribution, all with the same names.
      weights: w_m per contribution (e.g. `token_weights`, or ones for uniform weighting).
      rule: ``"rda"`` or ``"mean"`` for non-embedding tensors.
      embedding: tensor names that always use the weighted mean.
      norms: optional `tensor_norms` of each contribution, reused by RDA.

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
            out[n] = weighted_mean(tensors, weights)
        else:
            out[n] = rda(tensors, weights, None if norms is None else [nm[n] for nm in norms])
    return out
