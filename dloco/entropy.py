"""Lossless entropy coding of a payload's bytes with zstd (ALGORITHM.md §7, `compression.entropy`).

Quantized codes are not uniform: the int4 codes of the pseudo-gradients and published deltas of a
training run carry 3.45 bits of information in their 4 (order-0 entropy, measured by
`benchmarks/bandwidth.py`; Gaussian values give 3.38). zstd's Huffman coding of the literal bytes
recovers that (the frames hold 0.85 to 0.86 of the codes' bytes); it finds almost no repeated
strings in codes, so its match finder only costs time. What this module adds on the wire is one
zstd frame per array: a frame header (magic, declared content size) and a 4-byte content checksum
(xxhash64), so that a damaged frame fails to decode instead of turning into other codes.

**Level 1, fixed.** Measured on the int4 codes of a training run (`benchmarks/results/bandwidth.json`,
``entropy.levels`` and ``entropy.throughput``; one core of a shared 2-core machine): levels 3, 9 and
19 make the run's frames 0.3, 0.5 and 0.8 points smaller than level 1 (0.852 of the codes' bytes) and
one 8 MiB tensor's not at all, at 1.1×, 3× and over 100× level 1's compression time; negative
(``--fast``) levels leave the literals uncoded (0.975). Level 1 compresses and decompresses large
tensors at about 500 to 600 MB/s of codes, and decompression is no faster at any other level.

**Layout, as it is** (measured the same way): the nibble-packed int4 bytes compress best. A byte
holding two codes is one symbol of a 256-letter alphabet, which Huffman codes closer to its entropy
than one code per byte (0.882 instead of 0.852); bit planes leave almost nothing to compress (0.98);
scales in the same frame as the codes do worse than scales sent raw beside it (0.862 instead of
0.857 of codes and scales together). Shuffling bf16 bytes (the high bytes, sign and exponent, apart
from the low ones) would gain about 9 points on synthetic values (``entropy.synthetic``); it is not
done, bf16 not being a default wire dtype.
"""

from __future__ import annotations

import numpy as np
import zstandard

CODINGS = ("none", "zstd")
LEVEL = 1


def compress(raw: np.ndarray) -> bytes | None:
    """One zstd frame (level `LEVEL`, content size and checksum written) of `raw`'s bytes, or None
    when the frame would not be smaller than `raw` itself: then the array travels raw."""
    view = np.ascontiguousarray(raw).reshape(-1).view(np.uint8).data
    frame = zstandard.ZstdCompressor(level=LEVEL, write_checksum=True, write_content_size=True).compress(view)
    return frame if len(frame) < view.nbytes else None


def decompress(frame: np.ndarray, size: int) -> bytes:
    """The `size` bytes that `frame` (one zstd frame, as `compress` wrote it) holds.

    The declared content size is read and checked before anything is allocated, so a frame that
    claims more than `size` bytes costs nothing to refuse.

    Raises:
      ValueError: the frame is malformed or truncated, declares another size, fails its checksum
        or has bytes after its end.
    """
    data = np.ascontiguousarray(frame).reshape(-1).view(np.uint8).data
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as e:
        raise ValueError(f"zstd frame: {e}") from None
    if declared != size:
        raise ValueError(f"zstd frame declares {declared} bytes, the payload has {size}")
    try:
        out = zstandard.ZstdDecompressor().decompress(data, max_output_size=size, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise ValueError(f"zstd frame: {e}") from None
    if len(out) != size:
        raise ValueError(f"zstd frame decoded to {len(out)} bytes, the payload has {size}")
    return out
