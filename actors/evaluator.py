"""Where the global model's validation loss is computed (ALGORITHM.md §8).

With `metrics.eval_num_gpus` or `metrics.eval_resources` set (an accelerator on a real cluster),
the `Evaluator` actor does it and the driver needs neither the model nor an accelerator: the actor
builds the model and the run's fixed validation batches from the config (tokenized with the
driver's tokenizer and checked against its corpus key, as a learner's are), and `evaluate` fetches
the newest committed fragments from the store (every shard's) and returns their loss. Ray restarts it like the
other actors. With neither set (a local run, a small model), `OnDriver` does the same in the
driver's process, which has JAX loaded already and spares the run one more process.
"""

from __future__ import annotations

from typing import Any, cast

import ray

from actors import shards
from actors.workers import worker_env
from dloco import build, inner
from dloco.config import RunConfig, from_dict


class Evaluator:
    def __init__(self, cfg: dict, store_name: str, namespace: str | None = None, expect=None) -> None:
        self.cfg = from_dict(cfg)
        bp = build.blueprint(self.cfg, (expect or {}).get("tokenizer_json"))
        build.check_corpus(self.cfg, bp.corpus, expect, "the evaluator")
        self.loss = OnDriver(self.cfg, bp)  # the same evaluation, in this actor's process
        self.stores = shards.actors(self.cfg, store_name, namespace)

    def ping(self) -> bool:
        return True

    def evaluate(self) -> dict:
        """``{"loss": …, "versions": […]}`` of the global model the store holds now."""
        versions, fragments = shards.fragments(self.stores)
        return {"loss": self.loss(fragments), "versions": list(versions)}


def placed(cfg: RunConfig) -> bool:
    """Whether the run evaluates in an `Evaluator` actor (its own resources), not on the driver."""
    return bool(cfg.metrics.eval_num_gpus or cfg.metrics.eval_resources)


class OnDriver:
    """The evaluation itself: the loss of the fragments it is given on the run's validation
    batches, in the driver's process (or the `Evaluator` actor's)."""

    def __init__(self, cfg: RunConfig, bp: build.Blueprint) -> None:
        self.plan, self.mesh = bp.plan, inner.make_mesh()
        self.step = inner.make_eval_step(bp.model, self.mesh)
        self.batches = build.eval_set(cfg, bp.corpus)

    def __call__(self, fragments: list) -> float:
        params = inner.replicate(self.plan.join(fragments), self.mesh)
        return inner.evaluate(self.step, params, self.batches, self.mesh)


def spawn(cfg: RunConfig, namespace: str, corpus: dict, opts: dict) -> Any:
    """The run's evaluator actor: `opts` are the store's (namespace, restarts), placed by the
    resources `metrics` asks for instead of on the driver's node."""
    m = cfg.metrics
    options = {k: v for k, v in opts.items() if k != "scheduling_strategy"}
    options |= {"num_gpus": m.eval_num_gpus, "resources": dict(m.eval_resources) or None}
    options["runtime_env"] = {"env_vars": worker_env(cfg, accelerator=m.eval_num_gpus > 0 or "TPU" in m.eval_resources)}
    return (
        cast(Any, ray.remote(Evaluator))
        .options(name="evaluator", **options)
        .remote(cfg.to_dict(), "store", namespace, corpus)
    )
