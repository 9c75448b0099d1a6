"""The fragment store's state and durability (ALGORITHM.md §1, §8), without any transport.

`StoreCore` holds the authoritative global fragments Θ_p with their versions v_p, the outer
optimizer state s_p of each fragment, the learner registry (id → incarnation) and the token
ledger (per fragment and learner: tokens merged, cursor and step of the last merged push).

Durability, so that no committed version is ever lost:

- every commit is written before it is acknowledged, as one file holding the fragment's full new
  state (``wal/p{p}-v{v}.npz``: Θ_p, s_p, the fragment's ledger and, with `compression.publish:
  delta`, the shadow Θ̂_p that learners hold), written to a temporary name and renamed;
- every `store.snapshot_every` commits, all fragments and the registry are consolidated into a
  snapshot directory (written as ``tmp-*`` and renamed to ``snap-{n}``, so a ``snap-*`` directory
  is always complete); the last `store.keep` snapshots are kept and older log files are pruned;
- on start, the newest snapshot is restored and each fragment then takes its newest logged
  version, if newer.

A commit is compare-and-set on v_p: it applies only to the version it was computed from. A retry
of the commit that produced the current version (same `commit_id`) is acknowledged again, so a
commit can be retried safely after a store restart.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class MergedPush:
    """One learner's push included in a commit (what the ledger records)."""

    learner_id: int
    incarnation: int
    step: int
    tokens: int
    steps: int
    cursor: dict | None


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


@dataclass
class _Fragment:
    version: int
    values: dict[str, np.ndarray]
    outer_state: list[np.ndarray]
    ledger: dict[int, dict] = field(default_factory=dict)  # learner → {tokens, cursor, step, incarnation}
    commit_id: str = ""
    shadow: dict[str, np.ndarray] | None = None  # Θ̂_p (publish: delta), else None: Θ_p itself


def _cursor_key(c: dict | None) -> tuple[int, int]:
    return (-1, -1) if c is None else (int(c["epoch"]), int(c["index"]))


def _save_fragment(path: Path, f: _Fragment) -> None:
    arrays = {f"v/{k}": v for k, v in f.values.items()}
    arrays.update({f"s/{i}": s for i, s in enumerate(f.outer_state)})
    arrays.update({f"h/{k}": v for k, v in (f.shadow or {}).items()})
    meta = {"version": f.version, "commit_id": f.commit_id, "ledger": {str(k): v for k, v in f.ledger.items()}}
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    buf = io.BytesIO()
    np.savez(buf, **arrays)  # type: ignore[arg-type]  # numpy's stub matches **kwargs against allow_pickle: bool
    _atomic_write(path, buf.getvalue())


def _load_fragment(path: Path) -> _Fragment:
    with np.load(path) as z:
        meta = json.loads(bytes(z["meta"]).decode())
        values = {k[2:]: z[k] for k in z.files if k.startswith("v/")}
        n_state = sum(k.startswith("s/") for k in z.files)
        state = [z[f"s/{i}"] for i in range(n_state)]
        shadow = {k[2:]: z[k] for k in z.files if k.startswith("h/")} or None
    ledger = {int(k): v for k, v in meta["ledger"].items()}
    return _Fragment(meta["version"], values, state, ledger, meta["commit_id"], shadow)


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class StoreCore:
    """Authoritative global state of a run, durable under `root` (see module docstring).

    Args:
      root: directory for the log and snapshots (created if missing).
      initial: Θ_p⁰ per fragment (used when `root` holds nothing to restore).
      initial_outer: s_p⁰ per fragment, as numpy leaves.
      snapshot_every: consolidate into a snapshot every this many commits.
      keep: snapshots kept.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        initial: list[dict[str, np.ndarray]],
        initial_outer: list[list[np.ndarray]],
        snapshot_every: int = 8,
        keep: int = 3,
    ) -> None:
        self.root = Path(root)
        (self.root / "wal").mkdir(parents=True, exist_ok=True)
        self.snapshot_every, self.keep = snapshot_every, keep
        self.commits = 0
        self.registry: dict[int, int] = {}
        self.retired: set[int] = set()
        self.restored_from: str | None = None
        self.fragments = [
            _Fragment(0, {k: np.array(v, np.float32) for k, v in f.items()}, [np.array(s) for s in o])
            for f, o in zip(initial, initial_outer, strict=True)
        ]
        self._restore()

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
        """learner → tokens merged into each fragment (the token ledger)."""
        out: dict[int, list[int]] = {}
        for p, f in enumerate(self.fragments):
            for m, e in f.ledger.items():
                out.setdefault(m, [0] * len(self.fragments))[p] = e["tokens"]
        return out

    def merged_cursor(self, learner_id: int) -> tuple[dict | None, int]:
        """The data position up to which this learner's progress reached every fragment.

        Minimum over fragments of the cursor of its last merged push; None (start of its
        stream) if some fragment never merged a push of it. Also returns that push's step.
        """
        entries = [f.ledger.get(learner_id) for f in self.fragments]
        merged = [e for e in entries if e is not None]
        if len(merged) < len(entries):
            return None, 0
        first = min(merged, key=lambda e: _cursor_key(e["cursor"]))
        return first["cursor"], int(first["step"])

    # ---- writes ------------------------------------------------------------------------------
    def register(self, learner_id: int) -> Registration:
        """A learner (re)starts: new incarnation, resume point from the ledger (§4)."""
        self.retired.discard(learner_id)
        self.registry[learner_id] = self.registry.get(learner_id, 0) + 1
        self._save_registry()
        cursor, step = self.merged_cursor(learner_id)
        return Registration(learner_id, self.registry[learner_id], cursor, step)

    def retire(self, learner_id: int) -> None:
        """A learner leaves the run for good: its later contributions are rejected as unknown."""
        self.retired.add(learner_id)
        self._save_registry()

    def live_registry(self) -> dict[int, int]:
        return {m: i for m, i in self.registry.items() if m not in self.retired}

    def commit(self, c: Commit) -> CommitResult:
        """Applies `c` atomically if it was computed from the current version (compare-and-set)."""
        f = self.fragments[c.fragment_id]
        if f.version == c.version and f.commit_id == c.commit_id:
            return CommitResult(True, f.version, "already committed (retry)")
        if f.version != c.base_version:
            return CommitResult(
                False, f.version, f"version conflict: commit from {c.base_version}, store at {f.version}"
            )
        ledger = {m: dict(e) for m, e in f.ledger.items()}
        for mp in c.merged:
            prev = ledger.get(mp.learner_id, {"tokens": 0})
            ledger[mp.learner_id] = {
                "tokens": prev["tokens"] + mp.tokens,
                "cursor": mp.cursor,
                "step": mp.step,
                "incarnation": mp.incarnation,
            }
        shadow = None if c.shadow is None else dict(c.shadow)
        new = _Fragment(c.version, dict(c.values), list(c.outer_state), ledger, c.commit_id, shadow)
        _save_fragment(self.root / "wal" / f"p{c.fragment_id:03d}-v{c.version:08d}.npz", new)  # durable first
        self.fragments[c.fragment_id] = new
        self.commits += 1
        if self.commits % self.snapshot_every == 0:
            self.snapshot()
        return CommitResult(True, new.version, "committed")

    def snapshot(self) -> Path:
        """Writes all fragments and the registry into a new complete ``snap-*`` directory."""
        tmp = Path(tempfile.mkdtemp(dir=self.root, prefix="tmp-"))
        for p, f in enumerate(self.fragments):
            _save_fragment(tmp / f"p{p:03d}.npz", f)
        meta = {"commits": self.commits, "versions": self.versions, **self._registry_state()}
        (tmp / "meta.json").write_text(json.dumps(meta))
        final = self.root / f"snap-{self.commits:08d}"
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        self._prune()
        return final

    # ---- durability helpers ------------------------------------------------------------------
    def _registry_state(self) -> dict:
        return {"registry": {str(k): v for k, v in self.registry.items()}, "retired": sorted(self.retired)}

    def _save_registry(self) -> None:
        _atomic_write(self.root / "registry.json", json.dumps(self._registry_state()).encode())

    def _snapshots(self) -> list[Path]:
        return sorted(self.root.glob("snap-*"))

    def _prune(self) -> None:
        snaps = self._snapshots()
        for old in snaps[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        oldest_kept = json.loads((self._snapshots()[0] / "meta.json").read_text())["versions"]
        for path in (self.root / "wal").glob("p*-v*.npz"):
            p, v = int(path.name[1:4]), int(path.name[6:14])
            if v <= oldest_kept[p]:
                path.unlink(missing_ok=True)
        for tmp in self.root.glob("tmp-*"):
            shutil.rmtree(tmp, ignore_errors=True)

    def _restore(self) -> None:
        snaps = self._snapshots()
        if snaps:
            meta = json.loads((snaps[-1] / "meta.json").read_text())
            self.fragments = [_load_fragment(snaps[-1] / f"p{p:03d}.npz") for p in range(len(self.fragments))]
            self.commits = meta["commits"]
            self.restored_from = snaps[-1].name
        for p in range(len(self.fragments)):
            logged = sorted((self.root / "wal").glob(f"p{p:03d}-v*.npz"))
            if logged:
                newest = _load_fragment(logged[-1])
                if newest.version > self.fragments[p].version:
                    self.commits += newest.version - self.fragments[p].version
                    self.fragments[p] = newest
                    self.restored_from = self.restored_from or "log"
        reg = self.root / "registry.json"
        if reg.exists():
            state = json.loads(reg.read_text())
            self.registry = {int(k): v for k, v in state["registry"].items()}
            self.retired = set(state["retired"])

    def summary(self) -> dict:
        return {
            "versions": self.versions,
            "commits": self.commits,
            "registry": dict(self.registry),
            "restored_from": self.restored_from,
            "tokens_merged": self.tokens_merged(),
        }
