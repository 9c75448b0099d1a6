"""What travels between services, and what a service needs from its transport (no Ray here).

A `Transport` puts a payload somewhere its reader can get it (Ray's object store, or nowhere at all
in process) and raises `PayloadLostError` when it cannot be read any more (its owner died). A `Clock`
gives monotonic seconds for protocol timing and wall seconds for event stamps. Peer handles are
duck-typed: `StorePeer` and `SyncerPeer` list the calls a service makes on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


class PayloadLostError(RuntimeError):
    """A payload can no longer be fetched (e.g. its owner process died with it)."""


class Transport(Protocol):
    def put(self, obj: Any) -> Any: ...

    def get(self, ref: Any) -> Any: ...


class Clock(Protocol):
    def now(self) -> float: ...  # monotonic seconds: rounds, grace windows, ages

    def wall(self) -> float: ...  # seconds since the epoch: event stamps


@dataclass(frozen=True)
class Update:
    """Store → learner: fragment p at `version`, due to this learner (`dloco.publish.due`).

    `ref` holds Θ̂_p (kind "full") or a quantized difference (kind "delta") that only a learner
    holding `base_version` can apply; `included_step` is the step of the receiver's last push
    merged into fragment p (by this or an earlier version), None if none.
    """

    fragment_id: int
    version: int
    ref: Any
    included_step: int | None
    kind: str = "full"
    base_version: int = 0


class StorePeer(Protocol):
    def register(self, learner_id: int) -> Any: ...

    def fragments(self, shadow: bool = False, learner_id: int | None = None) -> tuple[list[int], list[dict]]: ...

    def shadow(self, p: int, learner_id: int | None = None) -> tuple[int, dict, int | None]: ...

    def registry(self) -> dict[int, int]: ...

    def syncer_state(self) -> Any: ...

    def commit(self, c: Any) -> Any: ...


class SyncerPeer(Protocol):
    def push(self, meta: Any, ref: Any) -> Any: ...  # the Decision, or None when it comes later

    # whether the syncer has that push (pending, being merged or merged); None: not known yet (asked)
    def holds(self, meta: Any) -> bool | None: ...

    def decisions(self) -> list[tuple[Any, Any]]: ...  # (meta, Decision) of pushes decided since the last call
