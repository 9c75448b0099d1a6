"""Byte-level and BPE tokenizers with one end-of-sequence id."""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

BYTE_EOS_ID = 256
BPE_EOS_TOKEN = "<|eos|>"
# what a pretrained tokenizer calls its end of sequence: the first of these it has is EOS
EOS_TOKENS = (BPE_EOS_TOKEN, "<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")


class Tokenizer:
    """Byte-level or BPE tokenizer with one end-of-sequence id.

    ``"byte"``: ids are the UTF-8 bytes 0..255 and EOS is 256 (``vocab_size`` 257).
    ``"bpe"``: a HF ``tokenizers`` model (ours: byte-level BPE) whose EOS is the first of
    `EOS_TOKENS` it has (``<|eos|>`` in ours). Text is encoded without the model's own special
    tokens (no BOS): documents are joined by EOS only.
    Build with :meth:`byte`, :meth:`from_file` or :func:`load_tokenizer`.
    """

    def __init__(self, kind: str, backend=None):
        if kind not in ("byte", "bpe") or (kind == "bpe") != (backend is not None):
            raise ValueError(f"Tokenizer kind={kind!r} needs a backend iff it is 'bpe'")
        self.kind = kind
        self._backend = backend
        if backend is not None:
            # Text that happens to contain "<|eos|>" is encoded as text, never as EOS.
            backend.encode_special_tokens = True
            eos = next((i for t in EOS_TOKENS if (i := backend.token_to_id(t)) is not None), None)
            if eos is None:
                raise ValueError(f"the tokenizer has no end-of-sequence token: none of {', '.join(EOS_TOKENS)}")
            self.eos_id = int(eos)
            self.vocab_size = int(backend.get_vocab_size(with_added_tokens=True))
        else:
            self.eos_id = BYTE_EOS_ID
            self.vocab_size = BYTE_EOS_ID + 1

    @classmethod
    def byte(cls) -> Tokenizer:
        """Returns the byte tokenizer (vocab 257, EOS 256)."""
        return cls("byte")

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> Tokenizer:
        """Loads a tokenizer saved as ``tokenizer.json`` (ours, or a pretrained HF one)."""
        from tokenizers import Tokenizer as HFTokenizer

        try:
            backend = HFTokenizer.from_file(str(path))
        except Exception as e:  # the library raises a bare Exception for a file it cannot parse
            if not os.path.isfile(path):
                raise FileNotFoundError(2, "No such file", str(path)) from None
            raise ValueError(f"{path}: not a tokenizer.json the tokenizers library reads ({e})") from None
        return cls("bpe", backend)

    def encode(self, text: str, *, eos: bool = False) -> np.ndarray:
        """Encodes ``text`` to an int32 id array, appending EOS if ``eos``."""
        if self._backend is None:
            ids = np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8)
            ids = ids.astype(np.int32)
        else:
            ids = np.asarray(self._backend.encode(text, add_special_tokens=False).ids, dtype=np.int32)
        return np.append(ids, np.int32(self.eos_id)) if eos else ids

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Decodes ids to text; EOS ids are dropped."""
        arr = np.asarray(ids, dtype=np.int64).ravel()
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            raise ValueError(f"ids must lie in [0, {self.vocab_size}), got {arr.min()}..{arr.max()}")
        arr = arr[arr != self.eos_id]
        if self._backend is None:
            return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
        return self._backend.decode(arr.tolist(), skip_special_tokens=False)

    def _encode_documents(self, texts: list[str]) -> list[np.ndarray]:
        """Encodes each text with EOS appended (batched for BPE)."""
        if self._backend is None:
            return [self.encode(t, eos=True) for t in texts]
        encodings = self._backend.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids + [self.eos_id], dtype=np.int32) for e in encodings]


def train_bpe(texts: list[str], vocab_size: int) -> Tokenizer:
    """Trains a byte-level BPE with ``<|eos|>`` as its first (id 0) special token."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BPE_EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return Tokenizer("bpe", backend)
