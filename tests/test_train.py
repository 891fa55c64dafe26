"""`nobubble train` end to end on real text: run directory, resume, bad inputs."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from nobubble.app.train.checkpoint import CheckpointError
from nobubble.app.train.config import TrainConfig
from nobubble.app.train.metrics import read_metrics
from nobubble.app.train.trainer import Trainer
from nobubble.cli import main
from nobubble.data import write_bin_shard


def small(corpus: Path, out: Path, **overrides) -> TrainConfig:
    base = dict(
        data=str(corpus),
        vocab_size=512,
        seq_len=32,
        micro_batch_size=4,
        steps=8,
        eval_every=4,
        eval_batches=2,
        checkpoint_every=4,
        stages=2,
        microbatches=2,
        lr=3e-3,
        out=str(out),
        progress=False,
        sample_tokens=16,
    )
    base.update(overrides)
    return TrainConfig.of(**base)


def test_train_writes_the_run_directory_and_learns(corpus, tmp_path):
    out = tmp_path / "run"
    result = Trainer(small(corpus, out, steps=12, lr=1e-2)).run()
    config = json.loads((out / "config.json").read_text())
    assert config["config"]["schedule"] == "paci"
    assert {"torch", "python", "nobubble", "git_revision"} <= set(config["provenance"])
    records = read_metrics(out)
    assert [r["step"] for r in records] == list(range(1, 13))
    for r in records:
        assert {"step", "loss", "lr", "tokens", "elapsed_s"} <= set(r)
    assert [r["step"] for r in records if "val_loss" in r] == [4, 8, 12]
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    assert list((out / "tb").glob("events.out.tfevents.*"))
    assert json.loads((out / "ledger.json").read_text())["summary"][0]["max_crossed"] == 1
    assert (out / "sample.txt").read_text().strip()
    assert (out / "checkpoint" / "manifest.json").is_file()
    assert result.summary["peak_weight_versions"] == [1, 1]


def _without_time(records):
    return [{k: v for k, v in r.items() if k not in ("elapsed_s", "train_s")} for r in records]


@pytest.mark.parametrize("schedule", ["2bw", "1f1b", "pipedream", "zbv"])
def test_resume_reproduces_the_uninterrupted_run_bitwise(corpus, tmp_path, schedule):
    kwargs = dict(schedule=schedule, optimizer="muon", sample_tokens=0)
    if schedule == "2bw":
        kwargs["correction"] = "ef"
    Trainer(small(corpus, tmp_path / "full", **kwargs)).run()
    Trainer(small(corpus, tmp_path / "cut", stop_at=4, **kwargs)).run()
    assert [r["step"] for r in read_metrics(tmp_path / "cut")] == [1, 2, 3, 4]
    resumed = small(corpus, tmp_path / "cut", **kwargs)
    Trainer(TrainConfig.from_mapping({"resume": str(tmp_path / "cut"), "out": None}, resumed)).run()
    full, cut = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "cut")
    assert _without_time(cut) == _without_time(full)


def _tree_digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_corrupted_or_mismatched_checkpoint_is_refused_and_left_alone(corpus, tmp_path):
    out = tmp_path / "run"
    Trainer(small(corpus, out, stop_at=4, sample_tokens=0)).run()
    part = out / "checkpoint" / "stage1.pt"
    blob = bytearray(part.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    part.write_bytes(bytes(blob))
    before = _tree_digest(out)
    with pytest.raises(CheckpointError, match="corrupted"):
        Trainer(
            TrainConfig.from_mapping(
                {"resume": str(out), "out": None}, small(corpus, out, sample_tokens=0)
            )
        )
    assert _tree_digest(out) == before
    with pytest.raises(CheckpointError, match=r"lr: checkpoint 0.003 vs now 0.001"):
        Trainer(
            TrainConfig.from_mapping(
                {"resume": str(out), "out": None, "lr": 1e-3}, small(corpus, out, sample_tokens=0)
            )
        )
    assert _tree_digest(out) == before


def test_a_checkpoint_is_a_sharded_safetensors_folder_and_a_corrupt_shard_is_refused(
    corpus, tmp_path
):
    """Each stage's weights are a safetensors shard under the model's names, listed by the index
    transformers reads; a shard whose bytes changed is refused on resume, nothing written."""
    from safetensors.torch import load_file

    out = tmp_path / "run"
    trainer = Trainer(small(corpus, out, stop_at=4, sample_tokens=0))
    trainer.run()
    folder = out / "checkpoint"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    stages = trainer.pipe.stages
    assert index["weight_map"] == {
        name: f"model-{s + 1:05d}-of-00002.safetensors"
        for s, stage in enumerate(stages)
        for name in stage.state_dict()
    }
    shard = load_file(str(folder / "model-00002-of-00002.safetensors"))
    assert all(torch.equal(shard[n], t) for n, t in stages[1].state_dict().items())
    blob = bytearray((folder / "model-00002-of-00002.safetensors").read_bytes())
    blob[-1] ^= 0xFF  # a weight's last byte
    (folder / "model-00002-of-00002.safetensors").write_bytes(bytes(blob))
    before = _tree_digest(out)
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002.safetensors.*corrupted"):
        Trainer(
            TrainConfig.from_mapping(
                {"resume": str(out), "out": None}, small(corpus, out, sample_tokens=0)
            )
        )
    assert _tree_digest(out) == before


def test_out_dir_holding_a_run_is_not_overwritten(corpus, tmp_path):
    out = tmp_path / "run"
    Trainer(small(corpus, out, steps=4, sample_tokens=0)).run()
    with pytest.raises(ValueError, match="already holds a run"):
        Trainer(small(corpus, out, steps=4, sample_tokens=0))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--optimizer", "sgd"], "invalid choice: 'sgd'"),
        (["--schedule", "zb"], "invalid choice: 'zb'"),
        (["--stages", "9"], "more than the 4 layers"),
        (["--data", "/no/such/corpus.txt"], "does not exist"),
        (["--lr", "-1"], "lr=-1.0"),
        (["--schedule", "2bw", "--stages", "4", "--microbatches", "2"], "2bw needs"),
        (["--schedule", "1f1b", "--correction", "ef"], "synchronous"),
        (["--schedule", "paci", "--clip-scope", "global"], "the stages of the asynchronous paci"),
        (["--schedule", "zbv", "--stages", "3"], "cuts the model into 6 stages (2 per rank"),
        (["--schedule", "zb-h1", "--virtual-stages", "2"], "does not apply"),
        (["--schedule", "interleaved-1f1b", "--microbatches", "5"], "equal rounds"),
        (["--schedule", "zbv", "--runtime", "dist", "--data-parallel", "2"], "one stage per rank"),
    ],
)
def test_bad_train_flags_fail_before_any_work(capsys, tmp_path, flags, message):
    out = tmp_path / "never"
    try:
        code = main(["train", "--out", str(out), *flags])
    except SystemExit as exit_:  # argparse's own choice errors
        code = exit_.code
    assert code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_bin_shard_with_a_wrong_header_is_refused(capsys, tmp_path):
    shard = tmp_path / "bad.bin"
    write_bin_shard(shard, list(range(100)))
    blob = bytearray(shard.read_bytes())
    blob[0] ^= 0x01  # break the magic number
    shard.write_bytes(bytes(blob))
    code = main(
        ["train", "--data", str(shard), "--tokenizer", "bin", "--out", str(tmp_path / "never")]
    )
    assert code == 2
    assert "magic" in capsys.readouterr().err
    assert not (tmp_path / "never").exists()


def test_sync_warmup_is_synchronous_then_delayed(corpus, tmp_path):
    # clip 0: clipping is global for 1f1b but per stage for 2bw, which would differ by itself
    warm = small(
        corpus,
        tmp_path / "warm",
        schedule="2bw",
        correction="sync-warmup",
        sync_warmup=3,
        sample_tokens=0,
        clip=0.0,
    )
    sync = small(corpus, tmp_path / "sync", schedule="1f1b", sample_tokens=0, clip=0.0)
    Trainer(warm).run()
    Trainer(sync).run()
    a, b = read_metrics(tmp_path / "warm"), read_metrics(tmp_path / "sync")
    assert [r["loss"] for r in a[:3]] == [r["loss"] for r in b[:3]]  # batches 0-2 synchronous
    assert a[3]["loss"] != b[3]["loss"]  # batch 3 reads version 2: the one-step delay begins
    ledger = json.loads((tmp_path / "warm" / "ledger.json").read_text())
    assert ledger["summary"][0]["max_delay"] == 1


def test_a_checkpoint_from_before_a_setting_existed_resumes_at_its_default(
    corpus, tmp_path, capsys
):
    """A run written before ``fused_adamw`` existed ran at its default: it resumes, and only
    resuming it with the setting changed is refused, by name."""
    out = tmp_path / "run"
    Trainer(small(corpus, out, stop_at=4, sample_tokens=0)).run()
    for name, path in (("manifest", ["fingerprint"]), ("config", ["config"])):
        file = out / "checkpoint" / "manifest.json" if name == "manifest" else out / "config.json"
        record = json.loads(file.read_text())
        del record[path[0]]["fused_adamw"]
        file.write_text(json.dumps(record))
    before = (out / "metrics.jsonl").read_bytes()
    assert main(["train", "--resume", str(out), "--fused-adamw", "true", "--no-progress"]) == 2
    assert "fused_adamw: checkpoint False vs now True" in capsys.readouterr().err
    assert (out / "metrics.jsonl").read_bytes() == before
    assert main(["train", "--resume", str(out), "--no-progress"]) == 0
    assert [r["step"] for r in read_metrics(out)] == list(range(1, 9))


def test_a_run_stopped_with_stop_at_resumes_to_its_end_from_the_command_line(
    corpus, tmp_path, capsys
):
    """``--resume DIR`` takes the saved settings, but not the planned stop that ended them."""
    out = tmp_path / "run"
    Trainer(small(corpus, out, stop_at=4, sample_tokens=0)).run()
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]
    assert main(["train", "--resume", str(out), "--no-progress"]) == 0
    assert [r["step"] for r in read_metrics(out)] == list(range(1, 9))
    capsys.readouterr()
    # resuming a finished run: a clear refusal, the run directory left as it was
    before = (out / "metrics.jsonl").read_bytes()
    assert main(["train", "--resume", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"the checkpoint in '{out}' is at step 8 and the run ends at step 8" in err
    assert "give a larger --steps" in err
    assert (out / "metrics.jsonl").read_bytes() == before


def test_a_run_builds_one_schedule_and_reports_the_one_that_ran(corpus, tmp_path, monkeypatch):
    """Every schedule generated during a run is a horizon of the pipeline's own (regenerated
    longer as batches come), none is built beside it; ledger.json is that schedule's ledger,
    through the run's last step."""
    from nobubble.api.steps import StepLoop
    from nobubble.core import schedule_spec

    generated, horizons = [], []
    generate, horizon = schedule_spec.generate_resolved, StepLoop._generate
    monkeypatch.setattr(
        schedule_spec,
        "generate_resolved",
        lambda *a, **k: generated.append(a) or generate(*a, **k),
    )
    monkeypatch.setattr(
        StepLoop, "_generate", lambda self, steps: horizons.append(steps) or horizon(self, steps)
    )
    trainer = Trainer(small(corpus, tmp_path / "run", schedule="2bw", sample_tokens=0))
    trainer.run()
    assert generated and len(generated) == len(horizons)
    assert trainer.pipe.schedule.num_steps == trainer.cfg.run.steps
    written = json.loads((tmp_path / "run" / "ledger.json").read_text())
    assert written["summary"] == json.loads(json.dumps(trainer.pipe.ledger.summary()))
