"""`nobubble train` refuses inputs it cannot run, in one line and before any work or write."""

from __future__ import annotations

import re

import pytest
import torch

import nobubble.app.train.assemble
import nobubble.app.train.config
import nobubble.core.util
from nobubble.app.train.config import TrainConfig
from nobubble.cli import main
from nobubble.data import fetch_shakespeare

GiB = 2**30


@pytest.fixture
def laptop(monkeypatch):
    """A 24 GiB machine, whatever this one holds, so refusals do not depend on the host."""
    monkeypatch.setattr(nobubble.core.util, "physical_memory_bytes", lambda: 24 * GiB)


def train(capsys, *flags: str) -> tuple[int, str]:
    code = main(["train", *flags])
    return code, capsys.readouterr().err


def test_a_sequence_that_cannot_fit_in_memory_is_refused_at_once(
    capsys, tmp_path, laptop, monkeypatch
):
    def no_data(*args, **kwargs):
        raise AssertionError("the data was prepared: the refusal came after work started")

    monkeypatch.setattr(nobubble.app.train.assemble, "prepare_data", no_data)
    out = tmp_path / "never"
    code, err = train(capsys, "--seq-len", "100000", "--steps", "1", "--out", str(out))
    assert code == 2
    assert "--seq-len 100000 with --micro-batch-size 8 needs about" in err
    assert "19.2 GiB available (80% of 24.0 GiB)" in err
    assert "Traceback" not in err
    assert not out.exists()
    longest = int(re.search(r"use --seq-len (\d+) or less", err).group(1))
    smaller = int(re.search(r"--micro-batch-size (\d+) or less", err).group(1))
    TrainConfig.of(seq_len=longest)  # what the message offers does fit
    TrainConfig.of(seq_len=100000, micro_batch_size=smaller)


def test_the_configs_of_the_tests_and_benchmarks_fit_a_small_machine(monkeypatch):
    monkeypatch.setattr(nobubble.core.util, "physical_memory_bytes", lambda: 8 * GiB)
    TrainConfig()
    TrainConfig.of(model="medium", vocab_size=2048, micro_batch_size=4, seq_len=128)
    TrainConfig.of(model="small", num_ranks=2, microbatches=4, micro_batch_size=8, seq_len=128)
    TrainConfig.of(model="mini", schedule="pipedream", num_ranks=8, accum=1, micro_batch_size=16)


def test_the_weights_alone_can_be_too_large(laptop):
    with pytest.raises(ValueError, match="use a smaller --model"):
        TrainConfig.of(model="1b", tokenizer="gpt2", seq_len=1)


def test_a_port_out_of_range_is_refused_without_a_traceback(capsys, tmp_path):
    out = tmp_path / "never"
    argv = ["--stages", "3", "--runtime", "dist", "--master-port", "99999", "--out", str(out)]
    code, err = train(capsys, *argv)
    assert code == 2
    assert (
        "--master-port 99999 is not a TCP port: use 1..65535, or 0 to let nobubble pick a free one"
        in err
    )
    assert "Traceback" not in err
    assert not out.exists()


def test_a_validation_split_shorter_than_a_micro_batch_is_refused(capsys, tmp_path):
    corpus = tmp_path / "plays.txt"
    corpus.write_text(fetch_shakespeare().read_text()[:200_000])
    out = tmp_path / "never"
    flags = ["--data", str(corpus), "--vocab-size", "512", "--micro-batch-size", "4"]
    code, err = train(capsys, *flags, "--seq-len", "2048", "--out", str(out))
    assert code == 2
    assert "--seq-len 2048 cuts the" in err
    assert "fewer than one micro-batch of --micro-batch-size 4 for evaluation" in err
    assert not out.exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--device", "cuda"], "--device cuda, but torch"),
        (["--backend", "nccl", "--device", "cpu"], "--backend nccl moves GPU tensors only"),
    ],
)
def test_a_device_or_backend_this_machine_lacks_is_refused_before_any_process_starts(
    capsys, tmp_path, monkeypatch, flags, message
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on this CPU machine
    out = tmp_path / "never"
    code, err = train(capsys, "--runtime", "dist", "--stages", "2", *flags, "--out", str(out))
    assert code == 2, err
    assert message in err and "Traceback" not in err
    assert not out.exists()


def test_more_local_ranks_than_gpus_is_refused(monkeypatch):
    from nobubble.app.ranks.runtime import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    cfg = TrainConfig.of(num_ranks=4, runtime="dist", device="cuda")
    with pytest.raises(ValueError, match="4 ranks on this machine need 4 GPUs, but 2 are visible"):
        resolve_device(cfg, local_rank=0, local_world_size=4)
    assert resolve_device(cfg, 1, 2) == (torch.device("cuda", 1), "nccl")
    with pytest.raises(ValueError, match="or --backend gloo to share the GPUs between ranks"):
        resolve_device(cfg, local_rank=0, local_world_size=4)


def test_gloo_lets_ranks_share_the_gpus(monkeypatch):
    """The one-GPU debugging mode: any number of ranks, rank r on GPU r mod the GPUs."""
    from nobubble.app.ranks.runtime import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    cfg = TrainConfig.of(num_ranks=4, runtime="dist", device="cuda", backend="gloo")
    assert [resolve_device(cfg, r, 4) for r in range(4)] == [(torch.device("cuda", 0), "gloo")] * 4


@pytest.mark.parametrize(
    ("backend", "runtime", "message"),
    [
        ("mpi", "dist", "backend='mpi' is unknown: use 'nccl', 'gloo' or None"),
        ("gloo", "emulate", "backend='gloo' applies to runtime='dist'"),
    ],
)
def test_a_bad_pipeline_backend_is_refused_before_any_work(backend, runtime, message):
    import nobubble

    stages = nobubble.split(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)), 2)
    with pytest.raises(ValueError, match=message):
        nobubble.Pipeline(stages, torch.nn.functional.mse_loss, runtime=runtime, backend=backend)


def test_nccl_for_a_stage_on_the_cpu_is_refused_before_the_group_starts(monkeypatch):
    import torch.distributed as dist

    from nobubble.runtime.distributed.join import join

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")  # nothing listens: a started group would hang
    stages = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    with pytest.raises(ValueError, match="backend='nccl' moves GPU tensors only, but this rank"):
        join(2, stages, backend="nccl")
    assert not dist.is_initialized()


def test_device_flags_with_the_emulator_are_refused():
    with pytest.raises(ValueError, match="apply to --runtime dist; the emulator runs every stage"):
        TrainConfig.of(runtime="emulate", device="cuda")
