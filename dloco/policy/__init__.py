"""The syncer's pure decisions (ALGORITHM.md §5).

Everything here is a value in, a value out: whether to accept a contribution, how long the grace
window ξ_grace is, and whether a fragment round may close. Time is always passed in by the caller
(``now``, seconds on the caller's clock); nothing here reads a clock, does I/O or keeps globals.
Each decision carries a human-readable ``reason`` that names the values it was made from, so the
actor can log it verbatim.
"""

# Layout: `checks` (a push's metadata and values, the norm tracker) and `rounds` (timing averages,
# the grace window, the per-fragment round).

from dloco.policy.checks import (
    ACCEPTED,
    ContributionMeta,
    Decision,
    NormTracker,
    check_cursor,
    check_fields,
    check_meta,
    check_values,
)
from dloco.policy.rounds import Beat, Ema, FragmentRound, RoundDecision, SyncerTimings, grace_window

__all__ = [
    "ACCEPTED",
    "Beat",
    "ContributionMeta",
    "Decision",
    "Ema",
    "FragmentRound",
    "NormTracker",
    "RoundDecision",
    "SyncerTimings",
    "check_cursor",
    "check_fields",
    "check_meta",
    "check_values",
    "grace_window",
]
