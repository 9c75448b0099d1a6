"""The fragment store's files (ALGORITHM.md §8): what a fragment's state and its log look like on disk.

Used by the store (`dloco.store`, which writes them and restores from them) and by whatever reads a
store directory without a store (`dloco.export`). Every file is a `durable.write_arrays` file.

- A **state** (`FragmentState`, `save_state` / `load_fragment`): Θ_p, the outer-state leaves s_p,
  the shadow Θ̂_p (``publish: delta``), the version, the commit id, the token ledger and the
  syncer's norm history. A snapshot holds one per fragment; a log entry may be one.
- A **step** (`LogStep`, `save_step`): a log entry that holds what one commit merged (a
  `dloco.recipe.Recipe`: the contributions as they arrived, their weights, the published q) and the
  same small metadata, but no float32 state. Replayed on the state of the version before it, it
  gives the committed state again, bit for bit, checked against the digest it carries.

``wal/p{p:03d}-v{v:08d}.npz`` is the log entry of fragment p at version v (the ``.npz`` is
historical: runs before `durable.write_arrays` wrote zip files there, which are still read).
`roll_forward` brings a fragment from a base state through its log: to the newest state entry that
verifies, then step by step while the versions follow one another. A step whose state before it is
lost (a damaged or missing entry under it) cannot be replayed: it is set aside as unreachable.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dloco import durable, recipe
from dloco.durable import CorruptFileError

__all__ = [
    "SNAP_NAME",
    "WAL_NAME",
    "FragmentState",
    "LogStep",
    "check_values",
    "load_entry",
    "load_fragment",
    "roll_forward",
    "save_state",
    "save_step",
]

WAL_NAME, SNAP_NAME = re.compile(r"p(\d+)-v(\d+)\.npz"), re.compile(r"snap-(\d+)")
MAX_VALUE = float(np.sqrt(np.finfo(np.float32).max))  # ~1.8e19: its square is the largest float32


@dataclass
class FragmentState:
    """Fragment p's durable state at one version.

    `chain` counts the steps written since this fragment's state was last on disk whole (a snapshot
    or a state entry): 0 there, None while it is not on disk at all (the initial Θ_p⁰ of a fresh
    run), so the store writes a state entry first and never a step with nothing to replay it on.
    """

    version: int
    values: dict[str, np.ndarray]
    outer_state: list[np.ndarray]
    ledger: dict[int, dict] = field(default_factory=dict)  # learner → {tokens, cursor, step, incarnation}
    commit_id: str = ""
    shadow: dict[str, np.ndarray] | None = None  # Θ̂_p (publish: delta), else None: Θ_p itself
    norms: list[float] = field(default_factory=list)  # the syncer's outlier-check history (§5), oldest first
    chain: int | None = None


@dataclass(frozen=True)
class LogStep:
    """A log entry that holds one commit's `recipe.Recipe` instead of the state it produced."""

    version: int
    commit_id: str
    ledger: dict[int, dict]
    norms: list[float]
    recipe: recipe.Recipe

    def apply(self, base: FragmentState) -> FragmentState:
        """The state this step committed, replayed on `base` (the state at `version` − 1).

        Raises:
          recipe.ReplayMismatchError: the replay computes other bits than were committed.
        """
        values, leaves, shadow = recipe.replay(base.values, base.outer_state, base.shadow, self.recipe)
        chain = (base.chain or 0) + 1
        return FragmentState(self.version, values, leaves, self.ledger, self.commit_id, shadow, self.norms, chain)


def _meta(version: int, commit_id: str, ledger: Mapping[int, dict], norms: list[float]) -> dict:
    return {
        "version": version,
        "commit_id": commit_id,
        "ledger": {str(k): v for k, v in ledger.items()},
        "norms": norms,
    }


def save_state(path: Path, f: FragmentState) -> None:
    arrays = {f"v/{k}": v for k, v in f.values.items()}
    arrays.update({f"s/{i}": s for i, s in enumerate(f.outer_state)})
    arrays.update({f"h/{k}": v for k, v in (f.shadow or {}).items()})
    durable.write_arrays(path, arrays, _meta(f.version, f.commit_id, f.ledger, f.norms))


def save_step(path: Path, s: LogStep) -> None:
    arrays, meta = recipe.to_arrays(s.recipe)
    durable.write_arrays(path, arrays, {**_meta(s.version, s.commit_id, s.ledger, s.norms), "replay": meta})


def is_step(path: Path) -> bool:
    """Whether the log entry at `path` looks like a step (from its index alone, unverified)."""
    meta = durable.read_meta(path)
    return meta is not None and "replay" in meta


def load_entry(path: Path) -> FragmentState | LogStep:
    """The state or step in `path`, verified; `CorruptFileError` if it is missing, damaged or unreadable."""
    z, meta = durable.read_arrays(path)
    try:
        ledger = {int(k): v for k, v in meta["ledger"].items()}
        norms = [float(x) for x in meta.get("norms", [])]  # none in files from before it was kept
        version, commit_id = int(meta["version"]), str(meta["commit_id"])
        if "replay" in meta:
            return LogStep(version, commit_id, ledger, norms, recipe.from_arrays(z, meta["replay"]))
        state = [z[f"s/{i}"] for i in range(sum(k.startswith("s/") for k in z))]
        shadow = {k[2:]: x for k, x in z.items() if k.startswith("h/")} or None
        values = {k[2:]: x for k, x in z.items() if k.startswith("v/")}
        return FragmentState(version, values, state, ledger, commit_id, shadow, norms)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CorruptFileError(path, f"bad content: {e!r}") from None


def load_fragment(path: Path) -> FragmentState:
    """The state in `path` (a snapshot's fragment), verified; `CorruptFileError` as `load_entry`, and
    for a step, which is not a state."""
    got = load_entry(path)
    if isinstance(got, LogStep):
        raise CorruptFileError(path, "a log step where a fragment's state belongs")
    return got


def check_values(path: Path, f: FragmentState, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """`CorruptFileError` if `f` read from `path` cannot be a state the syncer committed: tensors
    other than `shapes`, or a value of Θ_p, its outer state or its shadow that is not finite or whose
    square overflows float32 (|x| > ~1.8e19). A file with a valid checksum may still hold such values
    (written by a bug, or by hand); the syncer commits only finite values whose norms it computes
    (`dloco.defence.check_commit`), and a restored 1e30 made every later commit's norm infinite, so
    the fragment could never move again."""
    got = {k: np.shape(v) for k, v in f.values.items()}
    if got != dict(shapes):
        raise CorruptFileError(path, f"implausible values: tensors {got} differ from the model's {dict(shapes)}")
    arrays = [*f.values.items(), *((f"state {i}", x) for i, x in enumerate(f.outer_state))]
    arrays += [(f"shadow {k}", x) for k, x in (f.shadow or {}).items()]
    for name, x in arrays:
        a = np.asarray(x)
        if a.dtype.kind == "f" and a.size and not (np.isfinite(a).all() and np.abs(a).max() <= MAX_VALUE):
            raise CorruptFileError(path, f"implausible values: {name} holds non-finite or > {MAX_VALUE:.2g}")


def roll_forward(
    base: FragmentState | None,
    log: list[tuple[int, Path]],
    set_aside: Callable[[Path, str], None],
    check: Callable[[Path, FragmentState], None],
    load: Callable[[Path], FragmentState | LogStep] = load_entry,
) -> FragmentState | None:
    """Fragment p's newest state that its log (``[(version, path)]`` of p, oldest first) reaches
    from `base` (None: nothing but the log).

    From the newest entry down to `base`'s version: the first state entry that loads, verifies and
    passes `check` is the new base (what is damaged on the way is handed to `set_aside` with the
    reason); steps above it are then replayed in order, each from the version before it. A step
    that cannot be (the entry under it damaged or missing, or its replay not the committed bits)
    is set aside too, with everything above it: the state stays at the last version it can vouch for.
    """
    floor = -1 if base is None else base.version
    steps: list[tuple[int, Path]] = []  # above the base, newest first: replayed once it is found
    for v, path in reversed(log):
        if v <= floor:
            break
        if is_step(path):
            steps.append((v, path))
            continue
        try:
            got = load(path)
            if got.version != v:
                raise CorruptFileError(path, f"holds version {got.version}, not {v}")
            if isinstance(got, LogStep):  # its index said otherwise: a damaged or odd file
                raise CorruptFileError(path, "a step whose index does not say so")
            check(path, got)
        except CorruptFileError as e:
            set_aside(path, e.reason)
            for _, above in steps:
                set_aside(above, f"unreachable: the log entry of version {v} under it is damaged ({e.reason})")
            steps.clear()
            continue
        base = dataclasses.replace(got, chain=0)
        break
    for v, path in reversed(steps):
        if base is None or v != base.version + 1:
            set_aside(path, f"unreachable: no state of version {v - 1} to replay it on")
            continue
        try:
            step = load(path)
            if not isinstance(step, LogStep) or step.version != v:
                raise CorruptFileError(path, f"not the step of version {v}")
            replayed = step.apply(base)
            check(path, replayed)
        except CorruptFileError as e:
            set_aside(path, e.reason)
            continue
        except recipe.ReplayMismatchError as e:
            set_aside(path, str(e))
            continue
        base = replayed
    return base
