"""Paper A's optimizers from pytorch-optimizer (the `optim` extra): SOAP, Adan, MARS, NorMuon.

The wiring is checked against closed forms (decay only, lr 0, NorMuon's update RMS) and the
library's own classes; the hand-written Lion against the library's Lion, bitwise. Tests that need
the library skip only when it is not installed; CI installs it with `.[dev]`.
"""

from __future__ import annotations

import importlib.util
import io
import sys

import pytest
import torch
from torch import nn

from nobubble.app.train.config import TrainConfig
from nobubble.app.train.metrics import read_metrics
from nobubble.app.train.trainer import Trainer
from nobubble.cli import main
from nobubble.core.errors import MissingExtra
from nobubble.model import GPT, model_config
from nobubble.optim import OptimConfig, build_optimizer
from nobubble.optim.library import LIBRARY_OPTIMIZERS
from test_train import _without_time, small

HAVE_LIBRARY = importlib.util.find_spec("pytorch_optimizer") is not None
needs_library = pytest.mark.skipif(
    not HAVE_LIBRARY, reason="the optim extra is not installed: pip install 'nobubble[optim]'"
)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return GPT(model_config("tiny", 128, 16))


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x.roll(-1, 1).ravel())


def _batch(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(seed))


# ----- a missing extra --------------------------------------------------------------------------
@pytest.mark.parametrize("name", LIBRARY_OPTIMIZERS)
def test_a_missing_library_is_refused_naming_the_extra(name, monkeypatch):
    monkeypatch.setitem(sys.modules, "pytorch_optimizer", None)  # as if not installed
    with pytest.raises(MissingExtra, match=r"pip install 'nobubble\[optim\]'"):
        OptimConfig(name=name)
    with pytest.raises(MissingExtra, match=rf"optimizer {name!r} comes from the pytorch-optimizer"):
        TrainConfig.of(optimizer=name, progress=False)


def test_train_without_the_library_exits_2_before_any_work(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "pytorch_optimizer", None)
    out = tmp_path / "never"
    assert main(["train", "--optimizer", "soap", "--out", str(out), "--no-progress"]) == 2
    assert "pip install 'nobubble[optim]'" in capsys.readouterr().err
    assert not out.exists()


def test_the_longer_regime_without_the_library_exits_2_before_any_run(
    monkeypatch, tmp_path, capsys
):
    """Its grids run SOAP: a missing extra is named before the lr sweep starts."""
    monkeypatch.setitem(sys.modules, "pytorch_optimizer", None)
    out = tmp_path / "never"
    argv = ["experiment", "error-feedback", "--regime", "long", "--out", str(out)]
    assert main(argv) == 2
    assert "optimizer 'soap' comes from the pytorch-optimizer" in capsys.readouterr().err
    assert not out.exists()


def test_the_core_optimizers_need_no_library(monkeypatch):
    monkeypatch.setitem(sys.modules, "pytorch_optimizer", None)
    for name in ("adamw", "muon", "nadam", "lion"):
        build_optimizer(OptimConfig(name=name), _model().named_parameters())


def test_adan_refuses_a_pair_of_betas():
    with pytest.raises(ValueError, match="adan: it has three betas"):
        OptimConfig(name="adan", betas=(0.9, 0.95))


# ----- Lion: the hand-written one against the library's ----------------------------------------
@needs_library
def test_hand_written_lion_equals_the_library_lion_bitwise():
    import pytorch_optimizer

    ours, theirs = _model(), _model()
    opt = build_optimizer(OptimConfig(name="lion", lr=1e-3), ours.named_parameters())
    decay = [p for p in theirs.parameters() if p.ndim == 2]
    gains = [p for p in theirs.parameters() if p.ndim != 2]
    ref = pytorch_optimizer.Lion(
        [{"params": decay, "weight_decay": 0.1}, {"params": gains, "weight_decay": 0.0}],
        lr=1e-3,
        betas=(0.9, 0.99),  # Lion's paper (arXiv 2302.06675), nobubble's default
    )
    for step in range(12):
        lr = 1e-3 * (step + 1) / 12  # a schedule that moves every step
        opt.set_lr(lr)
        for group in ref.param_groups:
            group["lr"] = lr
        for model, o in ((ours, opt), (theirs, ref)):
            _loss(model, _batch(step)).backward()
            o.step()
            o.zero_grad()
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a, b), name
        assert torch.equal(opt.parts["adamw"].state[a]["exp_avg"], ref.state[b]["exp_avg"]), name


# ----- the library optimizers' wiring ----------------------------------------------------------
@needs_library
@pytest.mark.parametrize("name", LIBRARY_OPTIMIZERS)
def test_zero_gradients_move_only_by_decoupled_decay_on_matrices(name):
    """With every gradient 0 the update is 0, so a step is decay alone: 2-D tensors other than
    NorMuon's (the AdamW side's embedding and head too) shrink by (1 - lr * wd), norm gains stay.
    SOAP's first step only builds its preconditioner, so it decays from its second step on."""
    model = _model()
    lr, wd = 1e-2, 0.1
    opt = build_optimizer(OptimConfig(name=name, lr=lr, weight_decay=wd), model.named_parameters())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    steps = 3
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
    decays = steps - 1 if name == "soap" else steps
    matrices = set(opt.routing.muon)  # NorMuon orthogonalizes a zero matrix: checked below
    for n, p in model.named_parameters():
        if n in matrices:
            continue
        expected = before[n].clone()
        if p.ndim == 2:
            for _ in range(decays):
                expected.mul_(1.0 - lr * wd)
        assert torch.allclose(p, expected, rtol=1e-6, atol=0), n


@needs_library
@pytest.mark.parametrize("name", LIBRARY_OPTIMIZERS)
def test_the_schedule_sets_every_groups_lr(name):
    """lr 0 from the schedule must stop every tensor, the MARS 1-D side and NorMuon included."""
    model = _model()
    opt = build_optimizer(OptimConfig(name=name, lr=1e-2), model.named_parameters())
    for step in range(3):
        _loss(model, _batch(step)).backward()
        opt.step()
        opt.zero_grad()
    opt.set_lr(0.0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _loss(model, _batch(9)).backward()
    opt.step()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n


@needs_library
def test_normuon_steps_the_hidden_matrices_at_adamws_update_rms():
    import pytorch_optimizer

    model = _model()
    lr = 1e-2
    opt = build_optimizer(
        OptimConfig(name="normuon", lr=lr, weight_decay=0.0), model.named_parameters()
    )
    assert isinstance(opt.parts["muon"], pytorch_optimizer.NorMuon)
    assert isinstance(opt.parts["adamw"], torch.optim.AdamW)
    assert opt.routing.muon and all(n.startswith("layers.") for n in opt.routing.muon)
    assert {"embed.weight", "head.weight"} <= set(opt.routing.adamw)
    by_name = dict(model.named_parameters())
    before = {n: by_name[n].detach().clone() for n in opt.routing.muon}
    _loss(model, _batch()).backward()
    opt.step()
    for n in opt.routing.muon:  # match_rms: the update's RMS is 0.2, as Muon's matched to AdamW
        rms = (by_name[n] - before[n]).square().mean().sqrt().item()
        assert rms == pytest.approx(0.2 * lr, rel=1e-3), n


@needs_library
@pytest.mark.parametrize("name", LIBRARY_OPTIMIZERS)
def test_state_survives_a_weights_only_checkpoint(name):
    """Save after 4 steps, load into a fresh optimizer (torch.load weights_only, as checkpoint.py
    does), continue: the same bits as the uninterrupted run."""
    batches = [_batch(s) for s in range(8)]

    def train(model, opt, xs):
        for x in xs:
            _loss(model, x).backward()
            opt.step()
            opt.zero_grad()

    cfg = OptimConfig(name=name, lr=3e-3)
    full = _model()
    train(full, opt := build_optimizer(cfg, full.named_parameters()), batches)
    cut = _model()
    first = build_optimizer(cfg, cut.named_parameters())
    train(cut, first, batches[:4])
    blob = io.BytesIO()
    torch.save(first.state_dict(), blob)
    blob.seek(0)
    second = build_optimizer(cfg, cut.named_parameters())
    second.load_state_dict(torch.load(blob, weights_only=True))
    train(cut, second, batches[4:])
    for (n, a), b in zip(full.named_parameters(), cut.parameters(), strict=True):
        assert torch.equal(a, b), n
    assert opt.state_dict()["optimizer"] == name


@needs_library
@pytest.mark.parametrize("name", LIBRARY_OPTIMIZERS)
def test_each_library_optimizer_learns(name):
    model = _model()
    opt = build_optimizer(OptimConfig(name=name, lr=3e-3), model.named_parameters())
    x = _batch()
    losses = []
    for _ in range(12):
        loss = _loss(model, x)
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert losses[-1] < losses[0] - 0.5, losses


@needs_library
@pytest.mark.parametrize("name", ["soap", "normuon"])
def test_a_delayed_pipeline_trains_and_resumes_bitwise_with_a_library_optimizer(
    name, tmp_path, corpus
):
    """2bw + EF on two stages: the run learns, and a run stopped at a checkpoint and resumed
    gives the uninterrupted run's metrics (the optimizer state round-trips through the
    checkpoint)."""
    kwargs = dict(schedule="2bw", correction="ef", optimizer=name, sample_tokens=0)
    Trainer(small(corpus, tmp_path / "full", **kwargs)).run()
    Trainer(small(corpus, tmp_path / "cut", stop_at=4, **kwargs)).run()
    resumed = small(corpus, tmp_path / "cut", **kwargs)
    Trainer(TrainConfig.from_mapping({"resume": str(tmp_path / "cut"), "out": None}, resumed)).run()
    full, cut = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "cut")
    assert _without_time(cut) == _without_time(full)
    assert full[-1]["loss"] < full[0]["loss"]
