"""Contribution checks: a push's metadata (:func:`check_fields`, :func:`check_meta`, before its payload is
fetched) and its decoded values (:func:`check_values`), with the :class:`NormTracker` of accepted norms."""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

INT_FIELDS = ("learner_id", "incarnation", "fragment_id", "base_version", "tokens", "steps", "step")
_INT_LIMIT = 2**63  # every count and id of a push fits int64 (the ledger, JSON, float64 weights stay exact)


@dataclass(frozen=True)
class ContributionMeta:
    """Small metadata travelling with one learner → syncer push of fragment p.

    Attributes:
        learner_id: the learner m that pushed.
        incarnation: the learner's incarnation number from the store's registry.
        fragment_id: the fragment p the pseudo-gradient δ belongs to.
        base_version: version v_p of the global fragment the learner's anchor came from.
        tokens: c_tok, tokens trained since the anchor.
        steps: c_steps, inner steps since the anchor.
        step: the learner's local step counter t at push time.
        step_time: the learner's recent seconds per inner step (feeds ξ_step).
        cursor: the learner's data cursor at push time (opaque, JSON-able).
        sent_at: time stamp of the push on the caller's clock.
        cycle_time: the learner's typical seconds per step including any wait for merges
            (`dloco.metrics.typical_cycle` of its recent steps), for the goodput of ALGORITHM.md §8.
    """

    learner_id: int
    incarnation: int
    fragment_id: int
    base_version: int
    tokens: int
    steps: int
    step: int
    step_time: float
    cursor: dict | None = None
    sent_at: float = 0.0
    cycle_time: float = 0.0


@dataclass(frozen=True)
class Decision:
    """Accept or reject one contribution; ``reason`` is ``"accepted"`` or names the failed check."""

    accept: bool
    reason: str
    version: int | None = None  # the fragment's version at the syncer when it decided (told to the pusher)
    next_push: int | None = None  # `sync.dynamic`: the pusher's next push of the fragment is due this many steps on


ACCEPTED = Decision(True, "accepted")


def _reject(reason: str) -> Decision:
    return Decision(False, reason)


class NormTracker:
    """Median of the last ``window`` accepted contribution norms, for the outlier check.

    The syncer records per-step norms ‖δ‖ / c_steps, so that pushes covering different numbers
    of steps (a fragment's first push covers only its send offset) compare fairly.

    A contribution is an outlier when ‖δ‖ > ``max_norm_ratio`` × median, once at least ``warmup``
    norms have been recorded (before that the median is too noisy to judge by).

    Args:
        window: how many recent accepted norms the median is taken over.
        warmup: how many norms must be recorded before :meth:`ready` is true; at most ``window``.

    Raises:
        ValueError: if ``window < 1`` or ``warmup`` is outside ``[0, window]``.
    """

    def __init__(self, window: int = 64, warmup: int = 8):
        if window < 1:
            raise ValueError(f"NormTracker window must be >= 1, got {window}")
        if not 0 <= warmup <= window:
            raise ValueError(
                f"NormTracker warmup must be in [0, window={window}], got {warmup}; "
                "a larger warm-up could never be reached"
            )
        self.window = window
        self.warmup = warmup
        self._norms: deque[float] = deque(maxlen=window)

    def record(self, norm: float) -> None:
        """Records the norm ‖δ‖ of an accepted contribution. Raises ValueError if not finite/≥ 0."""
        norm = float(norm)
        if not math.isfinite(norm) or norm < 0:
            raise ValueError(f"norm must be finite and >= 0, got {norm}")
        self._norms.append(norm)

    def __len__(self) -> int:
        """How many norms are recorded (at most ``window``)."""
        return len(self._norms)

    def warming_up(self) -> bool:
        """Whether fewer than ``warmup`` norms are recorded: the warm-up the outlier check waits out."""
        return len(self._norms) < self.warmup

    def ready(self) -> bool:
        """Whether at least ``warmup`` norms (and at least one) are recorded."""
        return len(self._norms) >= max(self.warmup, 1)

    def median(self) -> float:
        """Median of the recorded norms. Raises ValueError if none are recorded."""
        if not self._norms:
            raise ValueError("NormTracker.median() called before any norm was recorded")
        return float(statistics.median(self._norms))

    def to_state(self) -> list[float]:
        """The recorded norms, oldest first, as a plain list."""
        return list(self._norms)

    @classmethod
    def from_state(cls, state: Iterable[float], *, window: int = 64, warmup: int = 8) -> NormTracker:
        """Rebuilds a tracker from :meth:`to_state`; keeps the last ``window`` norms."""
        tracker = cls(window=window, warmup=warmup)
        for norm in state:
            tracker.record(norm)
        return tracker


def is_int(x: Any) -> bool:
    """Whether `x` is an int (not a bool) within int64."""
    return isinstance(x, int) and not isinstance(x, bool) and -_INT_LIMIT <= x < _INT_LIMIT


def _is_real(x: Any) -> bool:
    return isinstance(x, float) or is_int(x)


def check_cursor(cursor: Any) -> str | None:
    """Why a push's data cursor is malformed, or None: it must be None or exactly
    ``{"epoch": e, "index": i}`` with ints 0 <= e, i < 2**63 (`dloco.data.Cursor.to_dict`). It is
    persisted in the ledger and read back by every registration of its learner, so a malformed
    one would make that learner's `register` fail for good; a non-JSON-able one, the commit."""
    if cursor is None:
        return None
    if type(cursor) is not dict or set(cursor) != {"epoch", "index"}:
        keys = sorted(map(repr, cursor)) if isinstance(cursor, dict) else None
        return f"malformed cursor: {type(cursor).__name__} {keys or ''}, expected {{'epoch': int, 'index': int}}"
    bad = {k: v for k, v in cursor.items() if not (is_int(v) and v >= 0)}
    if bad:
        return f"malformed cursor: {', '.join(f'{k} {v!r}' for k, v in bad.items())} (must be ints >= 0)"
    return None


def check_fields(meta: ContributionMeta) -> Decision:
    """The form of a push's metadata, checked before anything compares, hashes or stores it.

    Ids and counters (:data:`INT_FIELDS`) must be ints (not bool) within int64; ``step_time``,
    ``cycle_time`` and ``sent_at`` floats or such ints (`check_meta` checks their range); the
    cursor well formed (:func:`check_cursor`).
    Decision: a malformed push is rejected here, alone, with its reason; let through, it raised
    later, far from its cause (a ``str`` incarnation in the comparison with the registry, a huge
    token count in the merge weights, which dropped the whole round, good pushes included).
    """
    bad = [f"{k} {getattr(meta, k)!r}" for k in INT_FIELDS if not is_int(getattr(meta, k))]
    if bad:
        return _reject(f"malformed metadata: {', '.join(bad)} (must be ints within int64)")
    bad = [
        f"{k} {getattr(meta, k)!r}" for k in ("step_time", "cycle_time", "sent_at") if not _is_real(getattr(meta, k))
    ]
    if bad:
        return _reject(f"malformed metadata: {', '.join(bad)} (must be numbers)")
    reason = check_cursor(meta.cursor)
    return ACCEPTED if reason is None else _reject(reason)


def check_meta(
    meta: ContributionMeta,
    *,
    registry: Mapping[int, int],
    current_version: int,
    max_staleness: int,
    tokens_per_step: Callable[[int], int] | None = None,
) -> Decision:
    """Cheap checks on a push's metadata, before its payload is fetched or decoded.

    In order: malformed fields (:func:`check_fields`); unknown learner; old (or unknown, newer)
    incarnation; base version in the future (``base_version > v_p``); stale
    (``v_p − base_version > max_staleness``); empty contribution (``c_tok <= 0`` or ``c_steps <= 0``,
    whose merge weight w_m = c_tok² / c_steps is undefined or zero); more tokens than the steps
    can hold (``c_tok > c_steps × tokens_per_step(m)``: a learner trains exactly its batch × seq_len
    tokens a step, so the claim, which sets its weight and the ledger, cannot be larger); a step
    before the pushed steps (``step < c_steps``: steps (step − c_steps, step] would start below 0);
    invalid step time (non-finite or negative, which would poison ξ_step), cycle time or send time
    (non-finite or negative: they feed the goodput accounting and the merge events).
    Whether ``meta.fragment_id`` matches the round is the caller's business.

    Args:
        meta: the push's metadata.
        registry: learner id → current incarnation, from the store.
        current_version: v_p, the current version of the fragment.
        max_staleness: ``syncer.max_staleness``.
        tokens_per_step: learner id → tokens one of its steps trains; None skips that check.

    Returns:
        A :class:`Decision`.
    """
    d = check_fields(meta)
    if not d.accept:
        return d
    m = meta.learner_id
    if m not in registry:
        return _reject(f"unknown learner {m} (registered: {sorted(registry)})")
    known = registry[m]
    if meta.incarnation < known:
        return _reject(f"old incarnation: learner {m} incarnation {meta.incarnation}, registry has {known}")
    if meta.incarnation > known:
        return _reject(f"unknown incarnation: learner {m} incarnation {meta.incarnation}, registry has {known}")
    if meta.base_version > current_version:
        return _reject(f"base version in the future: base_version {meta.base_version}, current {current_version}")
    if current_version - meta.base_version > max_staleness:
        return _reject(
            f"stale: base_version {meta.base_version}, current {current_version}, max_staleness {max_staleness}"
        )
    if meta.tokens <= 0 or meta.steps <= 0:
        return _reject(f"empty contribution: tokens {meta.tokens}, steps {meta.steps}")
    if tokens_per_step is not None and meta.tokens > meta.steps * tokens_per_step(m):
        tps = tokens_per_step(m)
        return _reject(
            f"implausible tokens: {meta.tokens} > steps {meta.steps} × {tps} tokens per step = {meta.steps * tps}"
        )
    if meta.step < meta.steps:
        return _reject(f"invalid step: step {meta.step} < steps {meta.steps} (the pushed steps start below 0)")
    if not (math.isfinite(meta.step_time) and meta.step_time >= 0):
        return _reject(f"invalid step_time {meta.step_time} (must be finite and >= 0)")
    if not (math.isfinite(meta.cycle_time) and meta.cycle_time >= 0 and math.isfinite(meta.sent_at)):
        return _reject(f"invalid cycle_time {meta.cycle_time} or sent_at {meta.sent_at} (must be finite, cycle >= 0)")
    return ACCEPTED


def check_values(
    *,
    expected_shapes: Mapping[str, tuple],
    shapes: Mapping[str, tuple],
    sq_norm: float | None,
    norms: NormTracker | None,
    max_norm_ratio: float,
    bound: float | None = None,
) -> Decision:
    """Checks on the decoded payload δ of a push.

    In order: shape mismatch (missing or extra tensor names, wrong shapes); non-finite ‖δ‖²;
    a zero δ (degenerate: AdamW moves every parameter it steps at a positive learning rate, so an
    honest push is zero only if all its steps ran at lr 0, and then has nothing to merge; merged,
    zeros would dilute the round's weights, and recorded, enough of them make the median 0, which
    switches the outlier check off: the audit of #34 reports four pushes of ~1e4× committed after
    40 zeros, ‖Θ‖ from 0.35 to 9,696); norm outlier ``‖δ‖ > max_norm_ratio × median`` of
    accepted norms, once ``norms.ready()``; during the warm-up (``norms.warming_up()``: fewer than
    ``warmup`` norms recorded, as after a start with no history) ``‖δ‖ > bound`` instead, an
    absolute bound the caller derives without
    any history (`dloco.defence.contribution_bound`), so that the warm-up is not a time in which
    anything passes. ``sq_norm=None`` (not yet computed) skips the value checks; ``norms=None``
    and ``bound=None`` skip their norm check. Decision: a zero median disables the outlier
    check, since otherwise no learner that starts moving again could ever be accepted.

    Args:
        expected_shapes: tensor name → shape of the fragment.
        shapes: tensor name → shape of the decoded payload.
        sq_norm: ‖δ‖², summed over the fragment's tensors, or None.
        norms: tracker of accepted norms, or None.
        max_norm_ratio: ``syncer.max_norm_ratio``.
        bound: the largest ‖δ‖ accepted while the outlier check is off, or None (no bound).

    Returns:
        A :class:`Decision`.
    """
    missing = sorted(set(expected_shapes) - set(shapes))
    extra = sorted(set(shapes) - set(expected_shapes))
    wrong = {
        k: (tuple(shapes[k]), tuple(expected_shapes[k]))
        for k in sorted(set(shapes) & set(expected_shapes))
        if tuple(shapes[k]) != tuple(expected_shapes[k])
    }
    if missing or extra or wrong:
        parts = []
        if missing:
            parts.append(f"missing {missing}")
        if extra:
            parts.append(f"extra {extra}")
        parts += [f"{k} has {got}, expected {want}" for k, (got, want) in wrong.items()]
        return _reject("shape mismatch: " + "; ".join(parts))
    if sq_norm is None:
        return ACCEPTED
    if not math.isfinite(sq_norm):
        return _reject(f"non-finite: sq_norm {sq_norm}")
    norm = math.sqrt(max(sq_norm, 0.0))
    if norm == 0.0:
        return _reject("degenerate: ‖δ‖ = 0 (the pushed steps moved nothing)")
    if norms is not None and norms.ready():
        median = norms.median()
        if median > 0 and norm > max_norm_ratio * median:
            return _reject(
                f"norm outlier: norm {norm:.6g} > max_norm_ratio {max_norm_ratio} "
                f"× median {median:.6g} = {max_norm_ratio * median:.6g}"
            )
    if norms is not None and norms.warming_up() and bound is not None and norm > bound:
        return _reject(f"norm over the warm-up bound: norm {norm:.6g} > {bound:.6g} ({len(norms)} norms recorded)")
    return ACCEPTED
