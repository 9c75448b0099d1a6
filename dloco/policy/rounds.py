"""Timing averages (:class:`Ema`, :class:`SyncerTimings`), the adaptive grace window and the
per-fragment round (:class:`FragmentRound`) that decides when a fragment's merge may run."""

from __future__ import annotations

import math
import statistics
import types
from collections.abc import Mapping
from dataclasses import dataclass

from dloco.policy.checks import ContributionMeta

# --------------------------------------------------------------------------------------------
# Timing averages and the adaptive grace window
# --------------------------------------------------------------------------------------------


class Ema:
    """Exponential moving average ``v ← decay·v + (1 − decay)·x``; the first sample sets v.

    Args:
        decay: weight of the old value, in ``[0, 1)``.
        value: a starting value (e.g. from a saved state), or None.
    """

    def __init__(self, decay: float = 0.9, value: float | None = None):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"Ema decay must be in [0, 1), got {decay}")
        self.decay = decay
        self.value = value

    def update(self, x: float) -> float:
        """Folds in sample x and returns the new value."""
        x = float(x)
        if not math.isfinite(x):
            raise ValueError(f"Ema sample must be finite, got {x}")
        self.value = x if self.value is None else self.decay * self.value + (1 - self.decay) * x
        return self.value


def grace_window(
    step_time: float,
    quorum_time: float,
    sync_time: float,
    overlap: int,
    gamma: float,
    max_grace_steps: float,
) -> float:
    """Adaptive grace window (paper Eq. 3, this project's form)::

        ξ_grace = clamp(γ·(τ·ξ_step − ξ_quorum − ξ_sync), 0, ξ_step·max_grace_steps)

    τ·ξ_step is how long a learner computes while one fragment's round trip is in flight; what the
    quorum and the merge do not use of it is slack, of which the window may take the share γ.

    Args:
        step_time: ξ_step, seconds per inner step.
        quorum_time: ξ_quorum, seconds from a round's first push to its K-th.
        sync_time: ξ_sync, seconds of merge + commit + publish.
        overlap: τ, ``sync.overlap``.
        gamma: γ, ``syncer.grace_factor``.
        max_grace_steps: ``syncer.max_grace_steps``, the cap in units of ξ_step.

    Returns:
        ξ_grace in seconds, ``>= 0``.
    """
    if gamma < 0 or max_grace_steps < 0 or overlap < 0:
        raise ValueError(
            f"grace_window needs gamma, max_grace_steps, overlap >= 0; got {gamma}, {max_grace_steps}, {overlap}"
        )
    if gamma == 0:
        return 0.0  # synchronous setting; also avoids 0 · inf
    slack = gamma * (overlap * step_time - quorum_time - sync_time)
    return min(max(slack, 0.0), step_time * max_grace_steps)


class SyncerTimings:
    """The syncer's EMAs: ξ_step (median across learners of per-learner EMAs), ξ_quorum, ξ_sync.

    Args:
        decay: decay of every EMA.
    """

    def __init__(self, decay: float = 0.9):
        Ema(decay)  # validates decay
        self.decay = decay
        self._step: dict[int, Ema] = {}
        self._cycle: dict[int, Ema] = {}
        self._quorum = Ema(decay)
        self._sync = Ema(decay)

    def observe_step_time(self, learner_id: int, seconds: float) -> None:
        """Folds a learner's reported seconds per inner step into its own EMA."""
        self._step.setdefault(learner_id, Ema(self.decay)).update(seconds)

    def observe_quorum_time(self, seconds: float) -> None:
        """Folds one round's time from first push to K-th push into ξ_quorum."""
        self._quorum.update(seconds)

    def observe_sync_time(self, seconds: float) -> None:
        """Folds one round's merge + commit + publish time into ξ_sync."""
        self._sync.update(seconds)

    def forget(self, learner_id: int) -> None:
        """Drops a learner's step-time and cycle EMAs (it died, or restarts with fresh ones)."""
        self._step.pop(learner_id, None)
        self._cycle.pop(learner_id, None)

    @property
    def step_time(self) -> float | None:
        """ξ_step: the median of the per-learner EMAs, or None if no learner reported yet."""
        values = [e.value for e in self._step.values() if e.value is not None]
        return float(statistics.median(values)) if values else None

    def observe_cycle_time(self, learner_id: int, seconds: float) -> None:
        """Folds a learner's reported seconds per step end to end (`cycle_time`: the step, its
        pushes, polls and installs) into its own EMA; what a learner's pushes are timed by."""
        self._cycle.setdefault(learner_id, Ema(self.decay)).update(seconds)

    def cycle_time(self, learner_id: int) -> float | None:
        """Learner m's EMA of seconds per step end to end, or None if it has not reported."""
        e = self._cycle.get(learner_id)
        return None if e is None else e.value

    @property
    def fastest_cycle_time(self) -> float | None:
        """The smallest per-learner cycle EMA (the fastest learner's seconds per step), or None."""
        values = [e.value for e in self._cycle.values() if e.value is not None]
        return min(values) if values else None

    @property
    def quorum_time(self) -> float | None:
        """ξ_quorum, or None before the first observation."""
        return self._quorum.value

    @property
    def sync_time(self) -> float | None:
        """ξ_sync, or None before the first observation."""
        return self._sync.value

    def grace(self, overlap: int, gamma: float, max_grace_steps: float) -> float:
        """ξ_grace from :func:`grace_window`; 0 before any step time is known.

        An unobserved ξ_quorum or ξ_sync counts as 0.
        """
        step_time = self.step_time
        if step_time is None:
            return 0.0
        return grace_window(
            step_time,
            self.quorum_time or 0.0,
            self.sync_time or 0.0,
            overlap,
            gamma,
            max_grace_steps,
        )

    def to_state(self) -> dict:
        """A JSON-able dict; learner ids are kept as ``[id, value]`` pairs."""
        return {
            "step_time": [[m, e.value] for m, e in sorted(self._step.items())],
            "quorum_time": self._quorum.value,
            "sync_time": self._sync.value,
        }

    @classmethod
    def from_state(cls, state: Mapping, decay: float = 0.9) -> SyncerTimings:
        """Rebuilds from :meth:`to_state`."""
        timings = cls(decay)
        for m, value in state["step_time"]:
            timings._step[int(m)] = Ema(decay, value)
        timings._quorum.value = state["quorum_time"]
        timings._sync.value = state["sync_time"]
        return timings


# --------------------------------------------------------------------------------------------
# Dynamic local updates: the per-fragment beat
# --------------------------------------------------------------------------------------------


class Beat:
    """A fragment's push clock under dynamic local updates (`sync.dynamic`; Liu et al. 2024,
    *Asynchronous Local-SGD*, DyLU), phase-locked on the syncer's clock.

    Beats fall one period T apart; the fragment's first push sets their phase. A push arriving at
    time a belongs to the nearest beat b ≥ the last one placed (|a − b| ≤ T/2 once the phase is
    set), and its lateness is a − b. The pusher's next push of the fragment is due

        n = clamp(⌈(T − lateness) / ξ_m⌉ − 1, 1, 2H)   steps after this one,

    ξ_m being its seconds per step: it then arrives less than one of its steps before beat b + T,
    whatever its speed and its latency to the syncer (both measured where they act, so no clock is
    compared with another). Aiming just before the beat rather than at it puts every push of a
    period into the round that closes there (`FragmentRound.decide`'s `until`). A push more
    than T/2 off its beat (a learner that restarted or was frozen) is told the n that brings it
    back into phase.

    Args:
        every: H, the steps the fastest learner takes in one period (bounds n at 2H).
    """

    def __init__(self, every: int):
        self.every = every
        self.at: float | None = None  # the newest beat a push was placed on

    def place(self, arrival: float, period: float) -> float:
        """Places a push that arrived at `arrival` on its beat (moving `at` forward); returns its lateness."""
        if not (math.isfinite(period) and period > 0):
            raise ValueError(f"period must be finite and > 0, got {period}")
        if self.at is None:
            self.at = arrival
        k = round((arrival - self.at) / period)
        beat = self.at + k * period
        self.at = max(self.at, beat)
        return arrival - beat

    def next_push(self, lateness: float, period: float, step_time: float) -> int:
        """n: in how many of its steps (`step_time` s each) the pusher's next push is due."""
        if not (math.isfinite(step_time) and step_time > 0):
            return self.every
        # ⌈x⌉ − 1 for x = (T − lateness)/ξ_m: the largest n with n·ξ_m < T − lateness, so the push
        # lands strictly before the beat (one at the beat itself may find its round just closed);
        # − 1e-6 keeps float rounding from adding a step to an exact x
        n = math.ceil((period - lateness) / step_time - 1e-6) - 1
        return int(min(max(n, 1), 2 * self.every))


# --------------------------------------------------------------------------------------------
# The per-fragment round
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RoundDecision:
    """Whether a fragment round closes now.

    Attributes:
        close: merge the pending contributions now.
        reason: why, naming the values.
        wait: seconds until the caller should poll again; None means wait for the next push.
    """

    close: bool
    reason: str
    wait: float | None


class FragmentRound:
    """Pending contributions of one fragment p for the round that will produce version v_p + 1.

    ``pending[m]`` holds learner m's latest valid push. The round may close once K learners have a
    pending contribution and the grace window ξ_grace has passed, or earlier once every live
    learner has one. With K = M and γ = 0 (ξ_grace = 0) it closes exactly when the M-th
    contribution arrives: synchronous DiLoCo.

    Decision: the deadline is fixed at the first :meth:`decide` after the quorum is reached, as
    ``quorum_reached_at + grace`` with the ``grace`` passed to that call; later calls do not move
    it, so a round's window cannot be stretched by EMA updates while it is open.

    Args:
        fragment_id: p.
        quorum: K, ``syncer.quorum``, ``>= 1``.
    """

    def __init__(self, fragment_id: int, quorum: int):
        if quorum < 1:
            raise ValueError(f"syncer.quorum (K) must be >= 1, got {quorum}")
        self.fragment_id = fragment_id
        self.quorum = quorum
        self._pending: dict[int, tuple[ContributionMeta, object]] = {}
        self._reset_times()

    def _reset_times(self) -> None:
        self._first_push_at: float | None = None
        self._quorum_reached_at: float | None = None
        self._quorum_time: float | None = None
        self._deadline: float | None = None

    @property
    def pending(self) -> Mapping[int, tuple[ContributionMeta, object]]:
        """Read-only view: learner id → (meta, item)."""
        return types.MappingProxyType(self._pending)

    @property
    def first_push_at(self) -> float | None:
        """When this round's first push arrived, or None while it is empty."""
        return self._first_push_at

    @property
    def quorum_time(self) -> float | None:
        """Seconds from this round's first push to its K-th, once reached (read before take)."""
        return self._quorum_time

    @property
    def quorum_reached_at(self) -> float | None:
        """When the K-th contribution arrived (read before take), or None."""
        return self._quorum_reached_at

    def add(self, meta: ContributionMeta, item: object, now: float) -> str | None:
        """Adds an accepted push; returns a reason string if it superseded (or lost to) another.

        A push of a learner that already has one pending supersedes it. Decision: "newer" is the
        larger ``(incarnation, step)``, ties going to the later call, so a push delivered out of
        order never replaces a newer one of the same learner.

        Raises:
            ValueError: if ``meta.fragment_id`` is not this round's fragment.
        """
        if meta.fragment_id != self.fragment_id:
            raise ValueError(f"push for fragment {meta.fragment_id} added to the round of fragment {self.fragment_id}")
        m = meta.learner_id
        if self._first_push_at is None:
            self._first_push_at = now
        old = self._pending.get(m)
        if old is not None:
            before = old[0]
            if (meta.incarnation, meta.step) < (before.incarnation, before.step):
                return (
                    f"ignored out-of-order push of learner {m} (step {meta.step} older than pending step {before.step})"
                )
            self._pending[m] = (meta, item)
            return f"superseded push of learner {m} (step {before.step} -> {meta.step})"
        self._pending[m] = (meta, item)
        if self._quorum_reached_at is None and len(self._pending) >= self.quorum:
            self._quorum_reached_at = now
            self._quorum_time = now - self._first_push_at
        return None

    def decide(
        self, now: float, grace: float, live_learners: int | None = None, until: float | None = None
    ) -> RoundDecision:
        """Whether the round closes at time ``now``.

        Not closable while |pending| < K. Closes at once when ``live_learners`` is given and
        |pending| >= live_learners (waiting cannot add anyone), else when
        ``now >= max(quorum_reached_at + grace, until)``.

        Args:
            now: current time on the caller's clock.
            grace: ξ_grace in seconds, used only to fix the deadline (see class docstring).
            live_learners: how many learners are alive, or None if unknown.
            until: the beat the round's pushes aim at (`Beat`, `sync.dynamic`), or None; like
                `grace` it is read once, when the deadline is fixed.
        """
        if not (math.isfinite(grace) and grace >= 0):
            raise ValueError(f"grace must be finite and >= 0, got {grace}")
        n, k = len(self._pending), self.quorum
        if n < k:
            return RoundDecision(False, f"waiting for quorum {n}/{k}", None)
        if live_learners is not None and n >= live_learners:
            return RoundDecision(
                True,
                f"all live learners contributed ({n} pending, {live_learners} live)",
                None,
            )
        if self._deadline is None:
            assert self._quorum_reached_at is not None, "n >= K, so add() recorded when the quorum was reached"
            self._deadline = max(self._quorum_reached_at + grace, until if until is not None else -math.inf)
        left = self._deadline - now
        if left <= 0:
            return RoundDecision(True, f"grace window elapsed ({n} pending, quorum {k})", None)
        return RoundDecision(False, f"grace window open, {left:.3g} s left ({n}/{k} pending)", left)

    def take(self) -> list[tuple[ContributionMeta, object]]:
        """Returns the pending contributions sorted by learner id and starts a fresh round."""
        taken = [self._pending[m] for m in sorted(self._pending)]
        self._pending.clear()
        self._reset_times()
        return taken
