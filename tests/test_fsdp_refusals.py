"""Sharding within a stage (``shard="fsdp"``), refused before any work: without replicas, with
an optimizer not written for shards, with tied parameters, a scalar parameter, and bad flags on
the command line (nothing written). The sharded runs themselves: test_fsdp.py."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import nobubble


def _stages() -> list[nn.Module]:
    torch.manual_seed(0)
    return nobubble.split(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)), ["2"])


def test_shard_without_replicas_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"shard='fsdp'.*data_parallel=1: use data_parallel >= 2"):
        nobubble.Pipeline(_stages(), nn.functional.mse_loss, runtime="dist", shard="fsdp")
    with pytest.raises(ValueError, match="needs runtime='dist'"):
        nobubble.Pipeline(_stages(), nn.functional.mse_loss, data_parallel=2, shard="fsdp")
    with pytest.raises(ValueError, match="shard='zero' is unknown: use 'none' or 'fsdp'"):
        nobubble.Pipeline(_stages(), nn.functional.mse_loss, shard="zero")


@pytest.mark.parametrize("optimizer", ["soap", "normuon", "adan", "mars"])
def test_an_optimizer_not_written_for_shards_is_refused_with_the_fix(optimizer):
    with pytest.raises(ValueError, match=rf"optimizer='{optimizer}' with shard='fsdp'.*muon"):
        nobubble.Pipeline(
            _stages(),
            nn.functional.mse_loss,
            runtime="dist",
            data_parallel=2,
            shard="fsdp",
            optimizer=optimizer,
        )


def test_tied_parameters_with_shard_are_refused_with_the_fix():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    stages = nobubble.split(model, ["2"])
    with torch.no_grad():
        stages[1][0].weight.copy_(stages[0][0].weight)
    stages[1].tied_parameters = {"2.weight": "0.weight"}
    with pytest.raises(ValueError, match=r"tied to 0.weight of stage 0: shard='fsdp'.*untie"):
        nobubble.Pipeline(
            stages, nn.functional.mse_loss, runtime="dist", data_parallel=2, shard="fsdp"
        )


def test_a_scalar_parameter_is_refused_before_fsdp_touches_the_stage():
    from nobubble.runtime.distributed.fsdp import shard_stage

    stage = nn.Linear(3, 3)
    stage.scale = nn.Parameter(torch.tensor(1.0))
    with pytest.raises(ValueError, match="'scale' is a scalar: FSDP2 shards dim 0"):
        shard_stage(stage, None, 1.0, 0)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--shard", "fsdp", "--runtime", "dist"], "shard='fsdp' .* use data_parallel >= 2"),
        (
            ["--shard", "fsdp", "--runtime", "dist", "--data-parallel", "2", "--optimizer", "soap"],
            "optimizer='soap' with shard='fsdp'",
        ),
        (
            ["--shard", "fsdp", "--runtime", "dist", "--data-parallel", "2", "--schedule", "zbv"],
            "data parallelism runs one stage per rank",
        ),
    ],
)
def test_bad_shard_flags_are_refused_before_anything_is_written(flags, message, tmp_path, capsys):
    from nobubble.cli import main

    out = tmp_path / "run"
    assert main(["train", *flags, "--out", str(out)]) == 2
    assert re.search(message, capsys.readouterr().err)
    assert not out.exists()
