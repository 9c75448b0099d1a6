"""Checkpoints a running run leaves behind: exports of a consistent cut, written by the store (`export.*`).

A week-long run should leave usable models behind as it goes, not only what `dloco export` makes of
it at the end. `Checkpointer` lives beside the store (`dloco.services.store`): after each commit it
is asked whether a checkpoint is due (every `export.every_commits` commits or `export.every_s`
seconds); if so it takes the store's fragments as they stand at that commit (a consistent cut:
each fragment at the version it had then; the arrays are never changed in place, so holding them
copies nothing) and writes them on a thread of its own, off the commit path, as a `dloco export`
directory (`export.write_model`: safetensors, or ``hf``) named ``checkpoints/commit-{n:08d}``,
complete or not at all (`durable.write_dir`). A checkpoint due while the previous one is still
being written is skipped (the next commit asks again). The newest `export.keep` are kept.
"""

from __future__ import annotations

import re
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np

from dloco import durable
from dloco.config import RunConfig

__all__ = ["CHECKPOINT_NAME", "Checkpointer", "newest"]

CHECKPOINT_NAME = re.compile(r"commit-(\d+)")
DIR = "checkpoints"


def newest(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of the run in `run_dir`, or None."""
    found = durable.numbered(Path(run_dir) / DIR, CHECKPOINT_NAME) if (Path(run_dir) / DIR).is_dir() else []
    done = [p for _, p in found if p.is_dir()]
    return done[-1] if done else None


class Checkpointer:
    """Decides when a checkpoint is due and writes it on its own thread (module docstring).

    Args:
      cfg: the run config (its `export` section).
      run_dir: the run directory (its ``config.json`` and ``fingerprint.json`` describe the model).
      now: the clock (`every_s` counts on it).
      on_error: called with the text of a checkpoint that failed (the run goes on).
    """

    def __init__(self, cfg: RunConfig, run_dir: str | Path, now: Callable[[], float], on_error: Callable) -> None:
        self.cfg, self.run_dir, self.now, self.on_error = cfg.export, Path(run_dir), now, on_error
        self.last_commits: int | None = None
        self.last_time = now()
        self.written: list[Path] = []
        self._thread: threading.Thread | None = None

    def due(self, commits: int) -> bool:
        """Whether the commit that brought the store to `commits` commits should be checkpointed."""
        c = self.cfg
        if not c.enabled or commits == self.last_commits:
            return False
        if c.every_commits and commits % c.every_commits == 0:
            return True
        return bool(c.every_s) and self.now() - self.last_time >= c.every_s

    def take(self, commits: int, versions: list[int], values: list[dict[str, np.ndarray]]) -> bool:
        """Starts writing the cut (`versions`, `values`: every fragment) as checkpoint `commits`;
        False if the previous one is still being written (then nothing is taken)."""
        if self._thread is not None and self._thread.is_alive():
            return False
        self.last_commits, self.last_time = commits, self.now()
        cut = (list(versions), [dict(v) for v in values])
        self._thread = threading.Thread(target=self._write, args=(commits, *cut), name="checkpoint", daemon=True)
        self._thread.start()
        return True

    def wait(self) -> None:
        """Until the checkpoint being written (if any) is on disk."""
        if self._thread is not None:
            self._thread.join()

    def _write(self, commits: int, versions: list[int], values: list[dict[str, np.ndarray]]) -> None:
        from dloco import export

        out = self.run_dir / DIR / f"commit-{commits:08d}"
        try:
            m = export.assemble(self.run_dir, versions, values, f"checkpoint after {commits} commits")
            meta = {
                "format": self.cfg.format,
                "versions": versions,
                "source": m.source,
                "parameters": int(sum(x.size for v in values for x in v.values())),
                "vocab_size": m.vocab_size,
                "commits": commits,
            }
            durable.mkdir(out.parent)
            durable.write_dir(out, lambda d: export.write_model(d, m, meta, self.cfg.format))
            self.written.append(out)
            self._prune()
        except Exception as e:  # reported as a store error; the run and its commits go on
            self.on_error(f"checkpoint {out.name}: {type(e).__name__}: {e}")

    def _prune(self) -> None:
        found = [p for _, p in durable.numbered(self.run_dir / DIR, CHECKPOINT_NAME) if p.is_dir()]
        for old in found[: -self.cfg.keep]:
            shutil.rmtree(old, ignore_errors=True)
        durable.clean_tmp(self.run_dir / DIR)
