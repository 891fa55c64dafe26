"""Weights a stage at a time: a process reads only its stages' tensors from a Hugging Face folder
(one safetensors file, or shards with their index), bad folders are refused before anything is
read, and a run's sharded checkpoint and export round-trip through transformers' own loader.

References: transformers' ``from_pretrained`` (the values, and the logits of the export), and the
emulator for ``nobubble train --runtime dist`` reading its stages from a sharded folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import nobubble
from nobubble.api.weights import WeightsError
from nobubble.hf import meta_model

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")


def config(tied: bool, hidden: int = 32, vocab: int = 64) -> object:
    return transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
        tie_word_embeddings=tied,
    )  # fmt: skip


def saved(
    folder: Path, tied: bool, shard: str | None = None, hidden: int = 32, vocab: int = 64
) -> Path:
    """A normally built Llama saved by transformers (sharded when ``shard`` is a size)."""
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(config(tied, hidden, vocab))
    options = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(folder, **options)
    return folder


class Recorder:
    """safetensors' ``safe_open``, recording which files were opened and which tensors read."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.files: set[str] = set()
        self.tensors: list[str] = []
        original = safetensors.safe_open
        recorder = self

        class Opened:
            def __init__(self, path: str, **kwargs: object) -> None:
                recorder.files.add(Path(path).name)
                self.inner = original(path, **kwargs)

            def keys(self) -> list[str]:
                return list(self.inner.keys())

            def get_slice(self, name: str) -> object:
                return self.inner.get_slice(name)

            def get_tensor(self, name: str) -> torch.Tensor:
                recorder.tensors.append(name)
                return self.inner.get_tensor(name)

        monkeypatch.setattr(safetensors, "safe_open", Opened)


@pytest.mark.parametrize(
    ("tied", "shard"), [(False, None), (True, None), (False, "40KB"), (True, "40KB")]
)
def test_each_stage_reads_only_its_own_tensors(tmp_path, monkeypatch, tied, shard):
    folder = saved(tmp_path / "model", tied, shard)
    sharded = (folder / "model.safetensors.index.json").is_file()
    assert sharded == (shard is not None)
    weight_map = (
        json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
        if sharded
        else None
    )
    reference = nobubble.split(
        transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), 3
    )
    for k in range(3):
        recorder = Recorder(monkeypatch)
        stages = nobubble.split(meta_model(str(folder)), 3)
        nobubble.materialize(stages, k, weights=folder)
        ours, theirs = dict(stages[k].named_parameters()), dict(reference[k].named_parameters())
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[n], theirs[n]) for n in ours), k
        buffers = dict(reference[k].named_buffers())
        assert all(torch.equal(b, buffers[n]) for n, b in stages[k].named_buffers())
        # read: the stage's own persistent tensors; a tied head reads the embedding's
        wanted = set(stages[k].state_dict())
        if tied and k == 2:
            wanted = (wanted - {"lm_head.weight"}) | {"model.embed_tokens.weight"}
        assert sorted(recorder.tensors) == sorted(wanted)
        if weight_map is not None:  # and opened only the shards that hold them
            assert recorder.files == {weight_map[n] for n in wanted}
        assert all(p.is_meta for i, s in enumerate(stages) if i != k for p in s.parameters()), (
            "the other stages stay on meta"
        )


def test_bad_folders_are_refused_before_anything_is_read(tmp_path):
    folder = saved(tmp_path / "sharded", False, "40KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())

    def attempt(path: Path) -> list:
        stages = nobubble.split(meta_model(str(folder)), 3)
        nobubble.materialize(stages, 1, weights=path)
        return stages

    shards = sorted(set(index["weight_map"].values()))
    gone = tmp_path / "gone"
    gone.mkdir()
    for f in folder.iterdir():
        (gone / f.name).write_bytes(f.read_bytes())
    (gone / shards[-1]).unlink()
    with pytest.raises(WeightsError, match=rf"names {shards[-1]}, missing from .*copy the whole"):
        attempt(gone)
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    for f in folder.iterdir():
        (wrong / f.name).write_bytes(f.read_bytes())
    index["weight_map"]["model.layers.1.mlp.up_proj.weight"] = "model-nope.safetensors"
    (wrong / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightsError, match=r"names model-nope.safetensors, missing"):
        attempt(wrong)
    other = saved(tmp_path / "other", False, hidden=48)  # another config's weights
    with pytest.raises(
        WeightsError, match=r"q_proj.weight has shape \[48, 48\] in .* the model.s is \[32, 32\]"
    ):
        attempt(other)
    from safetensors.torch import load_file, save_file

    short = tmp_path / "short"
    short.mkdir()
    tensors = load_file(str(saved(tmp_path / "single", False) / "model.safetensors"))
    del tensors["model.layers.1.self_attn.q_proj.weight"]
    save_file(tensors, str(short / "model.safetensors"))
    with pytest.raises(WeightsError, match=r"lacks 1 tensor.*layers.1.self_attn.q_proj.weight"):
        attempt(short)
    stages = nobubble.split(meta_model(str(folder)), 3)
    with pytest.raises(WeightsError, match=r"holds no model.safetensors"):
        nobubble.materialize(stages, 1, weights=tmp_path)
    assert all(p.is_meta for p in stages[1].parameters())  # nothing half-loaded


def test_pytorch_bin_weights_are_named_with_the_conversion(tmp_path):
    from nobubble.hf import weights_of

    folder = tmp_path / "bin"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config(False)).save_pretrained(folder)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(data)  # only its name matters here
    with pytest.raises(ValueError, match=r"pytorch_model.bin.*save it as safetensors"):
        weights_of(str(folder))


# ----- a run, end to end: per-stage loading, sharded checkpoint, export ------------------------
@pytest.mark.slow
def test_dist_run_reads_a_sharded_folder_per_stage_and_its_export_reloads(tmp_path):
    """``nobubble train --model hf:SHARDED --runtime dist`` (paci, 3 ranks, untied Llama read a
    stage per rank) equals the emulator (which loads the whole model with from_pretrained),
    bitwise; its checkpoint is sharded safetensors with an index; ``nobubble export`` of it
    loads with from_pretrained and gives the logits of the checkpoint's stages."""
    from _dist_helpers import load_parts, numbers, run_train, small_flags
    from nobubble.app.train.metrics import read_metrics
    from nobubble.cli import main
    from nobubble.data import fetch_shakespeare

    corpus = tmp_path / "plays.txt"
    corpus.write_text(fetch_shakespeare().read_text()[:200_000])
    folder = saved(tmp_path / "model", False, "100KB", vocab=512)
    flags = small_flags(corpus, "paci", 3, microbatches=3, vocab_size=512, seq_len=16)
    flags += ["--model", f"hf:{folder}"]
    dist_dir, emu_dir = tmp_path / "dist", tmp_path / "emu"
    done = run_train(*flags, "--runtime", "dist", "--out", str(dist_dir))
    assert done.returncode == 0, done.stderr[-3000:]
    assert main(["train", *flags, "--runtime", "emulate", "--out", str(emu_dir)]) == 0
    assert numbers(read_metrics(dist_dir)) == numbers(read_metrics(emu_dir))
    for d, e in zip(load_parts(dist_dir, 3), load_parts(emu_dir, 3), strict=True):
        assert d["module"].keys() == e["module"].keys()
        assert all(torch.equal(d["module"][n], e["module"][n]) for n in d["module"])
    checkpoint = dist_dir / "checkpoint"
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [
        f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)
    ]
    summary = json.loads((dist_dir / "summary.json").read_text())
    assert [m["rank"] for m in summary["memory"]] == [0, 1, 2]
    out = tmp_path / "export"
    assert main(["export", str(dist_dir), "--hf", str(out)]) == 0
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    stages = nobubble.split(meta_model(str(folder)), 3)
    nobubble.materialize(stages, [0, 1, 2], weights=checkpoint)  # the checkpoint, per stage
    x = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(reloaded(x).logits, stages[2](stages[1](stages[0](x))))
