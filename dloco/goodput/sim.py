"""Event simulation of `dloco.goodput`'s model (`simulate`) and replay of a real run's seeded
`dloco.chaos` schedule (`simulate_schedule`, `simulate_run`), both through one interval accounting."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from dloco import chaos as chaos_lib
from dloco.config import ChaosConfig
from dloco.goodput.analytic import FleetParams, Goodput, check_fleet, require

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
    check_fleet(algorithm, chips, learners, quorum)
    require(events >= 1, "events", events, "must be >= 1")
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


def simulate_schedule(
    faults: Sequence[chaos_lib.Fault],
    algorithm: str,
    learners: int,
    quorum: int,
    duration_s: float,
    recovery_s: float,
    *,
    pause_s: float = 0.0,
    rejoin_s: float = 0.0,
    lost_s: float = 0.0,
) -> Goodput:
    """Replay a fault list: a kill takes its learner down for `recovery_s` (a kill of a down learner
    is absorbed, one of a frozen learner kills it), a freeze for its duration; then `_account`.
    dp stops while any learner is down (its kills discard `lost_s` of world work), elastic_dp
    pauses everyone `pause_s` at each drop and `rejoin_s` at each return, decoupled loses `lost_s`
    of the killed learner's unmerged work and stalls below `quorum` learners."""
    check_fleet(algorithm, learners, learners, quorum)
    for n, v in (("duration_s", duration_s), ("recovery_s", recovery_s)):
        require(v > 0, n, v, "must be > 0 seconds")
    for n, v in (("pause_s", pause_s), ("rejoin_s", rejoin_s), ("lost_s", lost_s)):
        require(v >= 0, n, v, "must be >= 0 seconds")
    per: list[list] = [[] for _ in range(learners)]
    for f in faults:
        if f.target.startswith("learner-") and int(f.target[8:]) < learners and f.at < duration_s:
            per[int(f.target[8:])].append(f)
    domains, kills, absorbed, freezes = [], 0, 0, 0
    for fs in per:
        s: list[float] = []
        e: list[float] = []
        kill: list[bool] = []
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
    chaos: ChaosConfig,
    algorithm: str,
    learners: int,
    quorum: int,
    duration_s: float,
    recovery_s: float,
    *,
    pause_s: float = 0.0,
    rejoin_s: float = 0.0,
    lost_s: float = 0.0,
) -> Goodput:
    """A small real run's goodput: M learners (each a chip group) under `chaos`'s seeded schedule
    (`dloco.chaos.schedule`: per-learner kills at MTBF `chaos.mtbf_s`, freezes), measured restart +
    rejoin time `recovery_s`; see `simulate_schedule`."""
    faults, kw = chaos_lib.schedule(chaos, learners), {"pause_s": pause_s, "rejoin_s": rejoin_s, "lost_s": lost_s}
    return simulate_schedule(faults, algorithm, learners, quorum, duration_s, recovery_s, **kw)
