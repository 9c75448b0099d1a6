"""Which merged fragments a learner is sent, and in what form (ALGORITHM.md §4, §7).

`learner.install` decides when learner m is sent fragment p:

- ``every``: each committed version goes to every learner (§4's loop as written). Under K = 1
  the rounds of one sync period are many (up to M per fragment), so a learner receives up to M
  merged fragments for each push it sends.
- ``own``: m is sent fragment p when a committed version merges a push of m's that it has
  not been told of yet (`due`), which happens once per sync period; the versions in between are not sent, the next
  delivery carries them. So that its next push stays within `syncer.max_staleness`, m is also
  sent p once it has fallen max(1, ⌈max_staleness / 2⌉) versions behind (a lost or rejected push, none
  pending, or many learners).

With `compression.publish: delta` and ``own``, a learner that skipped versions cannot apply the
syncer's delta (it is valid on top of version v − 1 only), and Θ̂_p in full costs 4 bytes per
value. `Copies` therefore keeps, per learner and fragment, the float32 copy C_mp the learner
holds and sends q = encode(Θ_p − C_mp, `publish_dtype`), C_mp ← C_mp + decode(q): error
feedback per learner, the same decode on both sides, so C_mp is what m holds bit for bit and
stays within one quantization step of Θ_p (the callers pass the merged Θ_p itself, not the
syncer's shadow). The copies are soft state (M copies of the model in
the store's memory): lost with a store restart, after which a learner is sent Θ̂_p in full once.
Their memory is bounded by `store.copies_mb`: past it the least recently used copies are dropped,
and a learner whose copy was dropped is sent its next version of that fragment in full (what it
costs: `stats`, in the store's summary).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

import numpy as np

from dloco import compress


def due(install: str, version: int, known: int, told: int | None, merged: int | None, max_staleness: int) -> bool:
    """Whether a learner that holds version `known` of a fragment is sent `version` of it.

    Args:
      install: `learner.install`.
      version: the fragment's newest committed version.
      known: the newest version the learner has of it (installed, queued or in transit).
      told: the step of its last push merged that it has been told of (the `included_step` of
        its last update of the fragment), or None if not known (a store that restarted).
      merged: the step of its last push that the fragment's ledger records as merged, or None.
      max_staleness: `syncer.max_staleness`.
    """
    if version <= known:
        return False
    if install == "every":
        return True
    if merged is not None and (told is None or merged > told):
        return True  # a push of the learner was merged since it last heard: send the result
    return version - known >= max(1, -(-max_staleness // 2))


class Copies:
    """What each learner holds of each fragment, for per-learner delta publishing (module docstring),
    at most `limit_bytes` of them (least recently used dropped first)."""

    def __init__(self, dtype: str, block: int, limit_bytes: int, entropy: str = "none") -> None:
        self.dtype, self.block, self.limit, self.entropy = dtype, block, limit_bytes, entropy
        self._held: OrderedDict[tuple[int, int], tuple[int, dict[str, np.ndarray]]] = OrderedDict()
        self.bytes = self.peak = self.dropped = 0

    def _keep(self, key: tuple[int, int], version: int, values: dict[str, np.ndarray]) -> None:
        self._discard(key)
        self._held[key] = (version, values)
        self.bytes += sum(v.nbytes for v in values.values())
        while self.bytes > self.limit and len(self._held) > 1:
            self._discard(next(iter(self._held)))  # the least recently used (never `key` itself)
            self.dropped += 1
        self.peak = max(self.peak, self.bytes)

    def _discard(self, key: tuple[int, int]) -> None:
        held = self._held.pop(key, None)
        if held is not None:
            self.bytes -= sum(v.nbytes for v in held[1].values())

    def set(self, learner: int, p: int, version: int, values: Mapping[str, np.ndarray]) -> None:
        """The learner was sent `values` of fragment p in full (at registration or a full fetch)."""
        self._keep((learner, p), version, {n: np.array(v, np.float32) for n, v in values.items()})

    def forget(self, learner: int) -> None:
        """A restarted or retired learner: what its earlier incarnation held is gone."""
        for k in [k for k in self._held if k[0] == learner]:
            self._discard(k)

    def stats(self) -> dict[str, int]:
        """Bytes held now and at most, the limit, copies held and copies dropped for the limit."""
        return {
            "bytes": self.bytes,
            "peak_bytes": self.peak,
            "limit_bytes": self.limit,
            "copies": len(self._held),
            "dropped": self.dropped,
        }

    def version(self, learner: int, p: int) -> int | None:
        held = self._held.get((learner, p))
        return None if held is None else held[0]

    def prepare(
        self,
        learner: int,
        p: int,
        version: int,
        known: int,
        target: Mapping[str, np.ndarray],
        full: Mapping[str, np.ndarray],
    ) -> tuple[str, Mapping, int]:
        """What `learner`, holding version `known` of fragment p, is sent of `version`, as (kind,
        payload, base version): ("delta", q, known) against its copy when the copy is at `known`;
        else ("full", `full`, `version`), recorded as its copy (after a store restart, say)."""
        if self.version(learner, p) == known:
            return "delta", self.delta(learner, p, version, target), known
        self.set(learner, p, version, full)
        return "full", full, version

    def delta(
        self, learner: int, p: int, version: int, target: Mapping[str, np.ndarray]
    ) -> dict[str, compress.Payload]:
        """q = encode(target − C_mp) for the learner's copy, and C_mp ← C_mp + decode(q) at `version`.

        The caller checks first that the copy is at the version the learner holds (`version()`).
        """
        base_version, held = self._held[learner, p]
        if version <= base_version:
            raise ValueError(f"learner {learner} already holds version {base_version} of fragment {p}, not < {version}")
        q, new = {}, {}
        for n, x in target.items():
            q[n] = compress.encode(np.asarray(x, np.float32) - held[n], self.dtype, self.block)
            new[n] = held[n] + compress.decode(q[n])
            q[n] = compress.pack(q[n], self.entropy)  # lossless: the learner decodes to the same copy
        self._keep((learner, p), version, new)
        return q
