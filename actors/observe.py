"""What the driver shows outside its own process, every `dloco.control.EVERY_S` seconds: the
``status.json`` that `dloco status` reads, and Ray metrics (`ray.util.metrics`), which every
node's metrics agent serves on its Prometheus endpoint (``ray.nodes()[i]["MetricsExportPort"]``)
for the Ray dashboard's Metrics view or a Grafana. Each is a gauge tagged with the run (its run
directory's name), prefixed ``ray_`` by Ray:

  dloco_goodput, dloco_uptime            learner-time merged ÷ provisioned; time the model advanced
  dloco_tokens_trained                   tokens the learners trained
  dloco_merges, dloco_rejections         rounds committed; contributions refused (with a reason)
  dloco_last_quorum                      contributors in the newest merge
  dloco_commit_gap_s                     seconds since the newest merge (a stall shows as a rising line)
  dloco_bytes_up, dloco_bytes_down       learner ↔ syncer/store payload bytes so far
  dloco_eval_loss                        the newest evaluation of the global model
  dloco_errors                           actor errors and failed commits so far
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from ray.util import metrics

from dloco import control

GAUGES = {
    "goodput": "learner-time whose progress was merged / learner-time provisioned",
    "uptime": "share of the time since the first commit that the model advanced",
    "tokens_trained": "tokens trained by the learners",
    "merges": "rounds committed (all fragments)",
    "rejections": "contributions refused, each with a logged reason",
    "last_quorum": "contributors in the newest merge",
    "commit_gap_s": "seconds since the newest merge",
    "bytes_up": "learner-to-syncer payload bytes",
    "bytes_down": "store-to-learner payload bytes",
    "eval_loss": "validation loss of the newest evaluation",
    "errors": "actor errors and failed commits",
}


class Observer:
    def __init__(self, run: str) -> None:
        self.tags, self._last = {"run": run}, float("-inf")
        self.gauges = {k: metrics.Gauge(f"dloco_{k}", description=d, tag_keys=("run",)) for k, d in GAUGES.items()}

    def tick(self, handle: Any) -> bool:
        """Writes the status file and sets the gauges, at most every `control.EVERY_S` seconds;
        returns whether `dloco stop` asked the run to stop."""
        stop, now = control.stop_requested(handle.run_dir, handle.started), time.time()
        if now - self._last < control.EVERY_S:
            return stop
        self._last, status = now, handle.status()
        with contextlib.suppress(OSError):  # a full or read-only disk: the run goes on, `dloco status` goes stale
            control.publish(handle.run_dir, status, now=now)
        with handle._lock:
            goodput, uptime = handle.tally.goodput(now), handle.tally.uptime(now)
            merge = handle.tally.last.get("merge")
        learners = status["learners"].values()
        values = {
            "goodput": goodput,
            "uptime": uptime,
            "tokens_trained": status["tokens_trained"],
            "merges": status["merges"],
            "rejections": status["rejected"],
            "last_quorum": len(merge["contributors"]) if merge else 0,
            "commit_gap_s": now - merge["time"] if merge else now - handle.started,
            "bytes_up": sum(s.get("bytes_out", 0) for s in learners),
            "bytes_down": sum(s.get("bytes_in", 0) for s in learners),
            "eval_loss": status["eval_loss"],
            "errors": sum(status["errors"].values()),
        }
        for k, v in values.items():
            if v is not None:
                self.gauges[k].set(float(v), tags=self.tags)
        return stop
