"""`Evaluator`: the global model's validation loss, computed off the driver (ALGORITHM.md §8).

The driver needs neither the model nor an accelerator: this actor builds the model and the run's
fixed validation batches from the config (tokenized with the driver's tokenizer and checked
against its corpus key, as a learner's are), and `evaluate` fetches the newest committed fragments
from the store and returns their loss. It asks for `metrics.eval_num_gpus` and
`metrics.eval_resources` (an accelerator on a real cluster); asking for neither, it runs on the
driver's node like the store and the syncer. Ray restarts it like the other actors.
"""

from __future__ import annotations

from typing import Any, cast

import ray

from actors.workers import worker_env
from dloco import build, inner
from dloco.config import RunConfig, from_dict


class Evaluator:
    def __init__(self, cfg: dict, store_name: str, namespace: str | None = None, expect=None) -> None:
        self.cfg = from_dict(cfg)
        bp = build.blueprint(self.cfg, (expect or {}).get("tokenizer_json"))
        build.check_corpus(self.cfg, bp.corpus, expect, "the evaluator")
        self.plan, self.mesh = bp.plan, inner.make_mesh()
        self.step = inner.make_eval_step(bp.model, self.mesh)
        self.batches = build.eval_set(self.cfg, bp.corpus)
        self.store = ray.get_actor(store_name, namespace=namespace)

    def ping(self) -> bool:
        return True

    def evaluate(self) -> dict:
        """``{"loss": …, "versions": […]}`` of the global model the store holds now."""
        versions, fragments = cast(tuple[list, list], ray.get(self.store.fragments.remote()))
        params = inner.replicate(self.plan.join(fragments), self.mesh)
        return {"loss": inner.evaluate(self.step, params, self.batches, self.mesh), "versions": list(versions)}


def spawn(cfg: RunConfig, namespace: str, corpus: dict, opts: dict) -> Any:
    """The run's evaluator actor: `opts` are the store's (namespace, restarts, the driver's node),
    less the placement when `metrics` asks for an accelerator or custom resources."""
    m = cfg.metrics
    placed = bool(m.eval_num_gpus or m.eval_resources)
    options = {k: v for k, v in opts.items() if not (placed and k == "scheduling_strategy")}
    options |= {"num_gpus": m.eval_num_gpus, "resources": dict(m.eval_resources) or None}
    options["runtime_env"] = {"env_vars": worker_env(cfg, accelerator=placed)}
    return (
        cast(Any, ray.remote(Evaluator))
        .options(name="evaluator", **options)
        .remote(cfg.to_dict(), "store", namespace, corpus)
    )
