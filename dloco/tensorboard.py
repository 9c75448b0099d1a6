"""TensorBoard event files for a run: `TensorBoardSink(run_dir).write(event)` for each run event.

The sink turns the event dicts a run writes to ``metrics.jsonl`` into TensorBoard scalars, written
with tensorboardX into `run_dir` itself, next to ``metrics.jsonl``, so that
``tensorboard --logdir runs/`` shows one run per run directory. Every scalar carries the event's
``time`` as its wall time, so TensorBoard's "relative" x-axis is seconds of run time.

Tags (x-axis of each in brackets; "s" is whole seconds since the run's start, the event's ``t``):

    eval/loss                          eval loss                              [tokens trained]
    eval/loss_by_wall_s                eval loss                              [s]
    goodput/token_proxy                tokens merged / tokens trained         [tokens trained]
    merge/fragment_{p}/quorum          contributions merged, |contributors|   [version v_p]
    merge/fragment_{p}/grace_s         grace used by the round (ξ_grace)      [version v_p]
    merge/fragment_{p}/grace_window_s  grace window at the close              [version v_p]
    merge/fragment_{p}/slack_s         free slack τ·ξ_step − ξ_quorum − ξ_sync [version v_p]
    merge/fragment_{p}/staleness_mean  mean of v_p − base over contributions  [version v_p]
    merge/fragment_{p}/bytes_in        payload bytes merged (learners → syncer)    [version v_p]
    merge/fragment_{p}/bytes_out       bytes of the merged fragment (one copy)     [version v_p]
    merge/tokens_merged                tokens merged (dloco.metrics.merged_progress) [s]
    wire/bytes_in_total                cumulative bytes_in of all merges      [s]
    wire/bytes_out_total               cumulative bytes_out of all merges     [s]
    rejections/total                   rejected contributions so far          [s]
    learners/starts, learners/restarts learner registrations so far           [s]
    faults/total                       kills, freezes and lost payloads so far [s]
    goodput/{key}                      numeric fields of a ``goodput`` event  [s]

"Tokens merged" has the one definition of `dloco.metrics.merged_progress` (kept event by event
by a `dloco.tally.Tally`): a merged push counts only its steps not merged into that fragment
before, times its tokens per step, and a token counts once its progress reached every fragment,
hence the division by P (`fragments`, read from ``config.json`` in `run_dir` unless given).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dloco.tally import Tally

_FAULTS = ("kill", "fault", "freeze", "payload_lost")


def _fragments_from_config(run_dir: Path) -> int | None:
    try:
        return int(json.loads((run_dir / "config.json").read_text())["fragments"]["count"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


class TensorBoardSink:
    """Writes a run's events as TensorBoard scalars (tags in the module docstring).

    Args:
      run_dir: the run directory; the event file (``events.out.tfevents.*``) is created in it.
      fragments: P, for tokens merged; default ``fragments.count`` of ``run_dir/config.json``,
        else the number of distinct fragments seen so far.
      flush_secs: how often the writer flushes to disk.
      also: objects with ``scalar(tag, value, step, walltime)`` and ``close()`` that get every
        scalar as well; closed with this sink.
      config: a run's config (`RunConfig.to_dict()`): the trackers its ``metrics.wandb`` and
        ``metrics.mlflow`` turn on are added to `also` (`dloco.sinks.open_sinks`).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        fragments: int | None = None,
        flush_secs: float = 10.0,
        also: Sequence = (),
        config: Mapping[str, Any] | None = None,
    ) -> None:
        from tensorboardX import SummaryWriter  # lazy: importing dloco stays cheap

        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.fragments = fragments or _fragments_from_config(self.run_dir)
        self._writer = SummaryWriter(logdir=str(self.run_dir), flush_secs=flush_secs)
        self._t0: float | None = None
        self._seen_fragments: set[int] = set()
        # tokens merged (`dloco.tally.push_progress`); P unknown: counted per fragment seen
        self._tally = Tally(self.fragments or 1, math.inf, 0.0, ring=1)
        self._bytes_in = 0
        self._bytes_out = 0
        self._counts: dict[str, int] = {}
        self._written = 0  # scalars written so far
        self._closed = False
        self.also = list(also)  # trackers that get every scalar too (`dloco.sinks`: W&B, MLflow)
        if config is not None:
            from dloco.sinks import open_sinks

            self.also += open_sinks(self.run_dir, config)

    # ---- writing -----------------------------------------------------------------------------
    def _scalar(self, tag: str, value: float, step: int, walltime: float | None) -> None:
        self._writer.add_scalar(tag, float(value), global_step=int(step), walltime=walltime)
        for sink in self.also:
            sink.scalar(tag, float(value), int(step), walltime)
        self._written += 1

    def _count(self, tag: str, step: int, walltime: float | None) -> None:
        self._counts[tag] = self._counts.get(tag, 0) + 1
        self._scalar(tag, self._counts[tag], step, walltime)

    def _clock(self, e: Mapping[str, Any]) -> tuple[float, float | None]:
        """(seconds since the run's start, wall time) of an event; ``t`` is used when present."""
        wall = float(e["time"]) if "time" in e else None
        if "t" in e:
            return float(e["t"]), wall
        if wall is None:
            return 0.0, None
        if self._t0 is None:
            self._t0 = wall
        return wall - self._t0, wall

    def tokens_merged(self) -> float:
        """Tokens merged so far, as `dloco.metrics.merged_progress` defines them (`dloco.tally`)."""
        return self._tally.merged_tokens() / (1 if self.fragments else max(1, len(self._seen_fragments)))

    def write(self, event: Mapping[str, Any]) -> int:
        """Writes the scalars of one event; returns how many (0 for kinds without scalars)."""
        if self._closed:
            raise ValueError("TensorBoardSink is closed")
        kind = event.get("event")
        t, wall = self._clock(event)
        s = round(t)
        before = self._written
        if kind == "eval" and event.get("loss") is not None:
            tokens = int(event.get("tokens", 0))
            self._scalar("eval/loss", event["loss"], tokens, wall)
            self._scalar("eval/loss_by_wall_s", event["loss"], s, wall)
            if tokens > 0:
                self._scalar("goodput/token_proxy", self.tokens_merged() / tokens, tokens, wall)
        elif kind == "merge":
            self._merge(event, s, wall)
        elif kind == "rejection":
            self._count("rejections/total", s, wall)
        elif kind == "learner_start":
            self._count("learners/starts", s, wall)
        elif kind == "learner_restart":
            self._count("learners/restarts", s, wall)
        elif kind in _FAULTS:
            self._count("faults/total", s, wall)
        elif kind == "goodput":
            for k, v in event.items():
                if k not in ("t", "time") and isinstance(v, int | float) and not isinstance(v, bool):
                    self._scalar(f"goodput/{k}", v, s, wall)
        return self._written - before

    def _merge(self, e: Mapping[str, Any], s: int, wall: float | None) -> None:
        p, v = int(e["fragment"]), int(e["version"])
        self._seen_fragments.add(p)
        pre = f"merge/fragment_{p}"
        values: dict[str, float] = {"quorum": len(e.get("contributors", ()))}
        for k in ("grace_s", "grace_window_s", "slack_s", "bytes_in", "bytes_out"):
            if e.get(k) is not None:
                values[k] = e[k]
        staleness = e.get("staleness") or []
        if staleness:
            values["staleness_mean"] = sum(staleness) / len(staleness)
        for k, x in values.items():
            self._scalar(f"{pre}/{k}", x, v, wall)
        self._tally.add(e)
        self._bytes_in += int(e.get("bytes_in") or 0)
        self._bytes_out += int(e.get("bytes_out") or 0)
        self._scalar("merge/tokens_merged", self.tokens_merged(), s, wall)
        self._scalar("wire/bytes_in_total", self._bytes_in, s, wall)
        self._scalar("wire/bytes_out_total", self._bytes_out, s, wall)

    def write_all(self, events: list[Mapping[str, Any]]) -> int:
        """Writes several events in the order of their ``t`` (metrics.jsonl is in arrival order)."""
        return sum(self.write(e) for e in sorted(events, key=lambda e: e.get("t", e.get("time", 0.0))))

    # ---- ending ------------------------------------------------------------------------------
    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        """Flushes and closes the event file; further `write` calls raise."""
        if not self._closed:
            self._writer.close()
            for sink in self.also:
                sink.close()
            self._closed = True

    def __enter__(self) -> TensorBoardSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def from_metrics(run_dir: str | os.PathLike) -> Path:
    """Writes the TensorBoard event file of a finished run from its ``metrics.jsonl``; returns the dir.

    Raises:
      FileNotFoundError: `run_dir` has no ``metrics.jsonl``.
    """
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl (not a dloco run directory)")
    events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    with TensorBoardSink(run_dir) as sink:
        sink.write_all(events)
    return run_dir
