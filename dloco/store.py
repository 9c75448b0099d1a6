"""The fragment store's state and durability (ALGORITHM.md §1, §8), without any transport.

`StoreCore` holds the authoritative global fragments Θ_p with their versions v_p, the outer
optimizer state s_p of each fragment, the learner registry (id → incarnation) and the token
ledger (`dloco.ledger`: per fragment and learner, tokens merged and the last merged push).

On disk under `root` (``run_dir/store``), every file checksummed, atomic and durable (`dloco.durable`),
in the formats of `dloco.commitlog`: ``wal/p{p:03d}-v{v:08d}.npz`` per commit, written before the
commit is acknowledged (if that fails, e.g. disk full or read-only, the commit raises OSError,
unapplied): a *step* (what the commit merged, its `Commit.recipe`: int4 contributions are an eighth
to a third of the state's bytes) when the fragment's state before it is on disk and fewer than
`store.snapshot_every` steps were written since, else the fragment's full new *state* (Θ_p, s_p,
the shadow Θ̂_p); both carry version, commit_id, ledger and the syncer's norm history;
``snap-{n:08d}/`` every `store.snapshot_every` commits, all fragments' states and ``meta.json``
(commits, versions, registry), written in ``tmp-*`` and renamed, the last `store.keep` kept and
older log files pruned (a failed snapshot goes to `errors`, its commit stands, and is tried again
when next due); ``registry.json``; ``LOCK``, flocked until `close` (a second store raises
`RunDirLocked`); and ``quarantine/``: damaged files and snapshots moved aside (never deleted),
listed in `quarantined`. With a `mirror` (`dloco.mirror`), each write is copied to a `pyarrow.fs`
URI before it returns, and a start with an empty `root` first pulls the URI's copy (the head node
and its disk lost).

Versions are the integers in the names (``:08d`` is a minimum width). A start restores the newest
snapshot that verifies completely, else an older one, then per fragment rolls forward through its
log (`commitlog.roll_forward`): to the newest state entry that verifies, then replaying the steps
above it, each checked against the digest of the state it committed: committed data intact
anywhere is kept (a step whose predecessor is lost cannot be replayed, and is set aside). A
damaged ``registry.json`` is rebuilt from the snapshot's and the ledgers' incarnations.

A commit is compare-and-set on v_p: it applies only to the version it was computed from. A retry
of the commit that produced the current version (same `commit_id`) is acknowledged again, so a
commit can be retried safely after a store restart.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dloco import durable, recipe
from dloco.commitlog import (
    SNAP_NAME,
    WAL_NAME,
    FragmentState,
    LogStep,
    check_values,
    load_fragment,
    roll_forward,
    save_state,
    save_step,
)
from dloco.durable import CorruptFileError, RunDirLocked
from dloco.ledger import MergedPush, merged_cursor, record, tokens_merged
from dloco.mirror import Mirror

__all__ = ["Commit", "CommitResult", "CorruptFileError", "MergedPush", "Registration", "RunDirLocked", "StoreCore"]


@dataclass(frozen=True)
class Commit:
    """The syncer's result for one fragment round: Θ_p and s_p at `base_version + 1`.

    With `compression.publish: delta` (ALGORITHM.md §7), `shadow` is the new shadow Θ̂_p (what an
    up-to-date learner holds) and `delta` the quantized Θ_p − Θ̂_p (old shadow) that learners
    add to their copy; both None when Θ_p itself is published.
    """

    fragment_id: int
    base_version: int
    values: dict[str, np.ndarray]
    outer_state: list[np.ndarray]
    merged: tuple[MergedPush, ...]
    commit_id: str
    shadow: dict[str, np.ndarray] | None = None
    delta: dict | None = None  # tensor name → compress.Payload
    norms: tuple[float, ...] | None = None  # the syncer's per-step norm history of p (§5); None: unchanged
    recipe: recipe.Recipe | None = None  # what it merged: the store may log that instead (`dloco.commitlog`)

    @property
    def version(self) -> int:
        return self.base_version + 1


@dataclass(frozen=True)
class CommitResult:
    accepted: bool
    version: int
    reason: str


@dataclass(frozen=True)
class Registration:
    """What a (re)starting learner gets: its incarnation and where to resume (§4, §8)."""

    learner_id: int
    incarnation: int
    cursor: dict | None  # merged cursor: data position of its last push merged into every fragment
    step: int  # local step of that push (drives the inner lr schedule)


class StateLostError(RuntimeError):
    """Every snapshot and log file of a store that had commits is damaged (`StoreCore._restore`)."""


def _registry(state: dict) -> tuple[dict[int, int], set[int]]:
    """(registry, retired) of a ``registry.json`` or snapshot meta."""
    return {int(k): int(v) for k, v in state["registry"].items()}, {int(m) for m in state["retired"]}


class StoreCore:
    """Authoritative global state of a run, durable under `root` (see module docstring).

    Args:
      root: directory for the log and snapshots (created if missing).
      initial: Θ_p⁰ per fragment (used when `root` holds nothing to restore).
      initial_outer: s_p⁰ per fragment, as numpy leaves.
      snapshot_every: consolidate into a snapshot every this many commits.
      keep: snapshots kept.
      lock_wait_s: wait this long for the directory's lock (a predecessor may be exiting), then `RunDirLocked`.
      mirror: the URI copy of `root`, opened here (`dloco.mirror.StaleStoreDir` if `root` is older).
      owned: the fragments this store holds (a shard's, `dloco.services.shards`); the others stay
        empty at version 0. None: all.
      fresh_if_lost: when every snapshot and log file is damaged, start from `initial` (True) or
        raise `StateLostError` (False: `store.fresh_if_lost`).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        initial: list[dict[str, np.ndarray]],
        initial_outer: list[list[np.ndarray]],
        snapshot_every: int = 8,
        keep: int = 3,
        lock_wait_s: float = 10.0,
        mirror: Mirror | None = None,
        owned: list[int] | None = None,
        fresh_if_lost: bool = False,
    ) -> None:
        self.root, self.mirror, self.fresh_if_lost = Path(root), mirror, fresh_if_lost
        self.owned = list(range(len(initial))) if owned is None else list(owned)
        durable.mkdir(self.root)
        self._lock = durable.RunDirLock(self.root)
        self._lock.acquire(lock_wait_s)
        self.snapshot_every, self.keep = snapshot_every, keep
        self.commits = 0
        self.registry: dict[int, int] = {}
        self.retired: set[int] = set()
        self.restored_from: str | None = None
        self.quarantined: list[dict] = []  # {path, reason, moved_to} of each damaged file set aside
        self.errors: list[dict] = []  # failures that did not fail a commit (snapshots), the last 100
        self.error_count = 0  # all of them, ever
        self.fragments = [
            FragmentState(0, {k: np.array(v, np.float32) for k, v in f.items()}, [np.array(s) for s in o])
            for f, o in zip(initial, initial_outer, strict=True)
        ]
        try:
            if mirror is not None:
                mirror.open(self.root, {"shapes": [{k: list(np.shape(v)) for k, v in f.items()} for f in initial]})
            durable.mkdir(self.root / "wal")
            self._restore()
            if mirror is not None and mirror.pulled:
                self.restored_from = f"{self.restored_from} (pulled from {mirror.uri})"
            self._mirrored()  # what the restore set aside or rebuilt
        except BaseException:
            self._lock.release()
            raise

    def close(self) -> None:
        """Releases the directory's lock and the mirror's lease (idempotent); writes are refused afterwards."""
        if self._lock.held and self.mirror is not None:
            with contextlib.suppress(Exception):  # unreachable: its lease runs out by itself
                self.mirror.close()
        self._lock.release()

    def _check_open(self) -> None:
        if not self._lock.held:
            raise RuntimeError(f"store {self.root} is closed")

    # ---- reads -------------------------------------------------------------------------------
    @property
    def versions(self) -> list[int]:
        return [f.version for f in self.fragments]

    def fragment(self, p: int) -> tuple[int, dict[str, np.ndarray]]:
        """(v_p, Θ_p): the global fragment (what is evaluated and what the outer step updates)."""
        f = self.fragments[p]
        return f.version, f.values

    def shadow(self, p: int) -> tuple[int, dict[str, np.ndarray]]:
        """(v_p, Θ̂_p): what an up-to-date learner holds (Θ_p itself unless publish is delta)."""
        f = self.fragments[p]
        return f.version, f.values if f.shadow is None else f.shadow

    def outer_state(self, p: int) -> list[np.ndarray]:
        return self.fragments[p].outer_state

    def last_merged(self, p: int) -> dict[int, dict]:
        """Ledger of fragment p: learner → {tokens, cursor, step, incarnation} of its last merge."""
        return self.fragments[p].ledger

    def tokens_merged(self) -> dict[int, list[int]]:
        """learner → tokens merged into each fragment (the token ledger, each step counted once)."""
        return tokens_merged([f.ledger for f in self.fragments])

    def merged_cursor(self, learner_id: int) -> tuple[dict | None, int]:
        """Where the learner resumes: `dloco.ledger.merged_cursor` over the fragments' ledgers."""
        return merged_cursor([self.fragments[p].ledger for p in self.owned], learner_id)

    # ---- writes ------------------------------------------------------------------------------
    def register(self, learner_id: int, incarnation: int | None = None) -> Registration:
        """A learner (re)starts: new incarnation (or `incarnation`, another shard's, unless this
        store knows a newer one), resume point from the ledger (§4)."""
        known = self.registry.get(learner_id, 0)
        registry = {**self.registry, learner_id: known + 1 if incarnation is None else max(known, incarnation)}
        self._save_registry(registry, self.retired - {learner_id})  # durable before it changes
        self.registry, self.retired = registry, self.retired - {learner_id}
        cursor, step = self.merged_cursor(learner_id)
        return Registration(learner_id, self.registry[learner_id], cursor, step)

    def retire(self, learner_id: int) -> None:
        """A learner leaves the run for good: its later contributions are rejected as unknown."""
        self._save_registry(self.registry, self.retired | {learner_id})
        self.retired = self.retired | {learner_id}

    def live_registry(self) -> dict[int, int]:
        return {m: i for m, i in self.registry.items() if m not in self.retired}

    def commit(self, c: Commit) -> CommitResult:
        """Applies `c` atomically if it was computed from the current version (compare-and-set).

        OSError (disk full, read-only) if its log file cannot be written: then nothing changed.
        """
        self._check_open()
        f = self.fragments[c.fragment_id]
        if f.version == c.version and f.commit_id == c.commit_id:
            return CommitResult(True, f.version, "already committed (retry)")
        if f.version != c.base_version:
            return CommitResult(
                False, f.version, f"version conflict: commit from {c.base_version}, store at {f.version}"
            )
        ledger = record(f.ledger, c.merged)
        shadow, norms = None if c.shadow is None else dict(c.shadow), f.norms if c.norms is None else list(c.norms)
        new = FragmentState(c.version, dict(c.values), list(c.outer_state), ledger, c.commit_id, shadow, norms)
        path = self.root / "wal" / f"p{c.fragment_id:03d}-v{c.version:08d}.npz"
        if c.recipe is not None and self._as_step(f, new, c.recipe):  # durable first
            sealed = dataclasses.replace(c.recipe, digest=recipe.digest(new.values, new.outer_state, new.shadow))
            save_step(path, LogStep(new.version, new.commit_id, new.ledger, new.norms, sealed))
            new.chain = (f.chain or 0) + 1
        else:
            save_state(path, new)
            new.chain = 0
        self.fragments[c.fragment_id] = new
        self.commits += 1
        if self.commits % self.snapshot_every == 0:
            try:  # the commit is durable already: a failed snapshot is recorded, not a failed commit
                self.snapshot()
            except Exception as e:
                self._error("snapshot", e)
        self._mirrored()
        return CommitResult(True, new.version, "committed")

    def _as_step(self, before: FragmentState, after: FragmentState, r: recipe.Recipe) -> bool:
        """Whether the commit from `before` to `after` is logged as a step (its recipe) rather than
        the state: when the state before it is on disk (a snapshot, a state entry or steps from
        one), fewer than `snapshot_every` steps were written since, and the recipe is at most half
        the state's bytes (int4 contributions of a few learners: an eighth to a third)."""
        if before.chain is None or before.chain + 1 >= self.snapshot_every:
            return False
        state = [*after.values.values(), *after.outer_state, *(after.shadow or {}).values()]
        return r.nbytes <= sum(np.asarray(x).nbytes for x in state) // 2

    def snapshot(self) -> Path:
        """Writes all fragments and the registry into a new complete ``snap-*`` directory."""
        self._check_open()
        meta = {"commits": self.commits, "versions": self.versions, **self._registry_state(self.registry, self.retired)}

        frs = list(self.fragments)

        def fill(d: Path) -> None:
            for p, f in enumerate(frs):
                save_state(d / f"p{p:03d}.npz", f)
            durable.write_json(d / "meta.json", meta)

        final = self.root / f"snap-{self.commits:08d}"
        durable.write_dir(final, fill)  # replaces one of the same count (an explicit earlier call)
        for f in frs:
            f.chain = 0  # on disk whole again: the next commits may be steps from here
        self._prune()
        return final

    # ---- durability helpers ------------------------------------------------------------------
    @staticmethod
    def _registry_state(registry: dict[int, int], retired: set[int]) -> dict:
        return {"registry": {str(k): v for k, v in registry.items()}, "retired": sorted(retired)}

    def _save_registry(self, registry: dict[int, int], retired: set[int]) -> None:
        self._check_open()
        durable.write_json(self.root / "registry.json", self._registry_state(registry, retired))
        self._mirrored()

    def _mirrored(self) -> None:
        """Copies what changed to the mirror; a failure is recorded (the local write stands)."""
        try:
            if self.mirror is not None:
                self.mirror.sync()
        except Exception as e:
            self._error("mirror", e)

    def _error(self, op: str, e: BaseException) -> None:
        self.errors.append({"op": op, "commits": self.commits, "error": f"{type(e).__name__}: {e}"})
        del self.errors[:-100]
        self.error_count += 1

    def _snapshots(self) -> list[Path]:
        """Snapshot directories, oldest first (by the number in the name, not the name)."""
        return [p for _, p in durable.numbered(self.root, SNAP_NAME) if p.is_dir()]

    def _prune(self) -> None:
        snaps = self._snapshots()
        for old in snaps[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        durable.clean_tmp(self.root, self.root / "wal")
        try:  # log files the oldest kept snapshot holds are no longer needed
            floor = [int(v) for v in durable.read_json(snaps[-self.keep :][0] / "meta.json")["versions"]]
        except (CorruptFileError, KeyError, TypeError, ValueError):
            return  # keep the log: a restore may have to fall back past that snapshot
        for (p, v), path in durable.numbered(self.root / "wal", WAL_NAME):
            if p < len(floor) and v <= floor[p]:
                path.unlink(missing_ok=True)
        durable.fsync_dir(self.root / "wal")

    def _load_snapshot(self, snap: Path) -> tuple[dict, list[FragmentState]]:
        """The snapshot's meta and fragments, all verified; `CorruptFileError` naming the first bad one."""
        meta = durable.read_json(snap / "meta.json")
        frs = [load_fragment(snap / f"p{p:03d}.npz") for p in range(len(self.fragments))]
        for p, f in enumerate(frs):
            self._check_values(snap / f"p{p:03d}.npz", p, f)
            f.chain = 0  # on disk whole: steps may follow
        try:
            _ = int(meta["commits"]), _registry(meta)
            differ = [int(meta["versions"][p]) for p in range(len(frs))] != [f.version for f in frs]
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            raise CorruptFileError(snap / "meta.json", f"bad content: {e!r}") from None
        if differ:
            raise CorruptFileError(snap / "meta.json", f"versions {meta['versions']} differ from its fragments'")
        return meta, frs

    def _check_values(self, path: Path, p: int, f: FragmentState) -> None:
        """`commitlog.check_values` against fragment p's tensors."""
        check_values(path, f, {k: np.shape(v) for k, v in self.fragments[p].values.items()})

    def _restore(self) -> None:
        durable.clean_tmp(self.root, self.root / "wal")
        meta: dict | None = None
        for snap in reversed(self._snapshots()):  # the newest snapshot that verifies completely
            try:
                meta, frs = self._load_snapshot(snap)
            except CorruptFileError as e:
                self.quarantined.append(durable.quarantine(self.root, snap, f"{e.path.name}: {e.reason}"))
                continue
            self.fragments, self.commits, self.restored_from = frs, int(meta["commits"]), snap.name
            break
        log = durable.numbered(self.root / "wal", WAL_NAME)  # oldest first, by (fragment, version)
        for p in range(len(self.fragments)):
            before = self.fragments[p]
            got = roll_forward(
                before,
                [(v, path) for (q, v), path in log if q == p],
                set_aside=lambda path, reason: self.quarantined.append(durable.quarantine(self.root, path, reason)),
                check=lambda path, f, p=p: self._check_values(path, p, f),  # type: ignore[misc]
            )
            if got is not None and got is not before:
                self.commits += got.version - before.version
                self.fragments[p] = got
                self.restored_from = self.restored_from or "log"
        # what this start set aside, or an earlier one did (the start that refused: a second start
        # would find the store empty and begin again silently)
        lost = [Path(q["path"]).name for q in self.quarantined]
        if not lost and (self.root / "quarantine").is_dir():
            lost = sorted(n for n in os.listdir(self.root / "quarantine") if n.startswith(("snap-", "wal-")))
        if self.restored_from is None and lost and not self.fresh_if_lost:
            raise StateLostError(
                f"store {self.root}: every snapshot and log file is damaged (set aside in quarantine/: "
                f"{', '.join(lost)}); starting again from the initial model would lose every commit: "
                "restore the files, or set store.fresh_if_lost=true to start over"
            )
        self._restore_registry(meta)

    def _restore_registry(self, meta: dict | None) -> None:
        """Reads ``registry.json``; if it is damaged or missing, rebuilds it from the snapshot and ledgers."""
        path = self.root / "registry.json"
        try:
            state = durable.read_json(path)
            self.registry, self.retired = _registry(state)
            return
        except (CorruptFileError, KeyError, TypeError, ValueError, AttributeError) as e:
            reason = e.reason if isinstance(e, CorruptFileError) else f"bad content: {e!r}"
        self.registry, self.retired = _registry(meta or {"registry": {}, "retired": []})
        for f in self.fragments:  # an incarnation whose push was merged later than the snapshot
            for m, entry in f.ledger.items():
                self.registry[m] = max(self.registry.get(m, 0), int(entry.get("incarnation", 0)))
        if reason == "missing" and not self.registry:
            return  # a fresh run
        self.quarantined.append(durable.quarantine(self.root, path, reason))
        try:
            self._save_registry(self.registry, self.retired)
        except OSError as e:
            self._error("registry", e)

    def summary(self) -> dict:
        d = {"versions": self.versions, "commits": self.commits, "registry": dict(self.registry)}
        d["mirror"] = None if self.mirror is None else self.mirror.summary()
        return {**d, "restored_from": self.restored_from, "tokens_merged": self.tokens_merged()}
