"""Whether a push's step count and timings fit the time the learner had (ALGORITHM.md §5).

A push claims steps: its step counter t and the c_steps it covers set its merge weight
(w_m = c_tok² / c_steps, c_tok ≤ c_steps × its batch), its per-step norm ‖δ‖ / c_steps (what the
outlier check compares) and, once merged, the ledger's resume point and the replay fence. None of
it was checked against time. Measured with `tests/test_hostile.py`'s attacks on the checks from
before (`micro`, 14 rounds beside one honest learner): ``tokens = 2**62`` over the steps that make
them plausible per step was merged, wrote 4.6e18 tokens and step 3.6e16 into the ledger and held
the honest learner's share down (‖Θ_p‖ 19.67 against 19.79 without it); ``step = steps = 10**12``
with a δ of 1e11× an honest one had an honest per-step norm and passed every check at push and
close, so that only the commit check refused it, and with it each round's honest push (‖Θ_p‖
stayed at its start, 19.58). The audit of #34 reports the same push taking ‖Θ‖ from 0.34 to 1e5
in eight commits where the commit check let it by. A learner cannot have trained faster than the machine lets it, so:

``t − t₀ ≤ ρ·((now − s₀) / ξ_step + H)``  and  ``(t − t₀)·max(step_time, cycle_time) ≤ ρ·(now − s₀ + H·ξ_step)``

(t₀, s₀) is the learner's step and the syncer's time at its last push that passed this check;
for an incarnation this syncer has not heard from, t₀ is the newest step the ledger merged for
it (its resume point is no later) and s₀ the time of that first push. ξ_step is the median of
the learners' step times (`SyncerTimings.step_time`): one learner cannot move it where there are
three or more, and with two it can at most halve it. ρ = `syncer.max_norm_ratio`, H = `sync.every`
(a fresh learner's first push covers at most H steps). The second form bounds the learner's own
timings (a ``cycle_time`` of 1e9 s made the run's goodput 5e7).

After a syncer restart the learners that trained through the outage T show more steps than the
fresh s₀ allows; their pushes are rejected ("implausible pace") until ρ·(now − s₀) covers T, about
T/ρ later, and then merged whole: nothing trained is lost. Without a step time (no learner has
reported one, as in a run whose learners send none) the check cannot judge and lets the push by.
"""

from __future__ import annotations

from dloco.policy.checks import ContributionMeta


class PaceCheck:
    """The (step, time) a learner's next push is measured from, per learner; `check` judges a push.

    Args:
        ratio: ρ, the slack factor (`syncer.max_norm_ratio`).
        every: H (`sync.every`), steps a fresh learner's first push may cover.
    """

    def __init__(self, ratio: float, every: int) -> None:
        self.ratio, self.every = float(ratio), int(every)
        self._last: dict[int, tuple[int, int, float]] = {}  # learner → (incarnation, step t₀, time s₀)

    def check(self, meta: ContributionMeta, now: float, step_time: float | None, merged_step: int) -> str | None:
        """Why `meta`'s steps or timings are implausible at `now`, or None.

        `step_time` is ξ_step (None or ≤ 0: unknown, the push is let by); `merged_step` the newest
        step the ledger merged for this learner (any incarnation; 0 if none).
        """
        m = meta.learner_id
        last = self._last.get(m)
        if last is None or last[0] != meta.incarnation:
            last = (meta.incarnation, merged_step, now)
            self._last[m] = last
        _, t0, s0 = last
        if step_time is None or not step_time > 0:
            return None
        ahead, elapsed = meta.step - t0, max(now - s0, 0.0)
        limit = self.ratio * (elapsed / step_time + self.every)
        if ahead > limit:
            return (
                f"implausible pace: step {meta.step} is {ahead} steps past step {t0} of {elapsed:.3g} s ago, "
                f"more than max_norm_ratio {self.ratio:g} × ({elapsed:.3g} s / step time {step_time:.3g} s "
                f"+ H {self.every}) = {limit:.6g}"
            )
        own = max(meta.step_time, meta.cycle_time)
        if ahead > 0 and ahead * own > self.ratio * (elapsed + self.every * step_time):
            return (
                f"implausible timing: {ahead} steps × {own:.3g} s per step = {ahead * own:.3g} s, more than "
                f"max_norm_ratio {self.ratio:g} × ({elapsed:.3g} s since step {t0} + H {self.every} × step time "
                f"{step_time:.3g} s)"
            )
        return None

    def passed(self, meta: ContributionMeta, now: float) -> None:
        """`meta` passed every check: the learner's next push is measured from it."""
        last = self._last.get(meta.learner_id)
        if last is None or last[0] != meta.incarnation or meta.step > last[1]:
            self._last[meta.learner_id] = (meta.incarnation, meta.step, now)

    def forget(self, learner_id: int) -> None:
        """The learner left the registry."""
        self._last.pop(learner_id, None)
