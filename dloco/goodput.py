"""Scale simulator: goodput and uptime of dp, elastic_dp and decoupled under interruptions (§8, §10).

Goodput = chip-time whose progress reached the global model ÷ chip-time provisioned; uptime =
share of wall time in which the global model advanced. A *failure domain* is what one interruption
takes down: the whole world for dp and elastic_dp, one learner for decoupled. N chips with per-chip
mean time between interruptions MTBI give a domain of n chips the rate λ = n / MTBI (a learner of
N/M chips: per-learner MTBF = MTBI·M/N; the dp world: λ = N / MTBI). A domain
alternates up and down; interruptions that arrive while it is announced or down are absorbed (the
same recovery handles them, as a kill that finds its learner down is a no-op in `dloco.chaos`):

    up    U = W + X,  X ~ Exponential(mean 1/λ)   W = notice_s: an interruption is announced W
                                                  before the domain drains; it trains meanwhile
    down  D                                       per algorithm, below;  cycle C = 1/λ + W + E[D]
    up fraction  a = (1/λ + W) / C                (renewal-reward: only E[D] matters, not its law)

    dp          n = N, D = F + R, and the last min(L, U) of work is lost:
                goodput = a − E[min(L, U)] / C,  uptime = a
    elastic_dp  n = N, D = R + J (reconfigure around the failed slice, rejoin it); the failed
                slice's s chips stay idle for its repair R, clipped to the next up period:
                goodput = a − (s/N)·E[min(R, U)] / C,  uptime = a
    decoupled   n = N/M, D = R + J per learner, learners independent, p = a, quorum K:
                goodput = (p − E[min(ℓ, U)] / C)·P[Bin(M−1, p) ≥ K−1],  uptime = P[Bin(M, p) ≥ K]

    E[min(x, U)] = x if x ≤ W, else W + (1 − exp(−λ(x − W)))/λ

R (`Recovery`) is the time to bring a mesh back up after an interruption (restart on healthy or
spare chips, load compiled code and state): elastic DP pays it as the world's reconfiguration
pause, a learner as its restart, dp on top of its fixed job restart F. That one R serves both is
the identifying assumption ("M learners ≈ elastic DP with M× fewer chips"): it is what lets the
dp and elastic_dp rows of the paper's Table 1 (`PAPER_TABLE1`) predict the decoupled rows.
`calibrate` fits W, F, L and E[R] on those two rows; J (only R + J is identified) and the mixture's
shape (only E[R] is) are fixed conventions. The defaults of `FleetParams` are that fit.

`expected` is the closed form, `simulate` an exact event simulation of the same model (vectorised
cycles; exact in law because X is memoryless) and `simulate_run` replays a real run's seeded
`dloco.chaos` schedule (learners as domains, each failing on its own clock, so a dp world is down
while any learner is; no notice; measured `recovery_s`) with the same interval accounting. Syncer
and store kills are not modelled.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from dloco import chaos as chaos_lib
from dloco.config import ChaosConfig

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


def _require(ok: bool, name: str, value: object, allowed: str) -> None:
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
            _require(getattr(self, n) >= 0, f"recovery.{n}", getattr(self, n), "must be >= 0 seconds")
        _require(0 <= self.long_frac <= 1, "recovery.long_frac", self.long_frac, "must be in [0, 1]")

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
        _require(self.mtbi_s > 0, "mtbi_s", self.mtbi_s, "must be > 0 seconds (math.inf: no interruptions)")
        for n in ("notice_s", "restart_s", "lost_s", "rejoin_s", "sync_lost_s"):
            _require(getattr(self, n) >= 0, n, getattr(self, n), "must be >= 0 seconds")
        _require(self.slice_chips >= 1, "slice_chips", self.slice_chips, "must be >= 1")


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


def _check_fleet(algorithm: str, chips: int, learners: int, quorum: int) -> None:
    _require(algorithm in ALGORITHMS, "algorithm", algorithm, f"must be one of {', '.join(ALGORITHMS)}")
    _require(learners >= 1, "learners", learners, "must be >= 1")
    _require(chips >= learners, "chips", chips, f"must be >= learners ({learners})")
    _require(1 <= quorum <= learners, "quorum", quorum, f"must be in [1, learners={learners}]")


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
    _check_fleet(algorithm, chips, learners, quorum)
    M, K = (learners, quorum) if algorithm == "decoupled" else (1, 1)
    good, up, per = (float(v[0]) for v in _closed(p, algorithm, [chips], M, K))
    handled = M * seconds * per
    return Goodput(good, up, handled, chips / p.mtbi_s * seconds - handled, 0, seconds)


# -- interval machinery: per domain, sorted disjoint down intervals [s, e) and whether each was a kill


def _measure(s: np.ndarray, e: np.ndarray, t) -> np.ndarray:
    """|⋃[s_i, e_i) ∩ [0, t)| for sorted disjoint intervals, at each t."""
    t = np.asarray(t, dtype=float)
    if s.size == 0:
        return np.zeros(t.shape)
    pre = np.concatenate(([0.0], np.cumsum(e - s)))
    k = np.searchsorted(s, t, side="right")
    j = np.maximum(k - 1, 0)
    return np.where(k > 0, pre[j] + np.clip(np.minimum(t, e[j]) - s[j], 0.0, None), 0.0)


def _union(s: np.ndarray, e: np.ndarray, kill: np.ndarray):
    """Merge intervals; each merged one keeps the kill flag of its earliest member."""
    if s.size == 0:
        return s, e, kill
    o = np.argsort(s, kind="stable")
    s, e, kill = s[o], e[o], kill[o]
    first = np.ones(s.size, dtype=bool)
    first[1:] = s[1:] > np.maximum.accumulate(e)[:-1]
    idx = np.flatnonzero(first)
    return s[first], np.maximum.reduceat(e, idx), kill[first]


def _stalled(domains: Sequence[tuple], k: int) -> tuple[np.ndarray, np.ndarray]:
    """Where fewer than `k` of the domains are up, as sorted disjoint intervals."""
    s = np.concatenate([d[0] for d in domains])
    e = np.concatenate([d[1] for d in domains])
    times = np.concatenate((s, e))
    o = np.argsort(times, kind="stable")
    times, down = times[o], np.cumsum(np.concatenate((np.ones(s.size), -np.ones(e.size)))[o])
    bad = (down > len(domains) - k)[:-1]
    a, b = times[:-1][bad], times[1:][bad]
    return a[b > a], b[b > a]


def _lost_windows(s: np.ndarray, e: np.ndarray, kill: np.ndarray, lost: float) -> np.ndarray:
    """Work discarded by each kill: min(lost, time up since the domain last came back)."""
    prev = np.concatenate(([0.0], e[:-1]))
    return np.minimum(lost, s - prev) * kill


def _account(mode: str, domains: Sequence[tuple], T: float, quorum=1, lost=0.0, pause=0.0, rejoin=0.0):
    """(goodput, uptime) over [0, T) of equal-sized domains combined by the algorithm's rule.

    dp: productive iff every domain is up (and a kill discards `lost` of world work);
    decoupled: each domain on its own while ≥ `quorum` are up; elastic_dp: each domain while up,
    except during the world pauses [s, s + pause) and [e, e + rejoin) around every down interval.
    """
    M = len(domains)
    if mode == "dp":
        s, e, kill = _union(*(np.concatenate([d[i] for d in domains]) for i in range(3)))
        down = float(np.sum(e - s))
        return (T - down - float(np.sum(_lost_windows(s, e, kill, lost)))) / T, (T - down) / T
    if mode == "decoupled":
        ss, se = _stalled(domains, quorum)
        fq = lambda t: np.asarray(t, dtype=float) - _measure(ss, se, t)  # noqa: E731  measure of quorum time
        q, total = float(fq(T)), 0.0
        for s, e, kill in domains:
            lw = _lost_windows(s, e, kill, lost)
            total += q - float(np.sum(fq(e) - fq(s))) - float(np.sum(fq(s) - fq(s - lw)))
        return total / (M * T), q / T
    s_all = np.concatenate([d[0] for d in domains])
    e_all = np.concatenate([d[1] for d in domains])
    zs = np.concatenate((s_all, e_all))
    ze = np.minimum(np.concatenate((s_all + pause, e_all + rejoin)), T)
    zs, ze, _ = _union(zs, ze, np.zeros(zs.size, dtype=bool))
    z = float(_measure(zs, ze, T))
    total = 0.0
    for s, e, _ in domains:  # up time minus (pause time − pause time while this domain was down anyway)
        total += T - float(np.sum(e - s)) - z + float(np.sum(_measure(zs, ze, e) - _measure(zs, ze, s)))
    a0s, a0e = _stalled(domains, 1)
    us, ue, _ = _union(np.concatenate((zs, a0s)), np.concatenate((ze, a0e)), np.zeros(zs.size + a0s.size, bool))
    return total / (M * T), 1.0 - float(np.sum(ue - us)) / T


def _cycles(rng: np.random.Generator, rate: float, notice: float, T: float, draw: Callable, mean_down: float):
    """One domain's down intervals over [0, T) from alternating cycles U = W + X, D = draw(rng, n)."""
    n = int(1.2 * T / (1.0 / rate + notice + mean_down)) + 16
    ups, downs, total = [], [], 0.0
    while total < T:
        ups.append(notice + rng.exponential(1.0 / rate, n))
        downs.append(draw(rng, n))
        total += float(np.sum(ups[-1]) + np.sum(downs[-1]))
    up, down = np.concatenate(ups), np.concatenate(downs)
    e = np.cumsum(up + down)
    s = e - down
    keep = s < T
    absorbed = int(np.sum(rng.poisson(rate * (notice + down[keep]))))
    return s[keep], np.minimum(e[keep], T), down[keep], absorbed


def simulate(
    p: FleetParams, algorithm: str, chips: int, learners: int = 1, quorum: int = 1, events: int = 20_000, seed: int = 0
) -> Goodput:
    """Event simulation of `expected`'s model over a horizon with `events` expected interruptions
    fleet-wide; the same seed gives the same result bit for bit."""
    _check_fleet(algorithm, chips, learners, quorum)
    _require(events >= 1, "events", events, "must be >= 1")
    M, K = (learners, quorum) if algorithm == "decoupled" else (1, 1)
    rate = chips / M / p.mtbi_s
    if rate == 0:
        return Goodput(1.0, 1.0, 0, 0, 0, 0.0)
    T = events / (M * rate)
    fixed = {"dp": p.restart_s}.get(algorithm, p.rejoin_s)
    rngs = np.random.default_rng(seed).spawn(M)
    draw = lambda g, n: fixed + p.recovery.sample(g, n)  # noqa: E731
    doms = [_cycles(g, rate, p.notice_s, T, draw, fixed + p.recovery.mean) for g in rngs]
    handled, absorbed = sum(d[0].size for d in doms), sum(d[3] for d in doms)
    domains = [(s, e, np.ones(s.size, dtype=bool)) for s, e, _, _ in doms]
    lost = {"dp": p.lost_s, "elastic_dp": 0.0, "decoupled": p.sync_lost_s}[algorithm]
    good, up = _account("decoupled" if algorithm == "decoupled" else "dp", domains, T, K, lost)
    if algorithm == "elastic_dp":  # the failed slice idles for its repair R, clipped to the next up period
        s, e, down, _ = doms[0]
        next_up = np.concatenate((s[1:], [T])) - e
        good -= min(p.slice_chips, chips) / chips * float(np.sum(np.minimum(down - fixed, next_up))) / T
    return Goodput(good, up, handled, absorbed, 0, T)


def grid(p: FleetParams, chips: Sequence[int] = PAPER_CHIPS, rows: Sequence[str] = tuple(PAPER_TABLE1)) -> dict:
    """Closed-form goodput (fraction) per row ("dp", "elastic_dp" or "M=<learners>", K = 1) and chip count."""
    out = {}
    for row in rows:
        algo, m = (row, 1) if row in ("dp", "elastic_dp") else ("decoupled", int(row.removeprefix("M=")))
        out[row] = [float(v) for v in _closed(p, algo, chips, m, 1)[0]]
    return out


def simulate_schedule(
    faults: Sequence[chaos_lib.Fault], algorithm: str, learners: int, quorum: int, duration_s: float,
    recovery_s: float, *, pause_s: float = 0.0, rejoin_s: float = 0.0, lost_s: float = 0.0,
) -> Goodput:  # fmt: skip
    """Replay a fault list: a kill takes its learner down for `recovery_s` (a kill of a down learner
    is absorbed, one of a frozen learner kills it), a freeze for its duration; then `_account`.
    dp stops while any learner is down (its kills discard `lost_s` of world work), elastic_dp
    pauses everyone `pause_s` at each drop and `rejoin_s` at each return, decoupled loses `lost_s`
    of the killed learner's unmerged work and stalls below `quorum` learners."""
    _check_fleet(algorithm, learners, learners, quorum)
    for n, v in (("duration_s", duration_s), ("recovery_s", recovery_s)):
        _require(v > 0, n, v, "must be > 0 seconds")
    for n, v in (("pause_s", pause_s), ("rejoin_s", rejoin_s), ("lost_s", lost_s)):
        _require(v >= 0, n, v, "must be >= 0 seconds")
    per: list[list] = [[] for _ in range(learners)]
    for f in faults:
        if f.target.startswith("learner-") and int(f.target[8:]) < learners and f.at < duration_s:
            per[int(f.target[8:])].append(f)
    domains, kills, absorbed, freezes = [], 0, 0, 0
    for fs in per:
        s, e, kill = [], [], []
        for f in sorted(fs):
            if e and f.at < e[-1]:
                if f.kind == "kill" and not kill[-1]:  # the frozen process is killed: it restarts now
                    e[-1], kill[-1], kills = max(e[-1], f.at + recovery_s), True, kills + 1
                else:
                    absorbed += f.kind == "kill"
                continue
            s.append(f.at)
            e.append(f.at + (recovery_s if f.kind == "kill" else f.duration))
            kill.append(f.kind == "kill")
            kills, freezes = kills + (f.kind == "kill"), freezes + (f.kind != "kill")
        domains.append((np.array(s, float), np.minimum(np.array(e, float), duration_s), np.array(kill, bool)))
    good, up = _account(algorithm, domains, duration_s, quorum, lost_s, pause_s, rejoin_s)
    return Goodput(good, up, kills, absorbed, freezes, duration_s)


def simulate_run(
    chaos: ChaosConfig, algorithm: str, learners: int, quorum: int, duration_s: float, recovery_s: float,
    *, pause_s: float = 0.0, rejoin_s: float = 0.0, lost_s: float = 0.0,
) -> Goodput:  # fmt: skip
    """A small real run's goodput: M learners (each a chip group) under `chaos`'s seeded schedule
    (`dloco.chaos.schedule`: per-learner kills at MTBF `chaos.mtbf_s`, freezes), measured restart +
    rejoin time `recovery_s`; see `simulate_schedule`."""
    faults, kw = chaos_lib.schedule(chaos, learners), {"pause_s": pause_s, "rejoin_s": rejoin_s, "lost_s": lost_s}
    return simulate_schedule(faults, algorithm, learners, quorum, duration_s, recovery_s, **kw)


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
    base: FleetParams = FleetParams(), target: dict = PAPER_TABLE1, chips: Sequence[int] = PAPER_CHIPS,
    rows: Sequence[str] = CALIBRATION_ROWS, fit_notice: bool = True,
) -> Calibration:  # fmt: skip
    """Least squares (percentage points) over `rows` of `target` for W, F, L and E[R] (θ = x², so
    ≥ 0; Nelder–Mead from three starts); J, s, ℓ, MTBI and the recovery mixture's shape from `base`."""

    def params(x: np.ndarray) -> FleetParams:
        w, f, lost, r = (float(v) for v in x**2)
        return replace(base, notice_s=w if fit_notice else base.notice_s, restart_s=f, lost_s=lost,
                       recovery=base.recovery.with_mean(r))  # fmt: skip

    want = np.array([target[r] for r in rows], dtype=float)

    def loss(x: np.ndarray) -> float:
        got = np.array(list(grid(params(x), chips, rows).values())) * 100
        return float(np.sum((got - want) ** 2))

    starts = [np.sqrt([2.0, 40.0, 1.0, 10.0]), np.sqrt([8.0, 80.0, 10.0, 30.0]), np.sqrt([0.5, 60.0, 0.1, 20.0])]
    best = min((_nelder_mead(loss, x0) for x0 in starts), key=loss)
    fit = params(best)
    diff = np.array(list(grid(fit, chips, rows).values())) * 100 - want
    return Calibration(fit, float(np.max(np.abs(diff))), float(np.sqrt(np.mean(diff**2))))
