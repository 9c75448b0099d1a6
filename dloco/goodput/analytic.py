"""The fleet's failure model (`FleetParams`, `Recovery`), its closed form (`expected`, `grid`) and the
fit of its constants on the paper's Table 1 (`calibrate`); the model is stated in `dloco.goodput`."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

YEAR_S = 365.25 * 86400.0
ALGORITHMS = ("dp", "elastic_dp", "decoupled")
PAPER_CHIPS = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
PAPER_TABLE1 = {  # goodput % at per-chip MTBI = 1 year (secondary-source transcription)
    "dp": (72, 57, 38, 27, 18),
    "elastic_dp": (88, 80, 69, 58, 40),
    "M=2": (94, 88, 80, 70, 54),
    "M=4": (96, 93, 89, 82, 73),
    "M=8": (98, 96, 94, 88, 80),
    "M=16": (99, 98, 96, 93, 86),
}
CALIBRATION_ROWS = ("dp", "elastic_dp")


def require(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid: {allowed}")


@dataclass(frozen=True)
class Recovery:
    """Recovery time R: `short_s` with probability 1 − `long_frac`, else `long_s` (a long repair);
    each scaled by an Exponential(1) draw if `exponential`, else exact."""

    short_s: float = 10.86
    long_s: float = 108.6
    long_frac: float = 0.1
    exponential: bool = True

    def __post_init__(self) -> None:
        for n in ("short_s", "long_s"):
            require(getattr(self, n) >= 0, f"recovery.{n}", getattr(self, n), "must be >= 0 seconds")
        require(0 <= self.long_frac <= 1, "recovery.long_frac", self.long_frac, "must be in [0, 1]")

    @property
    def mean(self) -> float:
        return (1 - self.long_frac) * self.short_s + self.long_frac * self.long_s

    def with_mean(self, mean: float) -> Recovery:
        """The same shape (fraction and ratio of long repairs) rescaled to E[R] = `mean`."""
        k = mean / self.mean if self.mean > 0 else 0.0
        return replace(self, short_s=self.short_s * k, long_s=self.long_s * k)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        long = rng.random(n) < self.long_frac
        base = rng.exponential(1.0, n) if self.exponential else np.ones(n)
        return np.where(long, self.long_s, self.short_s) * base

    def mean_min_up(self, rate, notice: float):
        """E[min(R, U)], U = W + Exponential(1/λ): ∫ P(R > t) P(U > t) dt, per component; λ may be an array."""
        out = np.zeros(np.shape(rate))
        for w, mu in ((1 - self.long_frac, self.short_s), (self.long_frac, self.long_s)):
            if w > 0 and mu > 0:
                q = math.exp(-notice / mu)
                exp_part = mu * (1 - q) + q * mu / (1 + np.asarray(rate) * mu)
                out = out + w * (exp_part if self.exponential else _emin(mu, rate, notice))
        return out


@dataclass(frozen=True)
class FleetParams:
    """The fleet's failure model and delay constants (seconds); defaults: `calibrate` on Table 1.

    mtbi_s: per-chip mean time between interruptions.  notice_s (W): an interruption's notice.
    restart_s (F): dp's fixed job restart (relaunch, restore the checkpoint) on top of R.
    lost_s (L): dp's work lost per interruption (≈ half its checkpoint interval).
    rejoin_s (J): a repaired slice or restarted learner rejoining (elastic_dp: all chips pause).
    sync_lost_s (ℓ): a learner's work since its last merged push (≈ half of H steps), lost; 0 by
        default: within the notice a learner flushes its pending push, as dp checkpoints (L fits 0).
    slice_chips (s): chips an interruption takes out of an elastic_dp world.
    """

    mtbi_s: float = YEAR_S
    notice_s: float = 5.09
    restart_s: float = 65.69
    lost_s: float = 0.0
    rejoin_s: float = 5.0
    sync_lost_s: float = 0.0
    slice_chips: int = 256
    recovery: Recovery = Recovery()

    def __post_init__(self) -> None:
        require(self.mtbi_s > 0, "mtbi_s", self.mtbi_s, "must be > 0 seconds (math.inf: no interruptions)")
        for n in ("notice_s", "restart_s", "lost_s", "rejoin_s", "sync_lost_s"):
            require(getattr(self, n) >= 0, n, getattr(self, n), "must be >= 0 seconds")
        require(self.slice_chips >= 1, "slice_chips", self.slice_chips, "must be >= 1")


@dataclass(frozen=True)
class Goodput:
    """goodput: chip-time whose progress reached the global model ÷ chip-time provisioned;
    uptime: share of wall time the global model advanced; interruptions: handled (took a domain
    down), absorbed: arrived while it was announced or down; freezes: handled freezes."""

    goodput: float
    uptime: float
    interruptions: float
    absorbed: float
    freezes: int
    seconds: float


@dataclass(frozen=True)
class Calibration:
    params: FleetParams
    max_abs_diff: float  # percentage points, over the calibration rows
    rms_diff: float


def _emin(x: float, rate, notice: float):
    """E[min(x, W + X)] with X ~ Exponential(mean 1/rate); rate may be an array, 0 means no failures."""
    rate = np.asarray(rate, dtype=float)
    if x <= notice:
        return np.full(rate.shape, float(x))
    safe = np.where(rate > 0, rate, 1.0)
    return np.where(rate > 0, notice + -np.expm1(-safe * (x - notice)) / safe, float(x))


def _binom_tail(m: int, p, k: int):
    """P[Bin(m, p) ≥ k]; p may be an array."""
    return sum(math.comb(m, i) * p**i * (1 - p) ** (m - i) for i in range(max(k, 0), m + 1)) + 0 * p


def check_fleet(algorithm: str, chips: int, learners: int, quorum: int) -> None:
    require(algorithm in ALGORITHMS, "algorithm", algorithm, f"must be one of {', '.join(ALGORITHMS)}")
    require(learners >= 1, "learners", learners, "must be >= 1")
    require(chips >= learners, "chips", chips, f"must be >= learners ({learners})")
    require(1 <= quorum <= learners, "quorum", quorum, f"must be in [1, learners={learners}]")


def _closed(p: FleetParams, algorithm: str, chips, M: int, K: int):
    """The module docstring's closed form over an array of chip counts: (goodput, uptime, 1/C), with
    a = (1 + λW) / (1 + λ(W + E[D])) and 1/C = λ / (1 + λ(W + E[D])), the handled interruption rate."""
    chips = np.asarray(chips, dtype=float)
    rate, W, r = chips / M / p.mtbi_s, p.notice_s, p.recovery.mean
    D = p.restart_s + r if algorithm == "dp" else r + p.rejoin_s
    a, per = (1 + rate * W) / (1 + rate * (W + D)), rate / (1 + rate * (W + D))
    if algorithm == "dp":
        return a - _emin(p.lost_s, rate, W) * per, a, per
    if algorithm == "elastic_dp":
        return a - np.minimum(p.slice_chips, chips) / chips * p.recovery.mean_min_up(rate, W) * per, a, per
    return (a - _emin(p.sync_lost_s, rate, W) * per) * _binom_tail(M - 1, a, K - 1), _binom_tail(M, a, K), per


def expected(
    p: FleetParams, algorithm: str, chips: int, learners: int = 1, quorum: int = 1, seconds: float = 86400.0
) -> Goodput:
    """The closed form for `chips` chips (decoupled: `learners` of N/M chips, quorum K); dp and
    elastic_dp are one world and ignore `learners`. Counts are expectations over `seconds`."""
    check_fleet(algorithm, chips, learners, quorum)
    M, K = (learners, quorum) if algorithm == "decoupled" else (1, 1)
    good, up, per = (float(v[0]) for v in _closed(p, algorithm, [chips], M, K))
    handled = M * seconds * per
    return Goodput(good, up, handled, chips / p.mtbi_s * seconds - handled, 0, seconds)


def grid(p: FleetParams, chips: Sequence[int] = PAPER_CHIPS, rows: Sequence[str] = tuple(PAPER_TABLE1)) -> dict:
    """Closed-form goodput (fraction) per row ("dp", "elastic_dp" or "M=<learners>", K = 1) and chip count."""
    out = {}
    for row in rows:
        algo, m = (row, 1) if row in ("dp", "elastic_dp") else ("decoupled", int(row.removeprefix("M=")))
        out[row] = [float(v) for v in _closed(p, algo, chips, m, 1)[0]]
    return out


def _nelder_mead(f: Callable, x0: np.ndarray, iters: int = 2000, tol: float = 1e-9) -> np.ndarray:
    """Minimise f from x0: simplex steps 0.5; reflect, expand ×2, contract ½, else shrink ½."""
    pts = np.vstack([x0, x0 + 0.5 * np.eye(x0.size)])
    vals = np.array([f(x) for x in pts])
    for _ in range(iters):
        o = np.argsort(vals, kind="stable")
        pts, vals = pts[o], vals[o]
        if vals[-1] - vals[0] < tol:
            break
        c = pts[:-1].mean(axis=0)
        xr = 2 * c - pts[-1]
        fr = f(xr)
        if fr < vals[0]:
            xe = 3 * c - 2 * pts[-1]
            fe = f(xe)
            pts[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = xr, fr
        elif (fc := f(xc := (c + pts[-1]) / 2)) < vals[-1]:
            pts[-1], vals[-1] = xc, fc
        else:
            pts[1:] = (pts[0] + pts[1:]) / 2
            vals[1:] = [f(x) for x in pts[1:]]
    return pts[np.argmin(vals)]


def calibrate(
    base: FleetParams = FleetParams(),
    target: dict = PAPER_TABLE1,
    chips: Sequence[int] = PAPER_CHIPS,
    rows: Sequence[str] = CALIBRATION_ROWS,
    fit_notice: bool = True,
) -> Calibration:
    """Least squares (percentage points) over `rows` of `target` for W, F, L and E[R] (θ = x², so
    ≥ 0; Nelder–Mead from three starts); J, s, ℓ, MTBI and the recovery mixture's shape from `base`."""

    def params(x: np.ndarray) -> FleetParams:
        w, f, lost, r = (float(v) for v in x**2)
        return replace(
            base,
            notice_s=w if fit_notice else base.notice_s,
            restart_s=f,
            lost_s=lost,
            recovery=base.recovery.with_mean(r),
        )

    want = np.array([target[r] for r in rows], dtype=float)

    def loss(x: np.ndarray) -> float:
        got = np.array(list(grid(params(x), chips, rows).values())) * 100
        return float(np.sum((got - want) ** 2))

    starts = [np.sqrt([2.0, 40.0, 1.0, 10.0]), np.sqrt([8.0, 80.0, 10.0, 30.0]), np.sqrt([0.5, 60.0, 0.1, 20.0])]
    best = min((_nelder_mead(loss, x0) for x0 in starts), key=loss)
    fit = params(best)
    diff = np.array(list(grid(fit, chips, rows).values())) * 100 - want
    return Calibration(fit, float(np.max(np.abs(diff))), float(np.sqrt(np.mean(diff**2))))
