"""Data layer, tokenizers: the BPE trained on the corpus (round trip, caches, determinism) and
GPT-2's from local vocab and merges files or the Hugging Face cache. From test_data.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from nobubble.data import (
    DataConfig,
    encode_cached,
    fetch_shakespeare,
    gpt2_tokenizer,
    prepare_data,
    train_bpe_tokenizer,
)
from nobubble.data import tokenizer as tokenizer_mod
from nobubble.data.tokenizer import bpe_cache_path


@pytest.fixture(scope="module")
def small_text() -> str:
    """~100 kB of the default corpus: enough for a 512-token BPE, quick to train and encode."""
    return fetch_shakespeare().read_text(encoding="utf-8")[:100_000]


def test_bpe_round_trip(tmp_path: Path, small_text: str) -> None:
    tok = train_bpe_tokenizer(small_text, 512, tmp_path)
    sample = "O Romeo, Romeo! wherefore art thou Romeo?\n\n  naïve café — 日本語\ttab"
    ids = tok.encode(sample)
    assert tok.decode(ids) == sample
    assert all(0 <= i < 512 for i in ids)
    plain = small_text[:5000]
    assert len(tok.encode(plain)) < 0.6 * len(plain.encode())  # merges actually compress


def test_bpe_cache_hit_does_not_retrain(
    tmp_path: Path, small_text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = train_bpe_tokenizer(small_text, 512, tmp_path)
    path = bpe_cache_path(small_text, 512, tmp_path)
    mtime = path.stat().st_mtime_ns

    def no_training(*args: object) -> None:
        raise AssertionError("retrained although the tokenizer is cached")

    monkeypatch.setattr(tokenizer_mod, "_train_bpe", no_training)
    second = train_bpe_tokenizer(small_text, 512, tmp_path)
    assert path.stat().st_mtime_ns == mtime and second.name == first.name
    assert second.encode(small_text[:2000]) == first.encode(small_text[:2000])


def test_bpe_training_is_deterministic(tmp_path: Path, small_text: str) -> None:
    train_bpe_tokenizer(small_text, 512, tmp_path / "a")
    train_bpe_tokenizer(small_text, 512, tmp_path / "b")
    a = bpe_cache_path(small_text, 512, tmp_path / "a").read_bytes()
    assert a == bpe_cache_path(small_text, 512, tmp_path / "b").read_bytes()


def test_encoded_tokens_are_cached(
    tmp_path: Path, small_text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    tok = train_bpe_tokenizer(small_text, 512, tmp_path)
    first = encode_cached(small_text, tok, tmp_path)
    assert first.dtype == np.uint16 and first.tolist() == tok.encode(small_text)

    def no_encoding(text: str) -> list[int]:
        raise AssertionError("encoded although the tokens are cached")

    monkeypatch.setattr(tok, "encode", no_encoding)
    assert np.array_equal(encode_cached(small_text, tok, tmp_path), first)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (reference for building test vocab files)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table = {b: chr(b) for b in printable}
    extra = (b for b in range(256) if b not in table)
    table.update({b: chr(256 + n) for n, b in enumerate(extra)})
    return table


def write_tiny_gpt2_files(folder: Path) -> dict[str, int]:
    """A GPT-2-format vocab: the 256 byte symbols, then merges he, ll, hell, Ġw."""
    folder.mkdir(parents=True, exist_ok=True)
    symbols = bytes_to_unicode()
    vocab = {symbols[b]: b for b in range(256)}
    merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("Ġ", "w")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    return vocab


def test_gpt2_tokenizer_from_vocab_and_merges(tmp_path: Path) -> None:
    vocab = write_tiny_gpt2_files(tmp_path / "gpt2")
    tok = gpt2_tokenizer(str(tmp_path / "gpt2"))
    assert tok.vocab_size == 260
    assert tok.encode("hell well") == [vocab["hell"], vocab["Ġw"], vocab["e"], vocab["ll"]]
    assert tok.decode(tok.encode("hello, wörld\n")) == "hello, wörld\n"
    tok.tokenizer.save(str(tmp_path / "tokenizer.json"))
    from_json = gpt2_tokenizer(str(tmp_path / "tokenizer.json"))
    assert from_json.encode("hell well") == tok.encode("hell well")


def test_gpt2_tokenizer_from_local_hf_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ValueError, match=r"looked in: .*models--gpt2") as info:
        gpt2_tokenizer()
    assert str(tmp_path) in str(info.value) and "tokenizer_path" in str(info.value)
    vocab = write_tiny_gpt2_files(tmp_path / "hub" / "models--gpt2" / "snapshots" / "abc123")
    assert gpt2_tokenizer().encode("hell") == [vocab["hell"]]


def test_gpt2_tokenizer_missing_path_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"nope.*does not exist"):
        gpt2_tokenizer(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="no GPT-2 tokenizer files"):
        gpt2_tokenizer(str(tmp_path))


def test_prepare_with_gpt2_files(tmp_path: Path, small_text: str) -> None:
    write_tiny_gpt2_files(tmp_path / "gpt2")
    (tmp_path / "text.txt").write_text(small_text[:20_000])
    cfg = DataConfig(
        source=str(tmp_path / "text.txt"),
        tokenizer="gpt2",
        tokenizer_path=str(tmp_path / "gpt2"),
        seq_len=16,
        cache_dir=str(tmp_path / "cache"),
    )
    data = prepare_data(cfg)
    assert data.vocab_size == 260 and data.tokenizer is not None
    assert data.tokenizer.name.startswith("gpt2-")
    assert int(data.train_tokens.max()) < 260
