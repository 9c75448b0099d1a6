"""Run events: one dataclass per kind, one JSON form (a line of ``metrics.jsonl``).

Every writer builds its events from these classes (`to_dict` gives the JSON form, with ``event``
naming the kind), so a field cannot be misspelled or missing; every event the driver receives is
checked by `parse`, which rebuilds the dataclass from the JSON form and rejects an unknown kind, a
missing field or an unknown one. Readers (`dloco.tally`, `dloco.metrics`, TensorBoard, plots,
notebooks) read that JSON form. ``time`` is wall seconds (virtual seconds in process); the
driver adds ``t``, seconds since the run's start.

Tokens merged have one definition, `dloco.metrics.merged_progress`: a merged push counts only its
steps not merged into that fragment before, times its tokens per step, divided by P.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class Event:
    EVENT: ClassVar[str] = ""
    time: float | None = None
    t: float | None = None

    def to_dict(self) -> dict[str, Any]:
        d = {"event": self.EVENT}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is not None or f.name not in _OPTIONAL:
                d[f.name] = v
        return d


_OPTIONAL = {"t", "at", "duration", "skipped", "dropped", "sync_s", "push_age_s"}  # left out when None


@dataclass(frozen=True, kw_only=True)
class StoreStart(Event):
    """The store (re)started; `quarantined`: damaged files it set aside ({path, reason, moved_to})."""

    EVENT = "store_start"
    versions: list[int]
    restored_from: str | None
    quarantined: list[dict] = dataclasses.field(default_factory=list)
    # seconds: "process" (the process's start → its constructor), "model" (the initial model),
    # "restore" (the directory read and verified); from the caller's clock
    startup_s: dict[str, float] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class SyncerStart(Event):
    """The syncer (re)started; `startup_s` as `StoreStart`'s, with "state" (fetched from the store)."""

    EVENT = "syncer_start"
    versions: list[int]
    startup_s: dict[str, float] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class LearnerStart(Event):
    """A learner registered: its first incarnation (``learner_start``) or a later one."""

    EVENT = "learner_start"
    learner: int
    incarnation: int
    cursor: dict | None
    step: int


@dataclass(frozen=True, kw_only=True)
class LearnerRestart(LearnerStart):
    EVENT = "learner_restart"


@dataclass(frozen=True, kw_only=True)
class LearnerStop(Event):
    EVENT = "learner_stop"
    learner: int


@dataclass(frozen=True, kw_only=True)
class SpareStart(Event):
    """A spare learner process was started (`learners.spares`): provisioned from now on."""

    EVENT = "spare_start"
    spare: int


@dataclass(frozen=True, kw_only=True)
class SpareTakeover(Event):
    """Spare `spare` took the identity of `learner`, whose process died; `cold`: no spare was
    warm, so a new process took it (as Ray's restart would)."""

    EVENT = "spare_takeover"
    spare: int
    learner: int
    cold: bool = False


@dataclass(frozen=True, kw_only=True)
class LearnerDrain(Event):
    """A learner told to stop (SIGTERM: a preemption notice) pushed its unmerged progress at `step`
    (`pushed` fragments) and left after `seconds`; `merged`: every push was merged by then."""

    EVENT = "learner_drain"
    learner: int
    incarnation: int
    step: int
    pushed: int
    merged: bool
    seconds: float


@dataclass(frozen=True, kw_only=True)
class Rejection(Event):
    """A contribution the global model never absorbs, with the reason (ALGORITHM.md §5)."""

    EVENT = "rejection"
    fragment: int
    learner: int
    incarnation: int
    step: int
    base_version: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class Merge(Event):
    """A committed round of one fragment: per contributor (same order) its incarnation, step,
    tokens and inner steps c_tok / c_steps, normalized weight, staleness and cycle seconds."""

    EVENT = "merge"
    fragment: int
    version: int
    contributors: list[int]
    incarnations: list[int]
    steps: list[int]
    tokens: list[int]
    inner_steps: list[int]
    weights: list[float]
    share: float
    staleness: list[int]
    cycle_s: list[float]
    grace_s: float
    grace_window_s: float
    slack_s: float
    bytes_in: int
    bytes_out: int
    rejected: int
    dropped: list[int] | None = None  # elastic_dp: learners this round reconfigured without
    sync_s: float | None = None  # take → acknowledged commit (Ray)
    push_age_s: list[float] | None = None  # sent → merged, per contributor (Ray)


@dataclass(frozen=True, kw_only=True)
class RoundEmpty(Event):
    EVENT = "round_empty"
    fragment: int
    version: int


@dataclass(frozen=True, kw_only=True)
class CommitRejected(Event):
    EVENT = "commit_rejected"
    fragment: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class SyncerError(Event):
    EVENT = "syncer_error"
    error: str
    trace: str


@dataclass(frozen=True, kw_only=True)
class StoreError(Event):
    """The store failed at something that does not lose a commit (e.g. a snapshot after its log write)."""

    EVENT = "store_error"
    error: str


@dataclass(frozen=True, kw_only=True)
class ActorError(Event):
    """The driver saw an actor fail for good (``learner-<m>``, ``store``, ``syncer``): Ray will not restart it."""

    EVENT = "actor_error"
    target: str
    error: str


@dataclass(frozen=True, kw_only=True)
class RunFailed(Event):
    """The run ends on an error it cannot recover from (the summary's ``error``)."""

    EVENT = "run_failed"
    error: str


@dataclass(frozen=True, kw_only=True)
class PayloadLost(Event):
    EVENT = "payload_lost"
    learner: int
    fragment: int
    step: int
    bytes: int


@dataclass(frozen=True, kw_only=True)
class PayloadResent(Event):
    EVENT = "payload_resent"
    learner: int
    fragment: int
    step: int


@dataclass(frozen=True, kw_only=True)
class Fault(Event):
    """A fault carried out (or `skipped`, with why) on ``learner-<m>``, ``syncer`` or ``store``."""

    EVENT = "fault"
    target: str
    kind: str  # kill | freeze
    source: str  # schedule | manual
    at: float | None = None  # the schedule's time for it
    duration: float | None = None  # freeze
    skipped: str | None = None


@dataclass(frozen=True, kw_only=True)
class Eval(Event):
    EVENT = "eval"
    loss: float
    tokens: int


@dataclass(frozen=True, kw_only=True)
class Goodput(Event):
    EVENT = "goodput"
    goodput: float
    uptime: float


@dataclass(frozen=True, kw_only=True)
class Chaos(Event):
    EVENT = "chaos"
    seed: int
    faults: int
    stragglers: list[int]


KINDS: dict[str, type[Event]] = {
    c.EVENT: c
    for c in (
        StoreStart,
        SyncerStart,
        LearnerStart,
        LearnerRestart,
        LearnerStop,
        LearnerDrain,
        SpareStart,
        SpareTakeover,
        Rejection,
        Merge,
        RoundEmpty,
        CommitRejected,
        SyncerError,
        StoreError,
        ActorError,
        RunFailed,
        PayloadLost,
        PayloadResent,
        Fault,
        Eval,
        Goodput,
        Chaos,
    )
}


def parse(d: Mapping[str, Any]) -> Event:
    """The event of a JSON form; ValueError naming the kind and field if it does not match."""
    kind = d.get("event")
    cls = KINDS.get(str(kind))
    if cls is None:
        raise ValueError(f"unknown event kind {kind!r}")
    names = {f.name for f in dataclasses.fields(cls)}
    extra = set(d) - names - {"event"}
    if extra:
        raise ValueError(f"{kind} event: unknown field(s) {sorted(extra)}")
    try:
        return cls(**{k: v for k, v in d.items() if k != "event"})
    except TypeError as e:
        raise ValueError(f"{kind} event: {e}") from None
