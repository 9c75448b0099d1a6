"""Per-learner resumable token streams (:class:`Cursor`, :class:`TokenStream` over a split in memory
or memory-mapped, :class:`ShardStream` over the shards of a ``tokens:`` corpus) and validation batches."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from dloco.data.shards import ShardedTokens

SHUFFLE_WINDOWS = 1024  # a ShardStream shuffles its windows within blocks of this many


@dataclasses.dataclass(frozen=True)
class Cursor:
    """Position of a :class:`TokenStream`: ``index`` windows of ``epoch`` consumed by the shard."""

    epoch: int = 0
    index: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    @classmethod
    def from_dict(cls, d: dict) -> Cursor:
        if set(d) != {"epoch", "index"}:
            raise ValueError(f"Cursor dict needs exactly keys 'epoch' and 'index', got {sorted(d)}")
        return cls(epoch=int(d["epoch"]), index=int(d["index"]))


def _gather(tokens: np.ndarray, windows: np.ndarray, seq_len: int) -> np.ndarray:
    """Rows ``tokens[w·T : w·T + T + 1]`` for each window ``w`` as int32 ``[len(windows), T+1]``."""
    idx = np.asarray(windows, dtype=np.int64)[:, None] * seq_len + np.arange(seq_len + 1)
    return tokens[idx].astype(np.int32)


def _num_windows(tokens: np.ndarray, seq_len: int) -> int:
    return max(len(tokens) - 1, 0) // seq_len


class TokenStream:
    """Shard ``s`` of ``S`` of a shuffled, endless sequence of ``[B, T+1]`` token windows.

    Window ``w`` is ``tokens[w·T : w·T + T + 1]``: consecutive windows share one boundary token,
    so each of the ``W = ⌊(N−1)/T⌋`` windows predicts ``T`` targets and every token after the
    first is a target exactly once per epoch. In epoch ``e`` the shard reads windows
    ``π_e[s + k·S]`` for ``k = 0 … ⌊W/S⌋−1``, ``π_e`` being the permutation drawn by
    ``np.random.default_rng([seed, e])``; the ``W mod S`` leftover windows are skipped that epoch.
    A batch that exhausts an epoch continues in the next one.

    Args:
      tokens: flat 1-D token array (e.g. :meth:`Corpus.load_split`); for a `ShardStream`, `ShardedTokens`.
      seq_len: ``T``, targets per row. batch_size: ``B``, rows per batch.
      shard: ``s``, this learner's shard. num_shards: ``S``.
      seed: non-negative data seed shared by all shards.
      cursor: where to resume; defaults to ``Cursor(0, 0)``.

    Raises:
      ValueError: a bad argument, or fewer than ``S`` windows.
    """

    def __init__(
        self,
        tokens: np.ndarray | ShardedTokens,
        *,
        seq_len: int,
        batch_size: int,
        shard: int,
        num_shards: int,
        seed: int,
        cursor: Cursor | None = None,
    ):
        flat = self._as_tokens(tokens)  # the array, or a ShardStream's ShardedTokens
        for name, value in (("seq_len", seq_len), ("batch_size", batch_size), ("num_shards", num_shards)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard must be in [0, {num_shards}), got {shard}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self._tokens, self._seq_len, self._batch_size = flat, seq_len, batch_size
        self._shard, self._num_shards, self._seed = shard, num_shards, seed
        self._num_windows = _num_windows(flat, seq_len)
        self.windows_per_epoch = self._num_windows // num_shards
        if self.windows_per_epoch == 0:
            raise ValueError(
                f"{len(flat)} tokens give {self._num_windows} windows of seq_len+1="
                f"{seq_len + 1}, fewer than num_shards={num_shards}; use more data or a "
                "smaller seq_len"
            )
        cursor = cursor if cursor is not None else Cursor()
        if cursor.epoch < 0 or not 0 <= cursor.index < self.windows_per_epoch:
            raise ValueError(f"cursor {cursor} is outside [0, {self.windows_per_epoch}) windows")
        self._cursor = cursor
        self._cached_epoch, self._cached_windows = -1, np.zeros(0, np.int64)

    @staticmethod
    def _as_tokens(tokens: np.ndarray | ShardedTokens) -> Any:
        tokens = np.asarray(tokens)
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
        return tokens

    def _windows(self, epoch: int, lo: int, hi: int) -> np.ndarray:
        """Window ids ``lo … hi−1`` of this shard's sequence in ``epoch``."""
        return self.epoch_windows(epoch)[lo:hi]

    def _rows(self, windows: np.ndarray) -> np.ndarray:
        return _gather(self._tokens, windows, self._seq_len)

    @property
    def cursor(self) -> Cursor:
        return self._cursor

    @property
    def tokens_per_batch(self) -> int:
        """Targets per batch, ``B·T``."""
        return self._batch_size * self._seq_len

    def epoch_windows(self, epoch: int) -> np.ndarray:
        """Window ids this shard reads in ``epoch``, in order."""
        if epoch != self._cached_epoch:
            perm = np.random.default_rng([self._seed, epoch]).permutation(self._num_windows)
            stop = self.windows_per_epoch * self._num_shards
            self._cached_epoch = epoch
            self._cached_windows = perm[self._shard : stop : self._num_shards]
        return self._cached_windows

    def next_batch(self) -> np.ndarray:
        """Returns the next int32 ``[B, T+1]`` batch and advances the cursor."""
        epoch, index = self._cursor.epoch, self._cursor.index
        windows = []
        need = self._batch_size
        while need:
            take = min(need, self.windows_per_epoch - index)
            windows.append(self._windows(epoch, index, index + take))
            need, index = need - take, index + take
            if index == self.windows_per_epoch:
                epoch, index = epoch + 1, 0
        self._cursor = Cursor(epoch, index)
        return self._rows(np.concatenate(windows))


class ShardStream(TokenStream):
    """Stream ``s`` of ``S`` over a ``tokens:`` corpus's training split (`ShardedTokens`), reading a
    few shards at a time; `TokenStream`'s windows, cursor and batches, another order.

    The windows are `TokenStream`'s: window ``w`` is tokens ``[w·T, w·T + T + 1)`` of the split, ``W =
    ⌊(N−1)/T⌋`` of them, and ``K = ⌊W/S⌋`` per stream and epoch (`windows_per_epoch`). Each epoch
    ``e`` cuts the windows into S ranges of K consecutive windows, from an offset that moves:
    ``g = np.random.default_rng([seed, e])``, ``o_e = g.integers(W)``, ``σ_e = g.permutation(S)``;
    stream s reads range ``r = σ_e[s]``, windows ``(o_e + r·K + i) mod W`` for ``i = 0 … K−1``,
    shuffled within each block of `SHUFFLE_WINDOWS` consecutive ``i`` by
    ``np.random.default_rng([seed, e, r, block])``. Within an epoch the S streams are disjoint (the
    ``W mod S`` windows the ranges leave out move with ``o_e``); a stream holds one block of windows,
    ``SHUFFLE_WINDOWS·T`` tokens, and the shards they lie in.

    The cursor ``(epoch, index)`` is `TokenStream`'s, and says where the stream is in the shards:
    window ``(o_e + σ_e[s]·K + i) mod W`` for the ``index``-th window read, i.e. `ShardedTokens.locate`
    of its first token gives (shard, offset). The partition is over ``data.shards`` streams, not over
    the learners present: a learner added mid-run (learner m < ``data.shards``) reads stream m from its
    own cursor (none: epoch 0, index 0), and nothing is re-partitioned; another ``data.shards`` is another
    run's data (`dloco.preflight` refuses it on ``--resume``).
    """

    @staticmethod
    def _as_tokens(tokens: np.ndarray | ShardedTokens) -> Any:
        if not isinstance(tokens, ShardedTokens):
            raise ValueError(f"a ShardStream reads ShardedTokens, got {type(tokens).__name__}")
        return tokens

    def _epoch(self, epoch: int) -> tuple[int, int]:
        """(o_e, σ_e[s]) of `epoch`."""
        g = np.random.default_rng([self._seed, epoch])
        offset = int(g.integers(self._num_windows))
        return offset, int(g.permutation(self._num_shards)[self._shard])

    def _windows(self, epoch: int, lo: int, hi: int) -> np.ndarray:
        offset, r = self._epoch(epoch)
        K, C = self.windows_per_epoch, SHUFFLE_WINDOWS
        out = []
        for block in range(lo // C, (hi - 1) // C + 1 if hi > lo else lo // C):
            start = block * C
            perm = np.random.default_rng([self._seed, epoch, r, block]).permutation(min(C, K - start))
            i = start + perm[max(lo - start, 0) : min(hi - start, C)]
            out.append((offset + r * K + i) % self._num_windows)
        return np.concatenate(out).astype(np.int64) if out else np.zeros(0, np.int64)

    def epoch_windows(self, epoch: int) -> np.ndarray:
        """Window ids this stream reads in ``epoch``, in order."""
        return self._windows(epoch, 0, self.windows_per_epoch)

    def where(self) -> dict[str, int | str]:
        """The cursor in the shards: the epoch, and the shard and offset of the next window's first token."""
        w = int(self._windows(self._cursor.epoch, self._cursor.index, self._cursor.index + 1)[0])
        shard, offset = self._tokens.locate(w * self._seq_len)
        return {"epoch": self._cursor.epoch, "shard": shard, "offset": offset}

    def _rows(self, windows: np.ndarray) -> np.ndarray:
        T = self._seq_len
        return np.stack([self._tokens.read(int(w) * T, int(w) * T + T + 1) for w in windows]).astype(np.int32)


def eval_batches(tokens: np.ndarray, *, seq_len: int, batch_size: int, max_batches: int) -> list[np.ndarray]:
    """Returns up to ``max_batches`` full int32 ``[B, T+1]`` batches of windows 0, 1, 2, … in order.

    Raises:
      ValueError: a bad argument, or fewer than ``batch_size`` windows.
    """
    if min(seq_len, batch_size, max_batches) < 1:
        raise ValueError(f"seq_len, batch_size, max_batches must be >= 1, got {seq_len}, {batch_size}, {max_batches}")
    tokens = np.asarray(tokens)
    count = min(max_batches, _num_windows(tokens, seq_len) // batch_size)
    if count == 0:
        raise ValueError(
            f"{len(tokens)} tokens give fewer than batch_size={batch_size} windows of seq_len+1={seq_len + 1}"
        )
    return [_gather(tokens, np.arange(b * batch_size, (b + 1) * batch_size), seq_len) for b in range(count)]
