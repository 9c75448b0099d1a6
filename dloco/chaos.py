"""Seeded chaos: the fault schedule of a run and the per-step straggler and payload-loss draws.

ALGORITHM.md §10. Everything here is a pure function of `ChaosConfig` (and the learner, step or
push it is asked about), so the same seed replays the same faults against every algorithm; the
driver carries the schedule out (`actors.launch`), the learners only ask how slow a step is and
whether a push is lost on the wire. Nothing here touches the learners' math.

Faults per learner m, on the run's wall clock (seconds since the run started):

    kills:    t_1 = warmup + X_1, t_{i+1} = t_i + X_{i+1},   X ~ Exponential(mtbf_s)
    freezes:  t_1 = warmup + Y_1, t_{i+1} = t_i + freeze_s + Y_{i+1},   Y ~ Exponential(freeze_mtbf_s)

A kill is a renewal process measured from the previous kill (not from the learner's return), so
the schedule does not depend on how long a restart actually took; a kill that finds its learner
still down is carried out as a no-op and logged as such. Every draw comes from its own
`numpy.random.Generator` seeded with ``(seed, purpose, learner, ...)``, so adding a learner or a
fault kind never shifts another's draws.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dloco.config import ChaosConfig

_KILL, _FREEZE, _STRAGGLERS, _JITTER, _LOSS = range(5)


@dataclass(frozen=True, order=True)
class Fault:
    """One scheduled fault: at `at` seconds, `kind` (kill | freeze) hits `target`.

    `target` is ``learner-<m>``, ``syncer`` or ``store``; `duration` is a freeze's length.
    """

    at: float
    target: str
    kind: str
    duration: float = 0.0

    def to_event(self) -> dict:
        return {"at": self.at, "target": self.target, "kind": self.kind, "duration": self.duration}


def _renewal(rng: np.random.Generator, mean: float, start: float, horizon: float, gap: float = 0.0) -> list[float]:
    times, t = [], start + rng.exponential(mean)
    while t < horizon:
        times.append(float(t))
        t += gap + rng.exponential(mean)
    return times


def schedule(cfg: ChaosConfig, learners: int) -> list[Fault]:
    """All faults of a run with `learners` learners (ids 0..M−1) up to `cfg.horizon_s`, by time."""
    faults: list[Fault] = []
    for m in range(learners):
        if cfg.mtbf_s > 0:
            rng = np.random.default_rng([cfg.seed, _KILL, m])
            faults += [Fault(t, f"learner-{m}", "kill") for t in _renewal(rng, cfg.mtbf_s, cfg.warmup_s, cfg.horizon_s)]
        if cfg.freeze_mtbf_s > 0:
            rng = np.random.default_rng([cfg.seed, _FREEZE, m])
            times = _renewal(rng, cfg.freeze_mtbf_s, cfg.warmup_s, cfg.horizon_s, gap=cfg.freeze_s)
            faults += [Fault(t, f"learner-{m}", "freeze", cfg.freeze_s) for t in times]
    faults += [Fault(t, "syncer", "kill") for t in cfg.syncer_kills_s if t < cfg.horizon_s]
    faults += [Fault(t, "store", "kill") for t in cfg.store_kills_s if t < cfg.horizon_s]
    return sorted(faults)


def stragglers(cfg: ChaosConfig, learners: int) -> frozenset[int]:
    """The `cfg.stragglers` learner ids (a seeded choice among 0..M−1) whose steps are slowed."""
    n = min(cfg.stragglers, learners)
    if n == 0:
        return frozenset()
    rng = np.random.default_rng([cfg.seed, _STRAGGLERS])
    return frozenset(int(m) for m in rng.choice(learners, size=n, replace=False))


def step_factor(cfg: ChaosConfig, learner: int, step: int, straggler: bool) -> float:
    """How many times longer learner m's step `step` takes: straggler_factor (if it is one) × U(1, 1 + jitter)."""
    f = cfg.straggler_factor if straggler else 1.0
    if cfg.jitter > 0:
        f *= 1.0 + cfg.jitter * float(np.random.default_rng([cfg.seed, _JITTER, learner, step]).random())
    return f


def payload_lost(cfg: ChaosConfig, learner: int, incarnation: int, step: int, fragment: int) -> bool:
    """Whether this push is lost on the wire (probability `payload_loss`, seeded per push)."""
    if cfg.payload_loss <= 0:
        return False
    u = np.random.default_rng([cfg.seed, _LOSS, learner, incarnation, step, fragment]).random()
    return bool(u < cfg.payload_loss)


def expected_failures(cfg: ChaosConfig, learners: int, duration_s: float) -> float:
    """Mean number of kills in [0, duration_s] across `learners` (what the schedule should average)."""
    if cfg.mtbf_s <= 0:
        return 0.0
    return learners * max(0.0, duration_s - cfg.warmup_s) / cfg.mtbf_s
