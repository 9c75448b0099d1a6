"""What a run's progress display shows: the share of its budget done, tokens/s and the time left.

A run stops at whichever budget it reaches first (`dloco.config.BudgetConfig`): ``tokens`` trained,
wall ``seconds``, or every learner at ``steps``. The share done is therefore the largest of the
shares of the budgets that are set (a config sets at least one).
Tokens/s and the time left are measured over the last `ProgressLine.window_s` seconds, so that the
first compile does not count as slowness once training runs, and the time left follows the share
that will end the run at its own pace (a time budget's share moves at exactly 1/seconds).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any

from dloco.config import BudgetConfig


def done_fraction(status: Mapping[str, Any], budget: BudgetConfig, learners: int) -> float:
    """The share of the budget done, in [0, 1]. `status` is
    `RunHandle.status()`: ``tokens_trained``, ``elapsed_s`` and per learner ``step``."""
    shares = []
    if budget.tokens:
        shares.append(status["tokens_trained"] / budget.tokens)
    if budget.seconds:
        shares.append(status["elapsed_s"] / budget.seconds)
    if budget.steps:  # the run ends once every learner got there: the one furthest behind
        steps = [int(s.get("step", 0)) for s in (status.get("learners") or {}).values()]
        slowest = min(steps) if len(steps) >= learners else 0
        shares.append(slowest / budget.steps)
    return min(1.0, max(shares, default=0.0))


def duration(seconds: float) -> str:
    """``45s``, ``12m05s``, ``3h02m``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class ProgressLine:
    """Turns `RunHandle.status()` snapshots into display lines.

    On a terminal (`tty`) every call gives a line (the caller redraws it in place); otherwise a line
    every `every_s` seconds of the run, so logs (``ray job submit``) get a plain line at a steady pace.
    """

    window_s = 30.0

    def __init__(self, budget: BudgetConfig, learners: int, *, tty: bool, every_s: float = 10.0) -> None:
        self.budget, self.learners, self.tty, self.every_s = budget, learners, tty, every_s
        self._samples: deque[tuple[float, int, float]] = deque()  # (elapsed, tokens, share done)
        self._last_line: float | None = None

    def rates(self) -> tuple[float | None, float | None]:
        """(tokens/s, share done per second) over the window; None before two samples differ in time."""
        if len(self._samples) < 2 or self._samples[-1][0] <= self._samples[0][0]:
            return None, None
        (t0, n0, f0), (t1, n1, f1) = self._samples[0], self._samples[-1]
        return (n1 - n0) / (t1 - t0), (f1 - f0) / (t1 - t0)

    def __call__(self, status: Mapping[str, Any]) -> str | None:
        t, tokens = float(status["elapsed_s"]), int(status["tokens_trained"])
        frac = done_fraction(status, self.budget, self.learners)
        if tokens > 0:  # start measuring at the first trained token: start-up is not the pace
            self._samples.append((t, tokens, frac))
            while len(self._samples) > 2 and t - self._samples[1][0] >= self.window_s:
                self._samples.popleft()
        if not self.tty and self._last_line is not None and t - self._last_line < self.every_s:
            return None
        self._last_line = t
        rate, pace = self.rates()
        filled = int(30 * frac)
        parts = [f"[{'#' * filled}{'-' * (30 - filled)}] {100 * frac:5.1f}%", f"tokens {tokens:,}"]
        parts.append(f"{rate:,.0f} tok/s" if rate is not None else "-- tok/s")
        parts.append(f"ETA {duration((1.0 - frac) / pace)}" if pace else "ETA --")
        loss = status.get("eval_loss")
        parts.append(f"eval {loss:.3f}" if loss is not None else "eval --")
        parts.append(f"merges {status.get('merges', 0)}  rejected {status.get('rejected', 0)}")
        errors = sum((status.get("errors") or {}).values())
        if errors:
            parts.append(f"ERRORS {errors} (last: {status.get('last_error')})")
        parts.append(duration(t))
        return "  ".join(parts)
