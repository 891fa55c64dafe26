"""Pre-tokenized ``.bin`` shards in the nanoGPT / modded-nanogpt format.

Layout: a header of 256 little-endian int32 (``[0]`` magic 20240520, ``[1]`` version 1,
``[2]`` number of tokens, the rest zero), then the tokens as little-endian uint16.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import numpy.typing as npt

from nobubble.data.atomic import atomic_write

SHARD_MAGIC = 20240520
SHARD_VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4


def read_bin_shard(path: str | Path) -> npt.NDArray[np.uint16]:
    """Read one shard; a bad header or a size that disagrees with it raises ``ValueError``."""
    path = Path(path)
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise ValueError(
            f"{path}: header: expected {HEADER_BYTES} bytes, found a {size}-byte file; "
            "is this a nanoGPT .bin shard?"
        )
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    _check_field(path, "magic (header[0])", SHARD_MAGIC, int(header[0]))
    _check_field(path, "version (header[1])", SHARD_VERSION, int(header[1]))
    num_tokens = int(header[2])
    _check_field(
        path, "token count (header[2]) vs file size", (size - HEADER_BYTES) // 2, num_tokens
    )
    if (size - HEADER_BYTES) % 2:
        raise ValueError(f"{path}: file size: expected an even token payload, found {size} bytes")
    tokens = np.fromfile(path, dtype="<u2", count=num_tokens, offset=HEADER_BYTES)
    return tokens.astype(np.uint16, copy=False)


def _check_field(path: Path, field: str, expected: int, found: int) -> None:
    if expected != found:
        raise ValueError(f"{path}: {field}: expected {expected}, found {found}")


def write_bin_shard(path: str | Path, tokens: npt.ArrayLike) -> None:
    """Write ``tokens`` (ints in [0, 65535]) as one shard, atomically."""
    array = np.asarray(tokens)
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise TypeError(
            f"tokens must be a 1-D integer array, got shape {array.shape} dtype {array.dtype}"
        )
    if array.size and (array.min() < 0 or array.max() > np.iinfo(np.uint16).max):
        raise ValueError(
            f"tokens must lie in [0, 65535] for the uint16 .bin format, found "
            f"[{array.min()}, {array.max()}]; use a vocabulary of at most 65536 tokens"
        )
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (SHARD_MAGIC, SHARD_VERSION, array.size)
    with atomic_write(Path(path)) as f:
        f.write(header.tobytes())
        f.write(array.astype("<u2").tobytes())
