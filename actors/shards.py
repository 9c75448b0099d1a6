"""The store and syncer shards of a Ray run (`syncer.shards`, `dloco.services.shards`).

`spawn` starts S store actors and S syncer actors, named ``store``/``syncer`` for one shard and
``store-{s}``/``syncer-{s}`` for several; shard s's pair is placed on a node that has the Ray
custom resource ``syncer.shard_resources[s]`` (e.g. a region's), else on the driver's node.
`handles` gives a learner (or the evaluator) its `StorePeer` and `SyncerPeer` over them;
`fragments` and `summary` read the global model and the store's summary from all shards.
"""

from __future__ import annotations

from typing import Any, cast

import ray

from actors import health
from actors.store import FragmentStore
from actors.syncer import Syncer
from actors.transport import StoreHandle, SyncerHandle
from dloco.config import RunConfig
from dloco.services import shards


def spawn(cfg: RunConfig, run_dir: str, opts: dict, started: list) -> tuple[list, list]:
    """(stores, syncers), created but not waited for (`wait_started`), so that whatever the caller
    starts next (the learners: JAX import, corpus, compile) starts beside them; every actor is
    appended to `started` as it is created, so that the caller can remove them all if one fails.
    A syncer finds its store by name while the store is still being constructed."""
    n, where = cfg.syncer.shards, cfg.syncer.shard_resources
    placed = [
        {k: v for k, v in opts.items() if k != "scheduling_strategy"} | {"resources": {where[s]: 0.001}}
        if where
        else opts
        for s in range(n)
    ]
    stores, syncers = [], []
    for s, name in enumerate(shards.names("store", n)):
        stores.append(
            cast(Any, ray.remote(FragmentStore)).options(name=name, **placed[s]).remote(cfg.to_dict(), run_dir, s)
        )
        started.append(stores[-1])
    for s, (name, store) in enumerate(zip(shards.names("syncer", n), shards.names("store", n), strict=True)):
        # threaded: pushes are accepted on Ray's threads while one thread closes rounds
        syncers.append(
            cast(Any, ray.remote(Syncer))
            .options(name=name, max_concurrency=8, **placed[s])
            .remote(cfg.to_dict(), store, opts["namespace"], s)
        )
        started.append(syncers[-1])
    return stores, syncers


def wait_started(cfg: RunConfig, stores: list, syncers: list) -> None:
    """Waits until every store, then every syncer, is constructed (`health.started`: one line if
    one cannot start, e.g. its run dir is locked by another run)."""
    n = cfg.syncer.shards
    for a, name in zip((*stores, *syncers), (*shards.names("store", n), *shards.names("syncer", n)), strict=True):
        health.started(a, name)


def actors(cfg: RunConfig, role: str, namespace: str | None) -> list:
    """The run's `role` ("store" or "syncer") actors, one per shard."""
    return [ray.get_actor(name, namespace=namespace) for name in shards.names(role, cfg.syncer.shards)]


def handles(cfg: RunConfig, stores: list, syncers: list, latency: float = 0.0) -> tuple[Any, Any]:
    """A learner's (store, syncer) peers: the shard's handles for one shard, routers for several."""
    return shards.peers(cfg, [StoreHandle(a) for a in stores], [SyncerHandle(a, latency) for a in syncers])


def fragments(stores: list, timeout: float | None = None) -> tuple[list[int], list[Any]]:
    """(versions, Θ_p) of every fragment, each from its shard."""
    return shards.assemble(len(stores), ray.get([a.fragments.remote() for a in stores], timeout=timeout))


def summary(stores: list, timeout: float | None = None) -> dict:
    return shards.summary(len(stores), ray.get([a.summary.remote() for a in stores], timeout=timeout))
