"""The sharded syncer and store (`syncer.shards: S`): fragment p belongs to shard p mod S.

Each shard is a store (`StoreService(shard=s)`) and a syncer (`SyncerService(shard=s)`) that hold,
log, snapshot and merge only the fragments they own; their directory is ``run_dir/store`` for
S = 1 and ``run_dir/store/shard-{s}-of-{S}`` otherwise, so a restart of one shard touches only its
fragments and memory and merge work divide by S. Fragments merge independently (ALGORITHM.md §5),
so nothing crosses shards but the learner's identity:

- `ShardedStore` is the `StorePeer` a learner (or the driver) holds: a registration goes to every
  shard with one incarnation (the first shard's new one; a shard that knew a newer one lifts all
  to it), and the learner resumes at the oldest merged cursor over all fragments, as with S = 1;
  reads are assembled by owner;
- `ShardedSyncer` sends each push to its fragment's syncer shard.

The registry is kept by every shard (each checks incarnations itself); the token ledger of a
fragment lives with its fragment.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dloco.config import BLOCKING_ALGORITHMS, RunConfig
from dloco.ledger import cursor_key
from dloco.store import Registration


class ShardLayoutError(ValueError):
    """A run directory whose store was written with another `syncer.shards`."""


def owner(p: int, shards: int) -> int:
    """The shard of fragment p (an index that is not a fragment's goes to shard 0, which refuses it)."""
    return p % shards if isinstance(p, int) and p >= 0 else 0


def owned(count: int, shards: int, s: int) -> list[int]:
    return [p for p in range(count) if p % shards == s]


def names(base: str, shards: int) -> list[str]:
    """Actor names of a role's shards: ``store`` for one, ``store-0`` … ``store-{S-1}`` for several."""
    return [base] if shards == 1 else [f"{base}-{s}" for s in range(shards)]


def store_root(run_dir: str | Path, s: int, shards: int) -> Path:
    root = Path(run_dir) / "store"
    return root if shards == 1 else root / f"shard-{s}-of-{shards}"


_SHARD_DIR = re.compile(r"shard-(\d+)-of-(\d+)")


def layout_problem(run_dir: str | Path, shards: int) -> str | None:
    """One line if ``run_dir/store`` holds a store of another shard count (its fragments would be
    restored by the wrong shards), else None."""
    root = Path(run_dir) / "store"
    if not root.is_dir():
        return None
    found = {int(m.group(2)) for d in root.iterdir() if (m := _SHARD_DIR.fullmatch(d.name)) and d.is_dir()}
    if any((root / n).exists() for n in ("wal", "registry.json")) or any(root.glob("snap-*")):
        found.add(1)
    other = sorted(found - {shards})
    if not other:
        return None
    return f"run dir {run_dir} holds a store written with syncer.shards={other[0]}, not {shards}: resume it with that"


def assemble(shards: int, answers: Sequence[tuple[list[int], list[Any]]]) -> tuple[list[int], list[Any]]:
    """(versions, values) of every fragment from each shard's `fragments()` answer, by owner."""
    count = len(answers[0][0])
    picked = [answers[owner(p, shards)] for p in range(count)]
    return [a[0][p] for p, a in enumerate(picked)], [a[1][p] for p, a in enumerate(picked)]


def summary(shards: int, parts: Sequence[dict]) -> dict:
    """One store summary from the shards' (`StoreService.summary`): versions by owner, commits and
    tokens summed, each shard's own in ``shards``."""
    if shards == 1:
        return dict(parts[0])
    versions = [parts[owner(p, shards)]["versions"][p] for p in range(len(parts[0]["versions"]))]
    tokens: dict[int, list[int]] = {}
    for part in parts:
        for m, per in part["tokens_merged"].items():
            row = tokens.setdefault(m, [0] * len(per))
            tokens[m] = [a + b for a, b in zip(row, per, strict=True)]
    return {
        "versions": versions,
        "commits": sum(int(x["commits"]) for x in parts),
        "registry": parts[0]["registry"],
        "restored_from": [x["restored_from"] for x in parts],
        "tokens_merged": tokens,
        "copies": [x.get("copies") for x in parts],
        "shards": list(parts),
    }


def peers(cfg: RunConfig, stores: Sequence[Any], syncers: Sequence[Any]) -> tuple[Any, Any]:
    """A learner's (store, syncer) peers over the shards' handles: the handles themselves for one shard."""
    if len(stores) == 1:
        return stores[0], syncers[0]
    blocking = cfg.algorithm in BLOCKING_ALGORITHMS and cfg.fragments.count > 1
    return ShardedStore(stores, blocking), ShardedSyncer(syncers)


class ShardedStore:
    """A `StorePeer` over the S store shards (`peers[s]`: any object with the store's calls)."""

    def __init__(self, peers: Sequence[Any], blocking: bool = False) -> None:
        self.peers, self.blocking = list(peers), blocking
        self.shards = len(self.peers)

    def register(self, learner_id: int) -> Registration:
        """A new incarnation on every shard: the first shard's next one, or the newest another shard
        knew (e.g. the first's registry was rebuilt from an older snapshot); the first shard logs it."""
        first = self.peers[0].register(learner_id, None, False)
        regs = [peer.register(learner_id, first.incarnation, False) for peer in self.peers[1:]]
        n = max(r.incarnation for r in [first, *regs])
        if n != first.incarnation:
            regs = [peer.register(learner_id, n, False) for peer in self.peers[1:]]
        regs = [self.peers[0].register(learner_id, n, True), *regs]
        if any(r.cursor is None for r in regs):
            cursor, step = None, 0
        else:
            oldest = min(regs, key=lambda r: cursor_key(r.cursor))  # type: ignore[arg-type,return-value]
            cursor, step = oldest.cursor, oldest.step
        if self.blocking:  # `StoreService.register`: every shard answered its newest round's step
            step = max(r.step for r in regs)
        return Registration(learner_id, n, cursor, step)

    def retire(self, learner_id: int) -> None:
        for peer in self.peers:
            peer.retire(learner_id)

    def registry(self) -> dict[int, int]:
        return self.peers[0].registry()

    def fragments(self, shadow: bool = False, learner_id: int | None = None) -> tuple[list[int], list[dict]]:
        return assemble(self.shards, [peer.fragments(shadow, learner_id) for peer in self.peers])

    def shadow(self, p: int, learner_id: int | None = None) -> tuple[int, dict, int | None]:
        return self.peers[owner(p, self.shards)].shadow(p, learner_id)

    def summary(self) -> dict:
        return summary(self.shards, [peer.summary() for peer in self.peers])

    def syncer_state(self) -> Any:
        raise TypeError("a syncer shard reads its own store shard's state")

    def commit(self, c: Any) -> Any:
        raise TypeError("a syncer shard commits to its own store shard")


class ShardedSyncer:
    """A `SyncerPeer` over the S syncer shards: each push goes to its fragment's shard."""

    def __init__(self, peers: Sequence[Any]) -> None:
        self.peers = list(peers)

    def push(self, meta: Any, ref: Any) -> Any:
        return self.peers[owner(meta.fragment_id, len(self.peers))].push(meta, ref)

    def holds(self, meta: Any) -> bool | None:
        return self.peers[owner(meta.fragment_id, len(self.peers))].holds(meta)

    def decisions(self) -> list[tuple[Any, Any]]:
        return [d for peer in self.peers for d in peer.decisions()]
