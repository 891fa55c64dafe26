"""`nobubble train` on a parquet folder with a Hugging Face model's own tokenizer: the run, its
resume at another depth (tied embeddings across the new split), and bad input refused with
exit code 2 and nothing written."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import tokenizers
from tokenizers import models, pre_tokenizers

from nobubble.app.train.metrics import read_metrics
from nobubble.cli import main

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
transformers = pytest.importorskip("transformers")

WORDS = ["the", "a", "cat", "dog", "sat", "on", "mat", "ran", "far", "away", "and", "héllo"]
VOCAB = ["[UNK]", "<eos>", *WORDS]
_rng = np.random.default_rng(0)
DOCS = [" ".join(_rng.choice(WORDS, int(_rng.integers(3, 30)))) for _ in range(300)]


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A tied 4-layer Llama config (vocabulary 32) with a word-level tokenizer.json."""
    folder = tmp_path / "model"
    transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
        tie_word_embeddings=True,
    ).save_pretrained(folder)
    tok = tokenizers.Tokenizer(
        models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="[UNK]")
    )
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return folder


@pytest.fixture
def parquet_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "corpus"
    folder.mkdir()
    for k in range(2):
        part = DOCS[k * 150 : (k + 1) * 150]
        table = pa.table({"id": list(range(len(part))), "text": part})
        pq.write_table(table, folder / f"train-{k:05d}-of-00002.parquet")
    return folder


def argv(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    flags = "--schedule 1f1b --stages 2 --steps 4 --eval-every 2 --checkpoint-every 2"
    flags += " --micro-batch-size 2 --microbatches 2 --seq-len 8 --eval-batches 1"
    flags += " --sample-tokens 0 --no-progress"
    head = ["train", "--model", f"hf:{model}", "--data", str(data), "--out", str(out)]
    return [*head, *flags.split(), *extra]


def test_a_parquet_folder_trains_with_the_models_tokenizer_and_resumes_at_another_depth(
    model_dir, parquet_dir, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("NOBUBBLE_CACHE", str(tmp_path / "cache"))
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert main(argv(model_dir, parquet_dir, full)) == 0
    config = json.loads((full / "config.json").read_text())
    assert config["resolved"]["vocab_size"] == 32  # the model's vocabulary, not --vocab-size
    assert main(argv(model_dir, parquet_dir, cut, "--stop-at", "2")) == 0
    manifest = json.loads((cut / "checkpoint" / "manifest.json").read_text())
    assert manifest["data_stream"]  # the documents' cache key, compared on resume

    # a changed corpus is refused by name, the run directory left as it was
    extra = parquet_dir / "train-extra.parquet"
    pq.write_table(pa.table({"id": [0], "text": ["the cat sat on the mat"]}), extra)
    before = (cut / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    assert main(["train", "--resume", str(cut), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "trained on the token stream" in err and "start a new run with another --out" in err
    assert (cut / "metrics.jsonl").read_bytes() == before
    extra.unlink()

    assert main(["train", "--resume", str(cut), "--stages", "4", "--no-progress"]) == 0
    a, b = read_metrics(full), read_metrics(cut)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for x, y in zip(a, b, strict=True):  # global clipping: 4 stages' norms sum in another order
        assert math.isclose(x["loss"], y["loss"], rel_tol=1e-6)


def test_a_missing_text_column_exits_2_and_writes_nothing(
    model_dir, parquet_dir, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("NOBUBBLE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    assert main(argv(model_dir, parquet_dir, out, "--text-column", "body")) == 2
    err = capsys.readouterr().err
    assert "'body'" in err and "'text'" in err  # the missing column and the ones there are
    assert not out.exists()


def test_the_hf_tokenizer_without_an_hf_model_exits_2_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--tokenizer", "hf", "--out", str(out), "--no-progress"]) == 2
    assert "--tokenizer hf reads the tokenizer.json of --model hf:PATH" in capsys.readouterr().err
    assert not out.exists()
