"""Data layer: corpus, text, ``.bin`` and document (parquet, jsonl, arrow) sources, tokenizers,
splits and the sample order.

``prepare_data(DataConfig(...))`` returns a ``TokenData`` whose ``train_microbatch(m, B)`` is a
pure function of ``(seed, m, B)``; see ``nobubble.data.dataset`` for the split and order rules.
"""

from nobubble.data.config import DataConfig
from nobubble.data.dataset import Batch, TokenData
from nobubble.data.model_tokenizer import check_vocab_fits, model_tokenizer
from nobubble.data.prepare import encode_cached, load_bin_splits, prepare_data, split_text
from nobubble.data.shards import read_bin_shard, write_bin_shard
from nobubble.data.sources import (
    SHAKESPEARE_SHA256,
    DataError,
    default_cache_dir,
    fetch_shakespeare,
    load_text,
)
from nobubble.data.tokenizer import HFTokenizer, Tokenizer, gpt2_tokenizer, train_bpe_tokenizer

__all__ = [
    "SHAKESPEARE_SHA256",
    "Batch",
    "DataConfig",
    "DataError",
    "HFTokenizer",
    "TokenData",
    "Tokenizer",
    "check_vocab_fits",
    "default_cache_dir",
    "encode_cached",
    "fetch_shakespeare",
    "gpt2_tokenizer",
    "load_bin_splits",
    "load_text",
    "model_tokenizer",
    "prepare_data",
    "read_bin_shard",
    "split_text",
    "train_bpe_tokenizer",
    "write_bin_shard",
]
