"""`Result`: what a run came to, read from its run directory (the shape of Ray Train's ``Result``).

`actors.supervisor.RunHandle.wait` returns one when the run ends; ``Result.from_path(run_dir)``
reads one back from a run directory in any process, while the run goes on or long after:

  metrics     once the run ended, its final metrics: ``summary.json`` (`dloco.tally.summarize`:
              eval loss, tokens, goodput, merges, errors, the config, ...); while it runs, the
              driver's newest ``status.json`` (`RunHandle.status()` with ``updated``, ``pid`` and
              ``host``, rewritten every `dloco.control.EVERY_S` seconds)
  path        the run directory
  checkpoint  the newest checkpoint the run wrote (`dloco.checkpoints.newest`: with `export.every_commits`
              or `export.every_s` the store leaves a `dloco export` directory at
              ``run_dir/checkpoints/commit-N``), None if it has none
  error       why the run failed: the ``error`` of its summary (or, running, of its status), None if
              it did not
  state       ``"ended"``, ``"running"`` or ``"not answering"`` (the driver stopped rewriting its
              status and left no summary: killed, or its machine went away), as `dloco.control.read`
              decides it

It reads files only (no Ray), so it works on a copy of a run directory too.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dloco import checkpoints, control


@dataclasses.dataclass(frozen=True)
class Result:
    """A run's final (or, while it runs, newest) metrics, its directory, newest checkpoint and error."""

    metrics: dict[str, Any]
    path: Path
    checkpoint: Path | None
    error: str | None
    state: str = "ended"

    @classmethod
    def from_path(cls, run_dir: str | os.PathLike, stale_s: float = 30.0, now: float | None = None) -> Result:
        """The run in `run_dir`, finished or running (``summary.json`` if it is newer than
        ``status.json``: a resumed run that is running again is running).

        Args:
          run_dir: a run directory (`actors.launch.start`'s ``run_dir``).
          stale_s: a running run whose status is older than this is ``"not answering"``.
          now: the wall time to judge staleness at (default: now).
        Raises:
          FileNotFoundError: no run there (neither ``summary.json`` nor ``status.json``).
        """
        path = Path(run_dir)
        read = control.read(path, stale_s=stale_s, now=now)
        state = read.pop("state")
        return cls(metrics=read, path=path, checkpoint=checkpoints.newest(path), error=read.get("error"), state=state)

    @classmethod
    def ended(cls, run_dir: str | os.PathLike, summary: Mapping[str, Any]) -> Result:
        """The run in `run_dir` that ended with `summary` (what `RunHandle` writes to ``summary.json``):
        its metrics are what the file holds (a JSON round trip: learner ids as strings, as
        `from_path` reads them), so the two agree."""
        path, metrics = Path(run_dir), json.loads(json.dumps(dict(summary), default=str))
        return cls(metrics=metrics, path=path, checkpoint=checkpoints.newest(path), error=metrics.get("error"))
