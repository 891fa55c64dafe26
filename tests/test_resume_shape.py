"""A checkpoint resumed at another pipeline depth: each parameter's weights, optimizer state and
correction buffers move with it by name. The reference is the uninterrupted run at the depth the
checkpoint was written at."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import nobubble
from nobubble.app.train.config import TrainConfig
from nobubble.app.train.metrics import read_metrics
from nobubble.app.train.trainer import Trainer
from nobubble.cli import main
from nobubble.optim.registry import OPTIMIZER_ENTRIES


def tiny(corpus: Path, out: Path, **overrides: object) -> TrainConfig:
    base = dict(
        data=str(corpus),
        vocab_size=512,
        seq_len=16,
        micro_batch_size=2,
        steps=4,
        eval_every=2,
        eval_batches=1,
        checkpoint_every=2,
        stages=2,
        microbatches=4,
        out=str(out),
        progress=False,
        sample_tokens=0,
    )
    return TrainConfig.of(**(base | overrides))


def losses(run: Path) -> list[tuple[float, float | None]]:
    return [(r["loss"], r.get("val_loss")) for r in read_metrics(run)]


def cut_and_resume(corpus: Path, tmp: Path, stages: int, **kw: object) -> tuple[list, list]:
    """The uninterrupted run at P=2, and one stopped at step 2 then resumed at ``stages``."""
    Trainer(tiny(corpus, tmp / "full", **kw)).run()
    Trainer(tiny(corpus, tmp / "cut", stop_at=2, **kw)).run()
    resumed = tiny(corpus, tmp / "cut", stages=stages, **kw)
    Trainer(TrainConfig.from_mapping({"resume": str(tmp / "cut"), "out": None}, resumed)).run()
    return losses(tmp / "full"), losses(tmp / "cut")


@pytest.mark.parametrize(
    "schedule, optimizer, correction",
    [("1f1b", "adamw", "none"), ("1f1b", "muon", "none"), ("2bw", "adamw", "ef")],
)
def test_a_run_resumed_at_four_stages_is_the_two_stage_run_bitwise(
    corpus, tmp_path, schedule, optimizer, correction
):
    """Without clipping, nothing sums across stages: P=2 then P=4 is the P=2 run, bit for bit
    (Adam's exp_avg and exp_avg_sq, Muon's momentum, 2BW's previous version and error
    feedback's buffers moved by name; 2BW's delay is 1 on every stage at any depth)."""
    full, cut = cut_and_resume(
        corpus, tmp_path, 4, schedule=schedule, optimizer=optimizer, correction=correction, clip=0
    )
    assert len(cut) == 4 and cut == full


def test_with_global_clipping_the_resumed_run_is_within_float_rounding(corpus, tmp_path):
    """Global clipping sums the stages' squared norms: 4 terms instead of 2 round differently,
    which the clipped update carries on (seen: 2.4e-7 on a loss of 5.9 over 8 steps)."""
    full, cut = cut_and_resume(corpus, tmp_path, 4, schedule="1f1b", clip=1.0)
    assert len(cut) == 4
    for (a, va), (b, vb) in zip(full, cut, strict=True):
        assert math.isclose(a, b, rel_tol=1e-6)
        assert (va is None) == (vb is None) and (va is None or math.isclose(va, vb, rel_tol=1e-6))


def test_a_plain_resume_after_a_reshaped_one_keeps_the_new_depth(corpus, tmp_path, capsys):
    """The run directory's config takes the new split: ``--resume`` alone goes on at P=4, and
    any other change is still refused by name."""
    Trainer(tiny(corpus, tmp_path / "run", steps=6, stop_at=2, schedule="1f1b")).run()
    argv = ["train", "--resume", str(tmp_path / "run"), "--no-progress"]
    assert main([*argv, "--stages", "4", "--stop-at", "4"]) == 0
    assert main(argv) == 0
    assert TrainConfig.load(tmp_path / "run" / "config.json")["config"]["num_ranks"] == 4
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == list(range(1, 7))
    capsys.readouterr()
    assert main([*argv, "--steps", "8", "--schedule", "gpipe"]) == 2
    assert "schedule: checkpoint '1f1b' vs now 'gpipe'" in capsys.readouterr().err


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))


def trained(schedule: str, stages: int, **kw: object) -> nobubble.Pipeline:
    pipe = nobubble.Pipeline(
        nobubble.split(make_model(), stages), F.mse_loss, schedule=schedule, microbatches=4, **kw
    )
    for _ in range(3):
        pipe.step(torch.randn(8, 8), torch.randn(8, 8))
    pipe.drain()
    return pipe


def test_a_checkpoint_not_at_a_drain_point_is_refused_with_the_reason():
    state = trained("pipedream", 2).state_dict()
    state["stages"][1]["versions"]["current"] -= 1  # stage 1 one update behind stage 0
    deeper = nobubble.Pipeline(nobubble.split(make_model(), 4), F.mse_loss, schedule="pipedream")
    with pytest.raises(
        ValueError, match=r"disagree on their weight version \(\[2, 3\]\).*not drained"
    ):
        deeper.load_state_dict(state)


def test_predicted_weights_and_a_users_torch_optimizer_do_not_move():
    state = trained("2bw", 2, correction="predict").state_dict()
    deeper = nobubble.Pipeline(nobubble.split(make_model(), 4), F.mse_loss, schedule="2bw")
    with pytest.raises(ValueError, match=r"predicted weights .*--correction predict"):
        deeper.load_state_dict(state)

    def sgd(params):
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    state = trained("1f1b", 2, optimizer=sgd).state_dict()
    deeper = nobubble.Pipeline(nobubble.split(make_model(), 4), F.mse_loss, optimizer=sgd)
    with pytest.raises(ValueError, match=r"user's torch optimizer .* keys by position"):
        deeper.load_state_dict(state)


def _continued(pipe: nobubble.Pipeline, state: dict) -> dict[str, torch.Tensor]:
    pipe.load_state_dict(state)
    torch.manual_seed(1)
    for _ in range(2):
        pipe.step(torch.randn(8, 8), torch.randn(8, 8))
    pipe.drain()
    return pipe.merged_state_dict()


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZER_ENTRIES))
def test_every_registered_optimizers_state_moves_by_name(optimizer):
    """Every optimizer of the registry (the library's SOAP with its per-matrix state
    included): continuing at P=4 gives the weights continuing at P=2 gives."""
    if OPTIMIZER_ENTRIES[optimizer].library:
        pytest.importorskip("pytorch_optimizer")
    kw = dict(schedule="1f1b", microbatches=4, optimizer=optimizer, clip=None)
    state = trained("1f1b", 2, optimizer=optimizer, clip=None).state_dict()
    same = nobubble.Pipeline(nobubble.split(make_model(), 2), F.mse_loss, **kw)
    deeper = nobubble.Pipeline(nobubble.split(make_model(), 4), F.mse_loss, **kw)
    expected, got = _continued(same, state), _continued(deeper, state)
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        assert torch.equal(tensor, got[name]), name


@pytest.mark.slow
def test_the_multi_process_runtime_resumes_a_checkpoint_at_another_depth(corpus, tmp_path):
    """Written by the emulator at P=4, resumed by two processes at P=2 (each rank reads every
    saved part and keeps its own parameters' state): the uninterrupted run's numbers, bitwise."""
    from _dist_helpers import run_train

    kw = dict(schedule="1f1b", clip=0, threads=1)
    Trainer(tiny(corpus, tmp_path / "full", stages=4, **kw)).run()
    Trainer(tiny(corpus, tmp_path / "cut", stages=4, stop_at=2, **kw)).run()
    done = run_train("--resume", str(tmp_path / "cut"), "--runtime", "dist", "--stages", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert losses(tmp_path / "cut") == losses(tmp_path / "full")  # grad_norm: one per stage
    config = TrainConfig.load(tmp_path / "cut" / "config.json")["config"]
    assert config["num_ranks"] == 2 and config["runtime"] == "dist"
