"""Document sources (parquet, jsonl, arrow, folders of them) tokenized with a model's tokenizer.

The reference is the ``tokenizers`` library called by hand: each document's ids, then EOS, in file
order. Files and the tokenizer are made here, tiny, with no network.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import tokenizers
from tokenizers import models, pre_tokenizers

from nobubble.core.errors import MissingExtra
from nobubble.data import DataConfig, check_vocab_fits, model_tokenizer, prepare_data
from nobubble.data.documents import document_files, scan_documents
from nobubble.data.packing import tokenize_documents
from nobubble.data.tokenizer import HFTokenizer

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

WORDS = ["the", "a", "cat", "dog", "sat", "on", "mat", "ran", "far", "away", "and", "héllo"]
VOCAB = ["[UNK]", "<eos>", *WORDS]
EOS = 1
MODEL_VOCAB = 32
VAL_FRACTION = 0.1  # DataConfig's default is 0.05: the tests pass it
_rng = np.random.default_rng(0)
DOCS = [" ".join(_rng.choice(WORDS, int(_rng.integers(1, 20)))) for _ in range(40)]


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A model folder with a word-level tokenizer.json and the EOS named in its config."""
    folder = tmp_path / "model"
    folder.mkdir()
    tok = tokenizers.Tokenizer(
        models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="[UNK]")
    )
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<eos>"}}))
    return folder


def reference(model: Path, docs: list[str]) -> np.ndarray:
    tok = tokenizers.Tokenizer.from_file(str(model / "tokenizer.json"))
    return np.array([i for d in docs for i in [*tok.encode(d, add_special_tokens=False).ids, EOS]])


def config(source: Path, model: Path, cache: Path, **kw: object) -> DataConfig:
    fields: dict = dict(tokenizer="hf", tokenizer_path=str(model), vocab_size=MODEL_VOCAB)
    fields |= dict(seq_len=4, val_fraction=VAL_FRACTION, cache_dir=str(cache))
    return DataConfig(source=str(source), **(fields | kw))


def table(docs: list[str]) -> object:
    return pa.table({"id": list(range(len(docs))), "text": docs})


def write_jsonl(path: Path, docs: list[str]) -> Path:
    lines = [json.dumps({"id": i, "text": d}, ensure_ascii=False) for i, d in enumerate(docs)]
    path.write_text("\n".join(lines) + "\n\n", encoding="utf-8")  # a trailing blank line
    return path


def write_arrow(path: Path, docs: list[str], stream: bool = False) -> Path:
    t = table(docs)
    opener = pa.ipc.new_stream if stream else pa.ipc.new_file
    with opener(str(path), t.schema) as w:
        for batch in t.to_batches(max_chunksize=6):
            w.write_batch(batch)
    return path


def save_to_disk(folder: Path, docs: list[str]) -> Path:
    """What ``datasets.Dataset.save_to_disk`` writes: arrow streams named by state.json."""
    folder.mkdir()
    names = ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]
    half = len(docs) // 2
    write_arrow(folder / names[0], docs[:half], stream=True)
    write_arrow(folder / names[1], docs[half:], stream=True)
    (folder / "dataset_info.json").write_text("{}")
    (folder / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": n} for n in names]})
    )
    return folder


def hub_cache(folder: Path, docs: list[str]) -> Path:
    """A hub-cache dataset: parquet shards under snapshots/REV/data, plus a hidden .cache."""
    data = folder / "snapshots" / "abc123" / "data"
    data.mkdir(parents=True)
    pq.write_table(table(docs[:25]), data / "train-00000-of-00002.parquet", row_group_size=4)
    pq.write_table(table(docs[25:]), data / "train-00001-of-00002.parquet")
    (folder / ".cache").mkdir()
    pq.write_table(table(["dog dog"]), folder / ".cache" / "stray.parquet")
    return folder


def make_source(kind: str, tmp_path: Path) -> Path:
    if kind == "parquet":
        path = tmp_path / "docs.parquet"
        pq.write_table(table(DOCS), path, row_group_size=7)
        return path
    if kind == "jsonl":
        return write_jsonl(tmp_path / "docs.jsonl", DOCS)
    if kind == "arrow":
        return write_arrow(tmp_path / "docs.arrow", DOCS)
    if kind == "save_to_disk":
        return save_to_disk(tmp_path / "saved", DOCS)
    return hub_cache(tmp_path / "datasets--org--name", DOCS)


def cache_files(cache: Path) -> list[Path]:
    return [p for p in cache.rglob("*") if p.is_file()] if cache.exists() else []


# ---------------------------------------------------------------- formats and packing


@pytest.mark.parametrize("kind", ["parquet", "jsonl", "arrow", "save_to_disk", "hub_cache"])
def test_documents_are_tokenized_and_joined_with_eos(
    kind: str, tmp_path: Path, model_dir: Path
) -> None:
    data = prepare_data(config(make_source(kind, tmp_path), model_dir, tmp_path / "cache"))
    num_val = math.ceil(VAL_FRACTION * len(DOCS))  # the tail documents are the validation split
    np.testing.assert_array_equal(data.train_tokens, reference(model_dir, DOCS[:-num_val]))
    np.testing.assert_array_equal(data.val_tokens, reference(model_dir, DOCS[-num_val:]))
    assert data.vocab_size == MODEL_VOCAB and data.train_tokens.dtype == np.uint16
    x, y = data.train_microbatch(0, 2)
    assert x.shape == (2, 4) and x[:, 1:].equal(y[:, :-1])


def test_streaming_reads_in_batches_and_gives_the_same_tokens(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = make_source("parquet", tmp_path)
    docs = scan_documents(document_files(str(source)), "text")
    tok = model_tokenizer(str(model_dir))
    sizes: list[int] = []
    encode = HFTokenizer.encode_documents

    def spy(self: HFTokenizer, texts: list[str]) -> list[list[int]]:
        sizes.append(len(texts))
        return encode(self, texts)

    monkeypatch.setattr(HFTokenizer, "encode_documents", spy)
    small = tokenize_documents(docs, "text", tok, VAL_FRACTION, tmp_path / "a", "k", batch_rows=3)
    assert max(sizes) == 3 and sum(sizes) == len(DOCS)
    sizes.clear()
    whole = tokenize_documents(docs, "text", tok, VAL_FRACTION, tmp_path / "b", "k", batch_rows=99)
    assert sizes == [7, 7, 7, 7, 7, 5]  # one parquet row group (7 rows) at a time
    for a, b in zip(small, whole, strict=True):
        np.testing.assert_array_equal(a, b)


def test_second_prepare_reads_the_cache_and_a_changed_file_is_tokenized_again(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    cfg = config(source, model_dir, tmp_path / "cache")
    first = prepare_data(cfg)
    calls: list[int] = []
    encode = HFTokenizer.encode_documents
    monkeypatch.setattr(
        HFTokenizer, "encode_documents", lambda s, t: calls.append(1) or encode(s, t)
    )
    second = prepare_data(cfg)
    assert calls == [] and isinstance(second.train_tokens, np.memmap)
    np.testing.assert_array_equal(first.train_tokens, second.train_tokens)
    assert second.stream_id == first.stream_id
    write_jsonl(source, DOCS[:-1])
    os.utime(source, ns=(1, 1))  # a new size and mtime: the key changes
    changed = prepare_data(cfg)
    assert calls and changed.stream_id != first.stream_id
    assert len(changed.val_tokens) + len(changed.train_tokens) < len(reference(model_dir, DOCS))


def test_a_resumed_run_reads_the_micro_batches_an_uninterrupted_one_would(
    tmp_path: Path, model_dir: Path
) -> None:
    """Micro-batch m is a pure function of (tokens, seed, m, B): a resume rebuilds TokenData
    from the cache (or tokenizes again) and asks for the next m."""
    cfg = config(make_source("parquet", tmp_path), model_dir, tmp_path / "cache")
    run = prepare_data(cfg)
    epoch = run.num_train_windows // 3 + 1  # micro-batches of 3 reach the second epoch
    straight = [run.train_microbatch(m, 3) for m in range(epoch + 2)]
    from_cache = prepare_data(cfg)
    cleared = prepare_data(config(cfg.source, model_dir, tmp_path / "fresh"))
    for resumed in (from_cache, cleared):
        for m in range(epoch - 2, epoch + 2):
            x, y = resumed.train_microbatch(m, 3)
            assert x.equal(straight[m][0]) and y.equal(straight[m][1])


# ---------------------------------------------------------------- bad inputs: refused, none written


def _write_parquet(path: Path, columns: dict) -> Path:
    pq.write_table(pa.table(columns), path)
    return path


BAD = {
    "missing column": (
        lambda p: _write_parquet(p / "d.parquet", {"body": ["a cat"], "id": [1]}),
        r"no column 'text'; its columns: \['body', 'id'\]",
    ),
    "missing field": (
        lambda p: (p / "d.jsonl").write_text('{"body": "a"}\n'),
        r"line 1 has no field 'text'; its fields: \['body'\]",
    ),
    "empty jsonl": (lambda p: (p / "d.jsonl").write_text("\n"), "holds no document"),
    "empty parquet": (
        lambda p: _write_parquet(p / "d.parquet", {"text": pa.array([], pa.string())}),
        "no document",
    ),
    "zero-byte parquet": (lambda p: (p / "d.parquet").write_bytes(b""), "not a readable parquet"),
    "empty folder": (lambda p: None, r"holds no \*.txt, .parquet, .jsonl or .arrow file"),
    "not utf-8": (
        lambda p: (p / "d.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n'),
        "line 2 is not UTF-8",
    ),
    "non-string column": (
        lambda p: _write_parquet(p / "d.parquet", {"text": [1, 2], "body": ["a", "b"]}),
        r"column 'text' of .* holds int64, not strings; its string columns: \['body'\]",
    ),
    "non-string field later": (
        lambda p: (p / "d.jsonl").write_text('{"text": "a cat"}\n{"text": "dog"}\n{"text": 7}\n'),
        "line 3: field 'text' holds int",
    ),
    "null text": (
        lambda p: _write_parquet(p / "d.parquet", {"text": ["a", None, "b"]}),
        "row 1 of column 'text' is null",
    ),
    "one document": (
        lambda p: (p / "d.jsonl").write_text('{"text": "a cat"}\n'),
        r"1 document\(s\), too few",
    ),
    "dataset dict": (
        lambda p: (save_to_disk(p / "train", DOCS), (p / "dataset_dict.json").write_text("{}")),
        r"DatasetDict folder with the splits \['train'\]; point .* at one split",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_refused_by_name_and_nothing_is_written(
    case: str, tmp_path: Path, model_dir: Path
) -> None:
    source = tmp_path / "src"
    source.mkdir()
    make, message = BAD[case]
    make(source)
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match=message):
        prepare_data(config(source, model_dir, cache))
    assert cache_files(cache) == []


def test_a_tokenizer_larger_than_the_model_is_refused_before_any_work(
    tmp_path: Path, model_dir: Path
) -> None:
    check_vocab_fits(len(VOCAB), len(VOCAB))
    with pytest.raises(ValueError, match=rf"ids reach {len(VOCAB) - 1}.* has {len(VOCAB) - 1} "):
        check_vocab_fits(len(VOCAB), len(VOCAB) - 1)
    cfg = config(make_source("parquet", tmp_path), model_dir, tmp_path / "c", vocab_size=8)
    with pytest.raises(ValueError, match=r"vocab_size\) has 8 ids; use the model's own"):
        prepare_data(cfg)
    assert cache_files(tmp_path / "c") == []


def test_documents_need_a_tokenizer_with_eos(tmp_path: Path, model_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"holds documents, not .bin token shards; set"):
        DataConfig(source=str(tmp_path / "d.parquet"), tokenizer="bin")
    with pytest.raises(ValueError, match="set tokenizer_path to the model folder"):
        DataConfig(source="x.jsonl", tokenizer="hf")
    (model_dir / "tokenizer_config.json").unlink()
    with pytest.raises(ValueError, match="names no EOS token"):
        model_tokenizer(str(model_dir))
    (model_dir / "config.json").write_text(json.dumps({"eos_token_id": [EOS, 0]}))
    assert model_tokenizer(str(model_dir)).eos_id == EOS
    with pytest.raises(ValueError, match=r"no tokenizer.json in .*save_pretrained"):
        model_tokenizer(str(tmp_path))


def test_parquet_without_pyarrow_names_the_extra(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = make_source("parquet", tmp_path)
    monkeypatch.setitem(__import__("sys").modules, "pyarrow", None)
    with pytest.raises(MissingExtra, match=r"pip install 'nobubble\[data\]'"):
        prepare_data(config(source, model_dir, tmp_path / "cache"))


def test_the_model_tokenizer_gives_the_ids_transformers_gives(model_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    ours = model_tokenizer(str(model_dir)).encode_documents(DOCS[:5])
    assert ours == [theirs.encode(d, add_special_tokens=False) for d in DOCS[:5]]


# ---------------------------------------------------------------- other tokenizers, progress


def test_without_a_model_tokenizer_a_bpe_is_trained_on_the_train_documents(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    cfg = DataConfig(str(source), vocab_size=300, seq_len=4, cache_dir=str(tmp_path / "cache"))
    data = prepare_data(cfg)
    num_val = math.ceil(cfg.val_fraction * len(DOCS))
    by_hand = tokenizers.Tokenizer(models.BPE())  # the same recipe, on the train documents
    by_hand.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    by_hand.train_from_iterator(DOCS[:-num_val], trainer=trainer)
    assert data.tokenizer.tokenizer.get_vocab() == by_hand.get_vocab()
    ref = [i for d in DOCS for i in [*by_hand.encode(d).ids, 0]]  # <|endoftext|> is id 0
    np.testing.assert_array_equal(np.concatenate([data.train_tokens, data.val_tokens]), ref)
    assert data.tokenizer.decode(by_hand.encode(DOCS[0]).ids) == DOCS[0]  # lossless
    monkeypatch.setattr(tokenizers.Tokenizer, "train_from_iterator", None)  # cached: no training
    np.testing.assert_array_equal(prepare_data(cfg).train_tokens, data.train_tokens)


def test_a_bad_record_met_while_training_the_bpe_is_refused_and_nothing_is_written(
    tmp_path: Path,
) -> None:
    source = tmp_path / "d.parquet"
    _write_parquet(source, {"text": ["a cat", "the dog", None, "a mat", "far away"]})
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match="row 2 of column 'text' is null"):
        prepare_data(DataConfig(source=str(source), vocab_size=300, cache_dir=str(cache)))
    assert cache_files(cache) == []


def test_a_model_tokenizer_also_reads_text_files(tmp_path: Path, model_dir: Path) -> None:
    (tmp_path / "a.txt").write_text("the cat sat\non a mat\n" * 20 + "the dog ran far\n" * 5)
    data = prepare_data(config(tmp_path / "a.txt", model_dir, tmp_path / "cache"))
    tok = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    text = (tmp_path / "a.txt").read_text()
    both = np.concatenate([data.train_tokens, data.val_tokens])  # split at a line start
    np.testing.assert_array_equal(both, tok.encode(text).ids)
    assert data.vocab_size == MODEL_VOCAB


@pytest.mark.parametrize("progress", [True, False])
def test_the_progress_bar_shows_when_asked(
    progress: bool, tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prepare_data(
        config(make_source("jsonl", tmp_path), model_dir, tmp_path / "c"), progress=progress
    )
    assert (f"{len(DOCS)}/{len(DOCS)}" in capsys.readouterr().err) == progress
