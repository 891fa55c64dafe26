"""Tokenizers: a byte-level BPE trained on the train split (cached), local GPT-2 files, or a Hugging
Face model's own ``tokenizer.json``.

All wrap the Rust ``tokenizers`` library. Text is encoded paragraph by paragraph
(``encode_batch`` over pieces that end after a blank line): the Rust side then runs on all cores
and a 5 MB corpus takes about a second instead of five as one string. The BPE is trained on the
same pieces. Byte-level BPE is lossless, so ``decode(encode(text)) == text`` for any text.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Iterable, Sequence
from itertools import chain
from pathlib import Path
from typing import Protocol, runtime_checkable

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from nobubble.data.atomic import atomic_write_bytes

logger = logging.getLogger(__name__)

BYTE_ALPHABET_SIZE = 256
_PARAGRAPH_END = re.compile(r"(?<=\n\n)")
GPT2_EOS = "<|endoftext|>"
_GPT2_REPOS = ("models--gpt2", "models--openai-community--gpt2")


@runtime_checkable
class Tokenizer(Protocol):
    """What the data layer needs from a tokenizer."""

    @property
    def name(self) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` with a ``name`` that identifies its exact vocabulary."""

    def __init__(
        self, tokenizer: tokenizers.Tokenizer, name: str, eos_id: int | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self._name = name
        self.eos_id = eos_id  # joins documents; None where the vocabulary has no such token

    @property
    def name(self) -> str:
        return self._name

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size())

    def encode(self, text: str) -> list[int]:
        pieces = self.tokenizer.encode_batch(
            text.splitlines(keepends=True), add_special_tokens=False
        )
        return list(chain.from_iterable(p.ids for p in pieces))

    @property
    def id_bound(self) -> int:
        """One more than the largest id the tokenizer can produce, added tokens included."""
        return max(self.tokenizer.get_vocab(with_added_tokens=True).values()) + 1

    def encode_documents(self, texts: list[str]) -> list[list[int]]:
        """Each text's ids as the tokenizer alone gives them (no BOS/EOS template added)."""
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))

    def __repr__(self) -> str:
        return f"HFTokenizer(name={self.name!r}, vocab_size={self.vocab_size})"


def split_paragraphs(text: str) -> list[str]:
    """``text`` cut after each blank line (``"\\n\\n"``); joining the pieces gives ``text`` back."""
    return _PARAGRAPH_END.split(text)


def _byte_level(model: models.Model) -> tokenizers.Tokenizer:
    """GPT-2 style byte-level pipeline around ``model`` (no prefix space, lossless decode)."""
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def bpe_cache_path(text: str, vocab_size: int, cache_dir: Path) -> Path:
    """Where the BPE trained on ``text`` with ``vocab_size`` lives: keyed by sha256(text)[:16]."""
    key = hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
    return cache_dir / "tokenizers" / f"bpe-{key}-v{vocab_size}.json"


def train_bpe_tokenizer(text: str, vocab_size: int, cache_dir: Path) -> HFTokenizer:
    """Byte-level BPE trained on ``text`` (pass the train split only); cached, so trained once."""
    if vocab_size <= BYTE_ALPHABET_SIZE:
        raise ValueError(
            f"vocab_size={vocab_size} leaves no room for merges: byte-level BPE needs more than "
            f"the {BYTE_ALPHABET_SIZE} byte tokens; use e.g. 512 or 8192"
        )
    path = bpe_cache_path(text, vocab_size, cache_dir)
    if path.is_file():
        logger.info("loading cached BPE tokenizer %s", path)
        return HFTokenizer(tokenizers.Tokenizer.from_file(str(path)), name=path.stem)
    tok = _train_bpe(split_paragraphs(text), vocab_size)
    atomic_write_bytes(path, tok.to_str().encode("utf-8"))
    logger.info("trained BPE tokenizer (vocab %d) -> %s", tok.get_vocab_size(), path)
    return HFTokenizer(tok, name=path.stem)


def _train_bpe(
    pieces: Iterable[str] | Iterable[list[str]], vocab_size: int, special: list[str] | None = None
) -> tokenizers.Tokenizer:
    tok = _byte_level(models.BPE())
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable
        special_tokens=special or [],
        show_progress=False,
    )
    tok.train_from_iterator(pieces, trainer=trainer)
    return tok


def train_document_bpe(batches: Iterable[list[str]], vocab_size: int, path: Path) -> HFTokenizer:
    """Byte-level BPE with ``<|endoftext|>`` (id 0) to join documents, trained on the documents
    ``batches`` streams (pass the train split only); kept at ``path``, so trained once."""
    if vocab_size <= BYTE_ALPHABET_SIZE + 1:
        raise ValueError(
            f"vocab_size={vocab_size} leaves no room for merges: byte-level BPE with an EOS "
            f"needs more than {BYTE_ALPHABET_SIZE + 1} tokens; use e.g. 512 or 8192"
        )
    if path.is_file():
        tok = tokenizers.Tokenizer.from_file(str(path))
    else:
        tok = _train_bpe(batches, vocab_size, special=[GPT2_EOS])
        atomic_write_bytes(path, tok.to_str().encode("utf-8"))
        logger.info("trained BPE tokenizer (vocab %d) -> %s", tok.get_vocab_size(), path)
    return HFTokenizer(tok, path.stem, tok.token_to_id(GPT2_EOS))


def gpt2_tokenizer(path: str | None = None) -> HFTokenizer:
    """GPT-2's tokenizer from local files only; never touches the network.

    ``path`` is a ``tokenizer.json`` or a directory holding ``tokenizer.json`` or
    ``vocab.json`` + ``merges.txt``. Without it, the local Hugging Face hub cache is searched.
    """
    if path is not None:
        looked = [Path(path).expanduser()]
        if not looked[0].exists():
            raise ValueError(f"GPT-2 tokenizer path {path!r} does not exist. {_GPT2_HINT}")
        candidates = looked
    else:
        looked = _hf_cache_repos()
        candidates = [snap for repo in looked for snap in sorted(repo.glob("snapshots/*"))]
    for candidate in candidates:
        tok = _load_gpt2_files(candidate)
        if tok is not None:
            logger.info("loaded GPT-2 tokenizer from %s", candidate)
            return tok
    raise ValueError(
        "no GPT-2 tokenizer files (tokenizer.json, or vocab.json + merges.txt) found; looked in: "
        f"{', '.join(str(p) for p in looked)}. {_GPT2_HINT}"
    )


_GPT2_HINT = (
    "Fix: copy tokenizer.json (or vocab.json and merges.txt) of 'gpt2' from a machine with "
    "network access and pass its path (DataConfig(tokenizer_path=...)), or use tokenizer='bpe'"
)


def _hf_cache_repos() -> list[Path]:
    """GPT-2 repository directories in the local Hugging Face hub caches, in a fixed order."""
    hf_home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    hub_cache = os.environ.get("HF_HUB_CACHE")
    roots = dict.fromkeys(([Path(hub_cache)] if hub_cache else []) + [hf_home / "hub"])
    return [root / repo for root in roots for repo in _GPT2_REPOS]


def _load_gpt2_files(where: Path) -> HFTokenizer | None:
    json_file = where if where.is_file() else where / "tokenizer.json"
    if json_file.is_file():
        tok = tokenizers.Tokenizer.from_file(str(json_file))
        return HFTokenizer(tok, _gpt2_name(json_file), tok.token_to_id(GPT2_EOS))
    vocab, merges = where / "vocab.json", where / "merges.txt"
    if vocab.is_file() and merges.is_file():
        tok = _byte_level(models.BPE.from_file(str(vocab), str(merges)))
        return HFTokenizer(tok, _gpt2_name(vocab, merges), tok.token_to_id(GPT2_EOS))
    return None


def _gpt2_name(*files: Path) -> str:
    """``gpt2-<hash>``: the hash keeps caches of different vocab files apart."""
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:8]
    return f"gpt2-{digest}"
