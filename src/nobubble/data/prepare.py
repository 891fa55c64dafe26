"""``prepare_data``: source -> split -> tokenizer -> cached token arrays -> ``TokenData``.

Text and ``.bin`` sources are read whole; document sources (parquet, jsonl, arrow) stream through
``nobubble.data.packing`` into a memory-mapped cache.
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from collections.abc import Iterable
from pathlib import Path
from typing import cast

import numpy as np
import numpy.typing as npt

from nobubble.data.atomic import atomic_write
from nobubble.data.config import DataConfig
from nobubble.data.dataset import TokenData, Tokens
from nobubble.data.documents import document_files, is_document_path, scan_documents
from nobubble.data.model_tokenizer import check_vocab_fits, model_tokenizer
from nobubble.data.packing import cache_key, load_cached, tokenize_documents, train_texts
from nobubble.data.shards import read_bin_shard
from nobubble.data.sources import default_cache_dir, load_text
from nobubble.data.tokenizer import (
    HFTokenizer,
    Tokenizer,
    gpt2_tokenizer,
    train_bpe_tokenizer,
    train_document_bpe,
)

logger = logging.getLogger(__name__)

_VAL_SHARD = re.compile(r"(?:^|[_.-])val(?:[_.-]|$)")


def prepare_data(cfg: DataConfig, *, progress: bool | None = None) -> TokenData:
    """Load, split and tokenize ``cfg.source``; expensive steps are cached in cache_dir.

    ``progress``: a bar while documents are tokenized; None shows it only on a terminal.
    """
    cache = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()
    if cfg.source != "shakespeare" and is_document_path(cfg.source):
        return prepare_documents(cfg, cache, progress)
    start = time.perf_counter()
    tokenizer: Tokenizer | None = None
    train: Tokens
    val: Tokens
    if cfg.tokenizer == "bin":
        train, val = load_bin_splits(cfg.source, cfg.val_fraction)
        vocab_size = cfg.vocab_size
        _check_ids_fit(train, val, vocab_size, cfg.source)
        logger.info("data: %s: pre-tokenized .bin shards", cfg.source)
    else:
        text = load_text(cfg.source, cache)
        train_text, val_text = split_text(text, cfg.val_fraction)
        if cfg.tokenizer == "bpe":
            tokenizer = train_bpe_tokenizer(train_text, cfg.vocab_size, cache)
        else:
            tokenizer = named_tokenizer(cfg)
        vocab_size = model_vocab(cfg, tokenizer)
        train = encode_cached(train_text, tokenizer, cache)
        val = encode_cached(val_text, tokenizer, cache)
        logger.info(
            "data: %s: %.2f MB text (%d train + %d val characters)",
            cfg.source, len(text) / 1e6, len(train_text), len(val_text),
        )  # fmt: skip
    logger.info(
        "data: %d train + %d val tokens, vocab %d (%s), ready in %.1f s",
        len(train), len(val), vocab_size, tokenizer.name if tokenizer else "bin",
        time.perf_counter() - start,
    )  # fmt: skip
    return TokenData(train, val, cfg.seq_len, cfg.seed, vocab_size, tokenizer)


def prepare_documents(cfg: DataConfig, cache: Path, progress: bool | None) -> TokenData:
    """Documents of parquet, jsonl or arrow files, each followed by EOS, in one token stream."""
    if cfg.tokenizer == "bin":
        raise ValueError(
            f"{cfg.source!r} holds documents, not .bin token shards; set tokenizer='hf' with "
            "tokenizer_path the model folder (its tokenizer.json), 'gpt2' or 'bpe'"
        )
    files = document_files(cfg.source)
    tokenizer = document_tokenizer(cfg, files, cache)
    vocab_size = model_vocab(cfg, tokenizer)
    if tokenizer.eos_id is None:
        raise ValueError(
            f"tokenizer {tokenizer.name} has no EOS token to join documents with; "
            "use the model's own tokenizer folder (tokenizer='hf')"
        )
    key = cache_key(files, cfg.text_column, tokenizer.name, cfg.val_fraction)
    cached = load_cached(cache, key)
    if cached is None:
        docs = scan_documents(files, cfg.text_column)  # every check before any work
        cached = tokenize_documents(
            docs, cfg.text_column, tokenizer, cfg.val_fraction, cache, key, progress=progress
        )
    else:
        logger.info("data: %s: cached tokens %s", cfg.source, key)
    train, val = cached
    logger.info(
        "data: %s: %d train + %d val tokens, vocab %d (%s, EOS %d)",
        cfg.source, len(train), len(val), vocab_size, tokenizer.name, tokenizer.eos_id,
    )  # fmt: skip
    return TokenData(train, val, cfg.seq_len, cfg.seed, vocab_size, tokenizer, stream_id=key)


def document_tokenizer(cfg: DataConfig, files: list[Path], cache: Path) -> HFTokenizer:
    """The tokenizer ``cfg`` names, or a byte-level BPE trained on the train documents (kept
    under a key of the documents)."""
    if cfg.tokenizer != "bpe":
        return named_tokenizer(cfg)
    key = cache_key(files, cfg.text_column, f"bpe-v{cfg.vocab_size}", cfg.val_fraction)
    path = cache / "tokenizers" / f"bpe-docs-{key}.json"
    texts: Iterable[list[str]] = ()
    if not path.is_file():  # train on the train split, every file checked first
        docs = scan_documents(files, cfg.text_column)
        texts = train_texts(docs, cfg.text_column, cfg.val_fraction)
    return train_document_bpe(texts, cfg.vocab_size, path)


def named_tokenizer(cfg: DataConfig) -> HFTokenizer:
    """The tokenizer ``cfg`` names by path: GPT-2's files or a Hugging Face model's."""
    if cfg.tokenizer == "hf":
        assert cfg.tokenizer_path is not None, "DataConfig requires it"
        return model_tokenizer(cfg.tokenizer_path)
    return gpt2_tokenizer(cfg.tokenizer_path)


def model_vocab(cfg: DataConfig, tokenizer: Tokenizer) -> int:
    """The model's vocabulary: ``cfg.vocab_size`` for a model's tokenizer, which must fit in
    it (checked before any tokenization), else the tokenizer's."""
    if cfg.tokenizer != "hf":
        return tokenizer.vocab_size
    assert isinstance(tokenizer, HFTokenizer)
    check_vocab_fits(tokenizer.id_bound, cfg.vocab_size)
    return cfg.vocab_size


def split_text(text: str, val_fraction: float) -> tuple[str, str]:
    """``(train, val)`` with ``train + val == text``; val is the tail, starting at a line start."""
    cut = int(len(text) * (1.0 - val_fraction))
    newline = text.find("\n", cut)
    if newline != -1:
        cut = newline + 1  # keep lines whole so neither split starts mid-word
    train, val = text[:cut], text[cut:]
    if not train or not val:
        raise ValueError(
            f"the text ({len(text)} characters) is too short to split with val_fraction="
            f"{val_fraction}; use more text or a different val_fraction"
        )
    return train, val


def encode_cached(text: str, tokenizer: Tokenizer, cache_dir: Path) -> Tokens:
    """``tokenizer.encode(text)`` as an array, cached under ``tokens/<tokenizer>-<sha256>.npy``.

    The tokenizer name must identify its vocabulary (the BPE name carries its own hash).
    """
    key = hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
    path = cache_dir / "tokens" / f"{tokenizer.name}-{key}.npy"
    if path.is_file():
        return cast(Tokens, np.load(path))
    start = time.perf_counter()
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.int32  # uint16 halves memory
    tokens: Tokens = np.asarray(tokenizer.encode(text), dtype=dtype)
    logger.info(
        "tokenized %.2f MB into %d tokens in %.1f s", len(text) / 1e6, len(tokens),
        time.perf_counter() - start,
    )  # fmt: skip
    with atomic_write(path) as f:
        np.save(f, tokens)
    return tokens


def load_bin_splits(
    source: str, val_fraction: float
) -> tuple[npt.NDArray[np.uint16], npt.NDArray[np.uint16]]:
    """Train and validation tokens of a ``.bin`` shard or a directory of shards.

    A directory that has both ``*val*`` shards (``val`` as a ``_``/``-``/``.``-separated word,
    as in modded-nanogpt's ``fineweb_val_000000.bin``) and other shards uses them as the two
    splits; otherwise all shards, in sorted order, form one stream cut at ``1 - val_fraction``.
    """
    path = Path(source).expanduser()
    if path.is_file():
        shards = [path]
    elif path.is_dir():
        shards = sorted(path.glob("*.bin"))
        if not shards:
            raise ValueError(f"directory {source!r} holds no *.bin shard; point source at shards")
    else:
        raise ValueError(
            f"data source {source!r} does not exist: give a .bin shard or a directory of them"
        )
    val_shards = [s for s in shards if _VAL_SHARD.search(s.name)]
    train_shards = [s for s in shards if s not in val_shards]
    if val_shards and train_shards:
        return _concat(train_shards), _concat(val_shards)
    stream = _concat(shards)
    cut = int(len(stream) * (1.0 - val_fraction))
    return stream[:cut], stream[cut:]


def _concat(shards: list[Path]) -> npt.NDArray[np.uint16]:
    return np.concatenate([read_bin_shard(s) for s in shards])


def _check_ids_fit(train: Tokens, val: Tokens, vocab_size: int, source: str) -> None:
    largest = max(int(a.max()) for a in (train, val) if a.size) if train.size or val.size else -1
    if largest >= vocab_size:
        raise ValueError(
            f"{source!r} holds token id {largest} but vocab_size={vocab_size}; "
            f"set vocab_size to at least {largest + 1} (50257, or 50304, for GPT-2 shards)"
        )
