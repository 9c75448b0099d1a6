"""Parameter fragments: a deterministic partition of the parameter tensors (ALGORITHM.md §3).

Balanced tensor bin-packing: the token embedding gets a fragment of its own (``embedding=True``,
merged by weighted mean, never RDA); the remaining leaves, sorted by size descending (ties by
name), each go to the currently smallest of the other fragments (ties by index). This is the LPT
rule, whose largest bin is at most 4/3 of the optimum.

Fragment p is due at local step t (t ≥ 1, counting completed inner steps) when
``(t − o_p) mod H == 0`` with offset ``o_p = floor(p·H/P)``: the P fragments leave at evenly spaced
steps and each is sent exactly once in every H consecutive steps.

Parameters cross process boundaries as flat dicts ``{"block_0/attn/qkv/kernel": np.ndarray}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from dloco.model import EMBED_KEY


def _name(path: tuple) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def flatten(params: Any) -> dict[str, Any]:
    """The param pytree as ``{path-name: leaf}`` in tree order."""
    return {_name(p): leaf for p, leaf in jax.tree_util.tree_leaves_with_path(params)}


def unflatten(flat: Mapping[str, Any]) -> dict:
    """The inverse of `flatten` for nested-dict pytrees: ``{"a/b": x}`` → ``{"a": {"b": x}}``."""
    tree: dict = {}
    for name, leaf in flat.items():
        node = tree
        *parents, key = name.split("/")
        for k in parents:
            node = node.setdefault(k, {})
        node[key] = leaf
    return tree


@dataclass(frozen=True)
class Fragment:
    """One fragment: its tensor names, shapes and size; `embedding` marks the embedding fragment."""

    fragment_id: int
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    embedding: bool

    @property
    def size(self) -> int:
        return int(sum(int(np.prod(s)) for s in self.shapes))

    @property
    def shape_map(self) -> dict[str, tuple[int, ...]]:
        return dict(zip(self.names, self.shapes, strict=True))


@dataclass(frozen=True)
class FragmentPlan:
    """The partition of a model's parameters into P fragments, plus its send schedule."""

    fragments: tuple[Fragment, ...]
    names: tuple[str, ...]  # all leaf names in tree order

    @property
    def count(self) -> int:
        return len(self.fragments)

    def offset(self, fragment_id: int, every: int) -> int:
        """o_p = floor(p·H/P)."""
        return fragment_id * every // self.count

    def due(self, step: int, every: int) -> tuple[int, ...]:
        """Fragment ids sent after completing local step `step` (≥ 1): ``(t − o_p) mod H == 0``."""
        if step < 1:
            return ()
        return tuple(p for p in range(self.count) if (step - self.offset(p, every)) % every == 0)

    def extract(self, params: Any, fragment_id: int) -> dict[str, np.ndarray]:
        """Fragment p of `params` as float32 numpy arrays (copies to host)."""
        flat = flatten(params)
        names = self.fragments[fragment_id].names
        host = jax.device_get([flat[n] for n in names])
        return {n: np.asarray(a, dtype=np.float32) for n, a in zip(names, host, strict=True)}

    def split(self, params: Any) -> list[dict[str, np.ndarray]]:
        """All fragments of `params` as flat numpy dicts (index = fragment id)."""
        flat = {n: np.asarray(a, dtype=np.float32) for n, a in flatten(jax.device_get(params)).items()}
        return [{n: flat[n] for n in f.names} for f in self.fragments]

    def install(self, params: Any, values: Mapping[str, Any]) -> Any:
        """Returns `params` with the leaves named in `values` replaced (other leaves untouched)."""
        flat = flatten(params)
        unknown = set(values) - set(flat)
        if unknown:
            raise KeyError(f"unknown parameter names: {sorted(unknown)}")
        treedef = jax.tree_util.tree_structure(params)
        leaves = [values.get(n, leaf) for n, leaf in flat.items()]
        return jax.tree_util.tree_unflatten(treedef, leaves)

    def join(self, fragments: list[Mapping[str, np.ndarray]]) -> dict:
        """The nested param pytree assembled from one flat dict per fragment."""
        merged = {n: a for f in fragments for n, a in f.items()}
        if set(merged) != set(self.names):
            raise KeyError(f"fragments do not cover the model: {sorted(set(self.names) ^ set(merged))}")
        return unflatten({n: merged[n] for n in self.names})


def partition(params: Any, num_fragments: int, embedding_key: str = EMBED_KEY) -> FragmentPlan:
    """Partitions the leaves of `params` into `num_fragments` balanced fragments.

    With P ≥ 2 the leaves under the top-level `embedding_key` form fragment 0 (``embedding=True``)
    and the other leaves are bin-packed into fragments 1..P−1; with P = 1 everything is one
    fragment (its embedding tensors are still merged by weighted mean, see `dloco.merge`).

    Raises:
      ValueError: if a fragment would be empty (P larger than the number of tensors allows).
    """
    flat = flatten(params)
    names = tuple(flat)
    shapes = {n: tuple(int(d) for d in np.shape(flat[n])) for n in names}
    sizes = {n: int(np.prod(shapes[n])) for n in names}
    embed = [n for n in names if n.split("/")[0] == embedding_key]
    if num_fragments < 1:
        raise ValueError(f"fragments.count={num_fragments} is invalid: must be >= 1")
    if num_fragments == 1:
        groups, is_embed = [list(names)], [False]
    else:
        rest = [n for n in names if n not in embed]
        n_bins = num_fragments - 1 if embed else num_fragments
        if n_bins > len(rest):
            raise ValueError(
                f"fragments.count={num_fragments} is invalid: the model has only {len(rest)} non-embedding "
                f"tensors; use at most {len(rest) + bool(embed)}"
            )
        bins: list[list[str]] = [[] for _ in range(n_bins)]
        load = [0] * n_bins
        for n in sorted(rest, key=lambda n: (-sizes[n], n)):
            i = min(range(n_bins), key=lambda j: (load[j], j))
            bins[i].append(n)
            load[i] += sizes[n]
        groups = ([embed] if embed else []) + bins
        is_embed = ([True] if embed else []) + [False] * n_bins
    order = {n: i for i, n in enumerate(names)}
    frags = []
    for p, (g, e) in enumerate(zip(groups, is_embed, strict=True)):
        g = sorted(g, key=order.__getitem__)
        frags.append(Fragment(p, tuple(g), tuple(shapes[n] for n in g), e))
    return FragmentPlan(tuple(frags), names)


def embedding_names(names: tuple[str, ...] | list[str], embedding_key: str = EMBED_KEY) -> frozenset[str]:
    """The tensor names that belong to the token embedding (merged by weighted mean)."""
    return frozenset(n for n in names if n.split("/")[0] == embedding_key)
