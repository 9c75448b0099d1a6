"""What one commit merged, enough to compute it again: the store's small log entries (ALGORITHM.md §8).

A commit of fragment p turns (Θ_p, s_p, Θ̂_p) at version v into their values at v + 1. Written as
they are, that is 12–16 bytes per parameter (float32 Θ_p, one or two outer-state leaves, the shadow),
which a 100 M-parameter fragment cannot write in under a second on a disk of ~1 GB/s. The commit's
inputs are much smaller: the merged contributions as they arrived (int4: half a byte per parameter
each, plus a float16 scale per block), their weights, the round's share and per-tensor norms, the
outer optimizer's configuration, and with ``compression.publish: delta`` the published q (which
the learners add to their shadow). A `Recipe` holds those inputs; `merge_step` is the one function
that turns them into the commit, called by the syncer when it merges and by the store when it
replays its log: the merge kernels (`dloco.kernels`) and the jitted outer step compute the same
float32 bits from the same inputs on every run, so replay is exact.

Exact only where the compiled code is the same: a replay on a machine whose CPU or libraries
compile the arithmetic differently (another instruction set, another XLA) could compute other
bits. So each recipe carries the XXH3-128 digest of the state it produced (`digest`), and a replay
that does not reproduce it raises `ReplayMismatchError` (the store sets the entry aside and keeps the
state before it, never a state it cannot vouch for).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from dloco import compress, merge

__all__ = ["Recipe", "ReplayMismatchError", "digest", "from_arrays", "merge_step", "replay", "to_arrays"]


class ReplayMismatchError(ValueError):
    """A replayed commit whose state differs from the digest recorded when it was committed."""


@dataclass(frozen=True)
class Recipe:
    """The inputs of one fragment commit (see the module docstring).

    Attributes:
      deltas: per merged contribution, ``{tensor: δ_m}`` as it was merged (a `compress.Payload`, or
        a float32 array when uncompressed).
      weights: w_m per contribution (float64, after any cap), in the order of `deltas`.
      share: the round's share of the live learners' weight (`SyncerCore.share`).
      norms: per contribution ``{tensor: ‖δ_m‖}`` (RDA's radial part).
      rule: ``merge.rule`` (``rda`` or ``mean``).
      embedding: the tensors merged by weighted mean whatever the rule.
      outer: the outer optimizer: ``{"kind": "outer" | "inner", **its config's fields}``.
      published: with ``publish: delta``, q per tensor (the new shadow is Θ̂_p + decode(q)); else None.
      digest: hex XXH3-128 of the state the commit produced (`digest`), "" before it is known.
    """

    deltas: tuple[Mapping[str, merge.Delta], ...]
    weights: tuple[float, ...]
    share: float
    norms: tuple[Mapping[str, float], ...]
    rule: str
    embedding: tuple[str, ...]
    outer: Mapping[str, Any]
    published: Mapping[str, compress.Payload] | None = None
    digest: str = ""

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays a log entry of this recipe holds."""
        return sum(_nbytes(x) for d in self.deltas for x in d.values()) + sum(
            _nbytes(x) for x in (self.published or {}).values()
        )


def _nbytes(x: merge.Delta) -> int:
    if isinstance(x, compress.Payload):
        return x.data.nbytes + (0 if x.scales is None else x.scales.nbytes)
    return int(np.asarray(x).nbytes)


def outer_spec(cfg: Any) -> dict[str, Any]:
    """`Recipe.outer` of an `OuterConfig` or `InnerConfig` (`dloco.outer.outer_config`)."""
    from dloco.config import OuterConfig

    return {"kind": "outer" if isinstance(cfg, OuterConfig) else "inner", **dataclasses.asdict(cfg)}


def merge_step(
    values: Mapping[str, np.ndarray], state: Any, recipe: Recipe, step: Callable
) -> tuple[dict[str, np.ndarray], Any]:
    """(Θ_p, s_p) after the commit `recipe` describes: the merge of its contributions and the outer
    step over the merged pseudo-gradient, by `step` (`outer.make_merge_step`: one fused pass per
    tensor where it can, the same bits as `merge.merge_fragment` then the jitted outer step). The
    syncer's merge and the store's replay both call this."""
    return step(
        values,
        state,
        list(recipe.deltas),
        np.asarray(recipe.weights, np.float64),
        recipe.rule,
        frozenset(recipe.embedding),
        list(recipe.norms),
        recipe.share,
        len(recipe.deltas),
    )


def new_shadow(shadow: Mapping[str, np.ndarray], published: Mapping[str, compress.Payload]) -> dict[str, np.ndarray]:
    """Θ̂_p + decode(q) per tensor: what a learner holding Θ̂_p holds after installing q."""
    return {n: shadow[n] + compress.decode(q) for n, q in published.items()}


def digest(values: Mapping[str, np.ndarray], leaves: Sequence[np.ndarray], shadow: Mapping | None) -> str:
    """Hex XXH3-128 over Θ_p (by tensor name), the outer-state leaves and the shadow, as float bits."""
    h = xxhash.xxh3_128()
    for group in (values, dict(enumerate(leaves)), shadow or {}):
        for k in sorted(group, key=str):
            a = np.ascontiguousarray(group[k])
            h.update(f"{k}:{a.dtype.str}:{a.shape};".encode())
            h.update(a.reshape(-1).view(np.uint8).data)
    return h.hexdigest()


_STEPS: dict[str, Callable] = {}  # merge steps by their outer config (a replay compiles each once)


def replay(
    values: Mapping[str, np.ndarray], leaves: list[np.ndarray], shadow: Mapping[str, np.ndarray] | None, recipe: Recipe
) -> tuple[dict[str, np.ndarray], list[np.ndarray], dict[str, np.ndarray] | None]:
    """(Θ_p, s_p leaves, Θ̂_p) at the next version: `recipe` applied to the state at its base.

    Raises:
      ReplayMismatchError: the result differs from `recipe.digest` (other compiled arithmetic).
    """
    from dloco import outer
    from dloco.config import InnerConfig, OuterConfig

    spec = dict(recipe.outer)
    kind = spec.pop("kind")
    key = json.dumps(recipe.outer, sort_keys=True)
    ocfg = OuterConfig(**spec) if kind == "outer" else InnerConfig(**spec)
    if key not in _STEPS:
        _STEPS[key] = outer.make_merge_step(ocfg)
    state = outer.state_from_numpy(ocfg, values, leaves)
    new_values, new_state = merge_step(values, state, recipe, _STEPS[key])
    new_leaves = outer.state_to_numpy(new_state)
    shadow_next = None if recipe.published is None else new_shadow(shadow or values, recipe.published)
    if (got := digest(new_values, new_leaves, shadow_next)) != recipe.digest:
        raise ReplayMismatchError(f"replay gives state {got}, the commit recorded {recipe.digest}")
    return new_values, new_leaves, shadow_next


def to_arrays(recipe: Recipe) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The arrays and JSON meta of a log entry (`from_arrays` reads them back)."""
    arrays: dict[str, np.ndarray] = {}
    entries: list[dict[str, list]] = []

    def put(prefix: str, d: Mapping[str, merge.Delta]) -> dict[str, list]:
        kinds = {}
        for n, x in d.items():
            if isinstance(x, compress.Payload):
                arrays[f"{prefix}/{n}/data"] = x.data
                if x.scales is not None:
                    arrays[f"{prefix}/{n}/scales"] = x.scales
                kinds[n] = [x.dtype, list(x.shape), x.block, x.entropy]  # as it arrived: zstd-coded codes stay so
            else:
                arrays[f"{prefix}/{n}/data"] = np.asarray(x)
                kinds[n] = []
        return kinds

    for m, d in enumerate(recipe.deltas):
        entries.append(put(f"r/{m}", d))
    meta = {
        "deltas": entries,
        "weights": [float(w) for w in recipe.weights],
        "share": float(recipe.share),
        "norms": [{n: float(v) for n, v in t.items()} for t in recipe.norms],
        "rule": recipe.rule,
        "embedding": sorted(recipe.embedding),
        "outer": dict(recipe.outer),
        "published": None if recipe.published is None else put("q", recipe.published),
        "digest": recipe.digest,
    }
    return arrays, meta


def from_arrays(arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> Recipe:
    """The `Recipe` of a log entry's arrays and meta; KeyError, TypeError or ValueError if malformed."""

    def get(prefix: str, kinds: Mapping[str, list]) -> dict[str, merge.Delta]:
        out: dict[str, merge.Delta] = {}
        for n, kind in kinds.items():
            data = arrays[f"{prefix}/{n}/data"]
            if kind:
                dtype, shape, block, coding = kind
                scales = arrays.get(f"{prefix}/{n}/scales")
                out[n] = compress.Payload(dtype, tuple(shape), data, scales, int(block), coding)
            else:
                out[n] = data
        return out

    pub = meta["published"]
    return Recipe(
        deltas=tuple(get(f"r/{m}", kinds) for m, kinds in enumerate(meta["deltas"])),
        weights=tuple(float(w) for w in meta["weights"]),
        share=float(meta["share"]),
        norms=tuple({n: float(v) for n, v in t.items()} for t in meta["norms"]),
        rule=str(meta["rule"]),
        embedding=tuple(meta["embedding"]),
        outer=dict(meta["outer"]),
        published=None if pub is None else {n: x for n, x in get("q", pub).items() if isinstance(x, compress.Payload)},
        digest=str(meta["digest"]),
    )
