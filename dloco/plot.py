"""Figures of one or more finished (or running) runs from their ``metrics.jsonl``: `plot(run_dirs, out)`.

Reads each run directory's ``metrics.jsonl`` and, when present, ``summary.json`` and
``config.json``, and writes PNG files (matplotlib's Agg canvas, imported only when plotting):

- ``eval_loss.png``: eval loss vs tokens trained and vs seconds of run time, one line per run;
- ``goodput.png``: tokens trained and tokens merged over time, and goodput over time from the
  run's ``goodput`` events (ALGORITHM.md §8; the token ratio for older runs), with the summary's
  goodput marked at the run's end;
- ``wire.png``: cumulative bytes on the wire over time, learners → syncer (the merged payloads,
  ``bytes_in``) and syncer → learners (one copy of each merged fragment, ``bytes_out``);
- ``fragments_{run}.png``, one per run: per-fragment quorum size, grace used vs slack (and the
  grace window), and mean staleness of each merge over time (ALGORITHM.md §5).

Runs are told apart by directory name, algorithm and M. Tokens merged follow the run accounting
(`dloco.metrics.merged_progress`): each step's progress counts once per fragment, divided by P.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dloco import metrics


@dataclass
class Run:
    """One run directory's events (in time order, each with ``t``), summary and config."""

    path: Path
    events: list[dict[str, Any]]
    summary: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.path.resolve().name

    @property
    def label(self) -> str:
        algo = self.config.get("algorithm", "?")
        m = (self.config.get("learners") or {}).get("count")
        return f"{self.name} ({algo}, M={m})" if m is not None else f"{self.name} ({algo})"

    @property
    def fragments(self) -> int:
        p = (self.config.get("fragments") or {}).get("count")
        seen = {int(e["fragment"]) for e in self.of("merge")}
        return int(p) if p else max(1, len(seen))

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == kind]


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def load_run(run_dir: str | os.PathLike) -> Run:
    """Reads a run directory.

    Raises:
      FileNotFoundError: `run_dir` has no ``metrics.jsonl``.
      ValueError: a line of ``metrics.jsonl`` is not a JSON object (the message names the line).
    """
    path = Path(run_dir)
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"{path}: no metrics.jsonl (not a dloco run directory)")
    events = []
    lines = metrics.read_text().splitlines()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            e = json.loads(line)
        except ValueError:
            if i == len(lines):  # a run still writing may end in a partial line
                break
            raise ValueError(f"{metrics}:{i}: not a JSON event") from None
        if not isinstance(e, dict):
            raise ValueError(f"{metrics}:{i}: not a JSON event")
        events.append(e)
    times = [float(e["time"]) for e in events if "t" not in e and "time" in e]
    t0 = min(times, default=0.0)
    for e in events:
        e.setdefault("t", float(e.get("time", t0)) - t0)
    events.sort(key=lambda e: e["t"])
    summary = _read_json(path / "summary.json")
    config = _read_json(path / "config.json") or summary.get("config") or {}
    return Run(path, events, summary, config)


# ---- series derived from events ----------------------------------------------------------------
def eval_series(run: Run) -> tuple[list[float], list[float], list[float]]:
    """(t, tokens trained, loss) of each evaluation."""
    ev = [e for e in run.of("eval") if e.get("loss") is not None]
    return [e["t"] for e in ev], [float(e.get("tokens", 0)) for e in ev], [float(e["loss"]) for e in ev]


def merged_series(run: Run) -> tuple[list[float], list[float]]:
    """(t, cumulative tokens merged) after each merge, each step's progress counted once
    (`dloco.metrics.merged_progress`)."""
    ts, out, total = [], [], 0.0
    start = run.events[0].get("time", 0.0) - run.events[0].get("t", 0.0) if run.events else 0.0
    for r in metrics.merged_progress(run.events, run.fragments):
        total += r["tokens"]
        ts.append(r["time"] - start)
        out.append(total)
    return ts, out


def goodput_series(run: Run) -> tuple[list[float], list[float]]:
    """(t, goodput so far) from the run's ``goodput`` events (ALGORITHM.md §8); for a run written
    before those existed, the token proxy tokens merged / tokens trained at each evaluation."""
    readings = [e for e in run.of("goodput") if e.get("goodput") is not None]
    if readings:
        return [e["t"] for e in readings], [float(e["goodput"]) for e in readings]
    mt, mv = merged_series(run)
    ts, ratio, i, merged = [], [], 0, 0.0
    for t, tokens, _ in zip(*eval_series(run), strict=True):
        while i < len(mt) and mt[i] <= t:
            merged = mv[i]
            i += 1
        if tokens > 0:
            ts.append(t)
            ratio.append(merged / tokens)
    return ts, ratio


def wire_series(run: Run) -> tuple[list[float], list[int], list[int]]:
    """(t, cumulative bytes_in, cumulative bytes_out) after each merge."""
    ts: list[float] = []
    bi: list[int] = []
    bo: list[int] = []
    a, b = 0, 0
    for e in run.of("merge"):
        a += int(e.get("bytes_in") or 0)
        b += int(e.get("bytes_out") or 0)
        ts.append(e["t"])
        bi.append(a)
        bo.append(b)
    return ts, bi, bo


# ---- figures -----------------------------------------------------------------------------------
def _figure(ncols: int, nrows: int = 1, width: float = 6.0, height: float = 4.2):
    # Lazy import. A bare Figure (no pyplot) renders PNG with the Agg canvas and leaves the global
    # backend alone, so plotting from a notebook does not switch the notebook's backend.
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * ncols, height * nrows), dpi=110, layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, axes


def _finish(ax, xlabel: str, ylabel: str, title: str, legend: bool = True) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if legend and ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")


def fig_eval_loss(runs: list[Run], path: Path) -> Path:
    fig, ax = _figure(2)
    for r in runs:
        t, tok, loss = eval_series(r)
        ax[0, 0].plot(tok, loss, marker="o", ms=3, label=r.label)
        ax[0, 1].plot(t, loss, marker="o", ms=3, label=r.label)
    _finish(ax[0, 0], "tokens trained", "eval loss", "Eval loss vs tokens trained")
    _finish(ax[0, 1], "run time (s)", "eval loss", "Eval loss vs wall time")
    fig.savefig(path)
    return path


def fig_goodput(runs: list[Run], path: Path) -> Path:
    fig, ax = _figure(2)
    for r in runs:
        t, tok, _ = eval_series(r)
        (line,) = ax[0, 0].plot(t, tok, label=f"{r.label}: trained")
        mt, mv = merged_series(r)
        ax[0, 0].step(mt, mv, where="post", ls="--", color=line.get_color(), label=f"{r.label}: merged")
        gt, gv = goodput_series(r)
        ax[0, 1].plot(gt, gv, marker="o", ms=3, color=line.get_color(), label=f"{r.label}: goodput")
        if "goodput" in r.summary:
            end = r.summary.get("wall_time_s") or (gt[-1] if gt else 0.0)
            ax[0, 1].plot(
                [end],
                [r.summary["goodput"]],
                marker="*",
                ms=12,
                ls="none",
                color=line.get_color(),
                label=f"{r.label}: summary goodput {r.summary['goodput']:.3f}",
            )
    ax[0, 1].set_ylim(bottom=0)
    _finish(ax[0, 0], "run time (s)", "tokens", "Tokens trained and merged")
    _finish(ax[0, 1], "run time (s)", "goodput", "Goodput over time")
    fig.savefig(path)
    return path


def fig_wire(runs: list[Run], path: Path) -> Path:
    fig, ax = _figure(1, width=7.5)
    a = ax[0, 0]
    for r in runs:
        t, bi, bo = wire_series(r)
        (line,) = a.step(t, [b / 1e6 for b in bi], where="post", label=f"{r.label}: learners → syncer")
        a.step(
            t,
            [b / 1e6 for b in bo],
            where="post",
            ls="--",
            color=line.get_color(),
            label=f"{r.label}: syncer → learners (one copy)",
        )
    _finish(a, "run time (s)", "MB (cumulative)", "Bytes on the wire (merged payloads, published fragments)")
    fig.savefig(path)
    return path


def fig_fragments(run: Run, path: Path) -> Path:
    fig, ax = _figure(3, width=5.2)
    merges = run.of("merge")
    for p in sorted({int(e["fragment"]) for e in merges}):
        mine = [e for e in merges if int(e["fragment"]) == p]
        t = [e["t"] for e in mine]
        quorum = [len(e.get("contributors", ())) for e in mine]
        ax[0, 0].plot(t, quorum, drawstyle="steps-post", marker="o", ms=4, alpha=0.7, label=f"p={p}")
        stale = [sum(e["staleness"]) / len(e["staleness"]) if e.get("staleness") else 0.0 for e in mine]
        ax[0, 2].plot(t, stale, ls="none", marker="o", ms=4, alpha=0.7, label=f"p={p}")
    t = [e["t"] for e in merges]
    for key, style in (("grace_s", "o"), ("slack_s", "x"), ("grace_window_s", "+")):
        ax[0, 1].plot(t, [e.get(key) for e in merges], ls="none", marker=style, ms=4, label=key)
    from matplotlib.ticker import MaxNLocator

    ax[0, 0].yaxis.set_major_locator(MaxNLocator(integer=True))
    _finish(ax[0, 0], "run time (s)", "contributions merged", "Quorum size per fragment")
    _finish(ax[0, 1], "run time (s)", "seconds", "Grace used vs slack (all fragments)")
    _finish(ax[0, 2], "run time (s)", "versions behind", "Mean staleness per merge")
    fig.suptitle(run.label)
    fig.savefig(path)
    return path


def default_out(run_dirs: list[Path]) -> Path:
    """``RUN_DIR/plots`` for one run; ``plots/`` in the runs' common parent directory for several."""
    if len(run_dirs) == 1:
        return run_dirs[0] / "plots"
    return Path(os.path.commonpath([str(p.resolve().parent) for p in run_dirs])) / "plots"


def plot(run_dirs: list[str | os.PathLike], out: str | os.PathLike | None = None) -> list[Path]:
    """Writes the figures of the module docstring for `run_dirs` into `out`; returns their paths.

    Raises:
      FileNotFoundError: a run directory has no ``metrics.jsonl``.
    """
    runs = [load_run(d) for d in run_dirs]
    out_dir = Path(out) if out is not None else default_out([r.path for r in runs])
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [
        fig_eval_loss(runs, out_dir / "eval_loss.png"),
        fig_goodput(runs, out_dir / "goodput.png"),
        fig_wire(runs, out_dir / "wire.png"),
    ]
    used: set[str] = set()
    for r in runs:
        stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", r.name) or "run"
        name, i = stem, 1
        while name in used:
            i += 1
            name = f"{stem}-{i}"
        used.add(name)
        paths.append(fig_fragments(r, out_dir / f"fragments_{name}.png"))
    return paths
