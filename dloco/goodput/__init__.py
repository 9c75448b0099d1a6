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

# Layout: `analytic` (the fleet's parameters, the closed form, `grid` and `calibrate`) and `sim`
# (the event simulation and the replay of `dloco.chaos` schedules, with their interval accounting).

from dloco.goodput.analytic import (
    ALGORITHMS,
    CALIBRATION_ROWS,
    PAPER_CHIPS,
    PAPER_TABLE1,
    YEAR_S,
    Calibration,
    FleetParams,
    Goodput,
    Recovery,
    calibrate,
    expected,
    grid,
)
from dloco.goodput.sim import simulate, simulate_run, simulate_schedule

__all__ = [
    "ALGORITHMS",
    "CALIBRATION_ROWS",
    "PAPER_CHIPS",
    "PAPER_TABLE1",
    "YEAR_S",
    "Calibration",
    "FleetParams",
    "Goodput",
    "Recovery",
    "calibrate",
    "expected",
    "grid",
    "simulate",
    "simulate_run",
    "simulate_schedule",
]
