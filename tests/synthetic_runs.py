"""Synthetic run directories shaped exactly as `actors.launch` writes them (for plot/TensorBoard tests).

Deterministic: M learners push fragment p every H steps at their own step time; each push closes a
round of its own (K = 1); evaluations every 5 s with a falling loss; one rejection, one fault and
one learner restart. `config.json` is a real `RunConfig`; `summary.json` has the launcher's keys.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from dloco import config

T0 = 1_796_000_000.0  # wall time of the run's start


def make_run(run_dir: Path, learners: int = 2, fragments: int = 2, seconds: float = 40.0, algorithm="decoupled"):
    """Writes config.json, metrics.jsonl and summary.json into `run_dir`; returns the events."""
    cfg = config.load(
        overrides=(f"learners.count={learners}", f"fragments.count={fragments}", f"algorithm={algorithm}")
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    H, batch, seq = cfg.sync.every, cfg.inner.batch_size, cfg.data.seq_len
    tok_step = batch * seq
    events: list[dict] = [
        {"event": "store_start", "time": T0 + 1.0, "versions": [0] * fragments, "restored_from": None},
        {"event": "syncer_start", "time": T0 + 1.5, "versions": [0] * fragments},
    ]
    events += [
        {
            "event": "learner_start",
            "time": T0 + 3.0 + 0.2 * m,
            "learner": m,
            "incarnation": 1,
            "cursor": None,
            "step": 0,
        }
        for m in range(learners)
    ]
    version = [0] * fragments
    bytes_in, bytes_out = 9000, 65000
    step_time = [0.1 * (1 + 0.15 * m) for m in range(learners)]
    pushes = []  # (time, learner, step, fragment)
    for m in range(learners):
        for step in range(1, int((seconds - 4.0) / step_time[m])):
            for p in range(fragments):
                if (step - p * H // fragments) % H == 0:
                    pushes.append((T0 + 4.0 + step * step_time[m], m, step, p))
    rounds: list[list[tuple[float, int, int, int]]] = []  # pushes that one round of fragment p merges
    open_round: dict[int, list] = {}
    for push in sorted(pushes):
        r = open_round.get(push[3])
        if r is not None and push[0] < r[0][0] + 0.3 and push[1] not in {x[1] for x in r}:
            r.append(push)  # arrived within the round's grace window
        else:
            open_round[push[3]] = [push]
            rounds.append(open_round[push[3]])
    for r in rounds:
        p, n = r[0][3], len(r)
        version[p] += 1
        events.append(
            {
                "event": "merge",
                "fragment": p,
                "version": version[p],
                "contributors": [x[1] for x in r],
                "incarnations": [1] * n,
                "steps": [x[2] for x in r],
                "tokens": [H * tok_step] * n,
                "inner_steps": [H] * n,
                "weights": [1.0 / n] * n,
                "staleness": [(x[1] + x[2]) % 3 for x in r],
                "cycle_s": [step_time[x[1]] for x in r],
                "grace_s": 0.3 if n > 1 else 0.05 + 0.01 * (r[0][2] % 5),
                "grace_window_s": 0.3,
                "slack_s": 0.6 + 0.05 * math.sin(r[0][2]),
                "bytes_in": bytes_in * n,
                "bytes_out": bytes_out,
                "rejected": 0,
                "time": r[0][0] + 0.35,
                "sync_s": 0.04,
                "push_age_s": [round(r[0][0] + 0.35 - x[0], 3) for x in r],
            }
        )
    events.append(
        {
            "event": "rejection",
            "time": T0 + 20.0,
            "fragment": 0,
            "learner": 1,
            "incarnation": 1,
            "step": 50,
            "base_version": 0,
            "reason": "stale: base 0 < version 9 - max_staleness 8",
        }
    )
    events.append({"event": "fault", "time": T0 + 21.0, "target": "learner-0", "kind": "kill", "source": "manual"})
    events.append(
        {"event": "learner_restart", "time": T0 + 26.0, "learner": 0, "incarnation": 2, "cursor": None, "step": 40}
    )
    trained_rate = sum(tok_step / s for s in step_time)
    end = max(e["time"] for e in events) + 0.5  # the launcher's final evaluation comes after the last merge
    for i, when in enumerate([T0 + 2.0, *(T0 + 5.0 * k for k in range(1, int(seconds // 5))), end]):
        tokens = 0 if i == 0 else int(trained_rate * min(seconds - 4.0, max(0.0, when - T0 - 4.0)))
        events.append({"event": "eval", "time": when, "loss": 5.6 - 2.5 * (1 - math.exp(-i / 4)), "tokens": tokens})
    for e in events:
        e["t"] = e["time"] - T0
    # the launcher appends in arrival order, which is not time order
    order = sorted(range(len(events)), key=lambda i: (events[i]["event"] != "eval", events[i]["time"]))
    with open(run_dir / "metrics.jsonl", "w") as f:
        for i in order:
            f.write(json.dumps(events[i]) + "\n")
    merges = [e for e in events if e["event"] == "merge"]
    evals = [e for e in events if e["event"] == "eval"]
    merged = sum(sum(e["tokens"]) for e in merges) / fragments
    summary = {
        "eval_loss_start": evals[0]["loss"],
        "eval_loss_end": evals[-1]["loss"],
        "tokens_trained": evals[-1]["tokens"],
        "tokens_merged": merged,
        "goodput": merged / evals[-1]["tokens"],
        "uptime": 1.0,
        "merges": len(merges),
        "rejected": 1,
        "learners": learners,
        "restarts": 1,
        "bytes_up": sum(e["bytes_in"] for e in merges),
        "bytes_down": bytes_out * len(merges) * learners,
        "versions": version,
        "placement": {},
        "wall_time_s": end - T0,
        "run_dir": str(run_dir),
        "config": cfg.to_dict(),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return events
