"""Documents -> one token stream (each document's ids, then EOS), streamed to a cached file.

Tokenization reads ``batch_rows`` documents at a time and appends their ids to the cache file as
it goes, so a corpus larger than memory works; the result is memory-mapped, never loaded whole.

Split: the last ``ceil(val_fraction * N)`` of the ``N`` documents (in reading order) are the
validation split, the rest train; ``val_start`` is the token offset where they begin. Windows
(``TokenData``) are cut from each part separately, so none straddles the two.

Cache: ``documents/<key>.bin`` (the raw ids, uint16 when the tokenizer's ids fit, else uint32)
and ``documents/<key>.json`` (dtype, token and document counts, ``val_start``), written
atomically, the ``.json`` last: a run that dies midway leaves no cache entry. The key hashes the
format version, each file's resolved path, size and mtime, the column, the tokenizer's name (it
carries a hash of its vocabulary and its EOS id) and ``val_fraction``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Iterator
from itertools import chain
from pathlib import Path
from typing import BinaryIO

import numpy as np
from tqdm import tqdm

from nobubble.data.atomic import atomic_write, atomic_write_bytes
from nobubble.data.dataset import Tokens
from nobubble.data.documents import DocumentFile, iter_texts
from nobubble.data.tokenizer import HFTokenizer

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
BATCH_ROWS = 1024  # documents per tokenizer call: enough to keep its threads busy


def cache_key(files: list[Path], column: str, tokenizer_name: str, val_fraction: float) -> str:
    """Identity of a tokenized corpus; any change to a file's size or mtime changes it."""
    ident = {
        "version": FORMAT_VERSION,
        "files": [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files],
        "column": column,
        "tokenizer": tokenizer_name,
        "val_fraction": float(val_fraction),
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:20]


def cache_paths(cache_dir: Path, key: str) -> tuple[Path, Path]:
    """The ``.bin`` ids and ``.json`` description of the cache entry ``key``."""
    return cache_dir / "documents" / f"{key}.bin", cache_dir / "documents" / f"{key}.json"


def load_cached(cache_dir: Path, key: str) -> tuple[Tokens, Tokens] | None:
    """``(train, val)`` memory-mapped from the cache entry ``key``; None if it is not complete."""
    bin_path, meta_path = cache_paths(cache_dir, key)
    if not meta_path.is_file() or not bin_path.is_file():
        return None
    meta = json.loads(meta_path.read_text())
    dtype = np.dtype(meta["dtype"])
    if bin_path.stat().st_size != meta["num_tokens"] * dtype.itemsize:
        return None  # a .bin from another, interrupted write: tokenize again
    tokens = np.memmap(bin_path, dtype=dtype, mode="r", shape=(meta["num_tokens"],))
    return tokens[: meta["val_start"]], tokens[meta["val_start"] :]


def tokenize_documents(
    docs: list[DocumentFile],
    column: str,
    tokenizer: HFTokenizer,
    val_fraction: float,
    cache_dir: Path,
    key: str,
    *,
    batch_rows: int = BATCH_ROWS,
    progress: bool | None = None,
) -> tuple[Tokens, Tokens]:
    """Tokenize ``docs`` into the cache entry ``key``, then map it (see the module docstring).

    ``progress``: a bar on stderr; None shows it only on a terminal.
    """
    assert tokenizer.eos_id is not None, "the caller checks that documents can be joined"
    num_docs = sum(d.num_docs for d in docs)
    num_train = num_train_docs(docs, val_fraction)
    dtype = np.dtype(np.uint16 if tokenizer.id_bound <= 1 << 16 else np.uint32)
    bin_path, meta_path = cache_paths(cache_dir, key)
    start = time.perf_counter()
    batches = (texts for d in docs for texts in iter_texts(d, column, batch_rows))
    bar = tqdm(total=num_docs, unit="doc", desc="tokenize", disable=_disabled(progress))
    with bar, atomic_write(bin_path) as out:
        num_tokens, val_start = _write_stream(batches, tokenizer, num_train, dtype, out, bar)
    meta = {"dtype": dtype.name, "num_tokens": num_tokens, "num_docs": num_docs}
    meta |= {"val_start": val_start, "version": FORMAT_VERSION}
    atomic_write_bytes(meta_path, json.dumps(meta).encode())
    logger.info(
        "tokenized %d documents into %d tokens in %.1f s -> %s",
        num_docs, num_tokens, time.perf_counter() - start, bin_path,
    )  # fmt: skip
    cached = load_cached(cache_dir, key)
    assert cached is not None, bin_path
    return cached


def num_train_docs(docs: list[DocumentFile], val_fraction: float) -> int:
    """Documents before the validation tail of ``ceil(val_fraction * N)``; at least one."""
    num_docs = sum(d.num_docs for d in docs)
    num_train = num_docs - math.ceil(val_fraction * num_docs)
    if num_train < 1:
        raise ValueError(
            f"the data holds {num_docs} document(s), too few to split off val_fraction="
            f"{val_fraction} for validation and keep one for training; use more documents"
        )
    return num_train


def train_texts(
    docs: list[DocumentFile], column: str, val_fraction: float, batch_rows: int = BATCH_ROWS
) -> Iterator[list[str]]:
    """The train split's documents in batches (what a tokenizer may be trained on)."""
    return _first_texts(docs, column, num_train_docs(docs, val_fraction), batch_rows)


def _first_texts(
    docs: list[DocumentFile], column: str, left: int, batch_rows: int
) -> Iterator[list[str]]:
    for texts in (t for d in docs for t in iter_texts(d, column, batch_rows)):
        if left <= 0:
            return
        yield texts[:left]
        left -= len(texts)


def _disabled(progress: bool | None) -> bool | None:
    return None if progress is None else not progress  # tqdm: None = off unless a terminal


def _write_stream(
    batches: Iterator[list[str]],
    tokenizer: HFTokenizer,
    num_train: int,
    dtype: np.dtype,
    out: BinaryIO,
    bar: tqdm,
) -> tuple[int, int]:
    """Append each document's ids and EOS to ``out``; the total and where document
    ``num_train`` (the first validation document) starts."""
    written, doc, val_start = 0, 0, -1
    eos = [tokenizer.eos_id]
    for texts in batches:
        ids = [[*one, *eos] for one in tokenizer.encode_documents(texts)]
        if doc <= num_train < doc + len(ids):
            val_start = written + sum(len(one) for one in ids[: num_train - doc])
        chunk = np.fromiter(chain.from_iterable(ids), dtype=dtype)
        out.write(chunk.tobytes())
        written += len(chunk)
        doc += len(ids)
        bar.update(len(ids))
    assert val_start >= 0, (doc, num_train)
    return written, val_start
