"""The public API's optimizers on a user's own model: named ones routed and fused as asked,
a callable one used as returned. References as in test_api.py (``_api_reference``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import nobubble
from _api_reference import (
    LR,
    LiveLoop,
    M,
    assert_bitwise,
    plain_accumulation,
    run_pipeline,
    weights,
)
from nobubble.core.ledger import build_ledger
from nobubble.core.schedules import build_schedule
from test_api import SEQ, loss_fn, make_model, refuses


def test_named_optimizers_route_a_user_models_embeddings_away_from_muon():
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8), nn.Linear(8, 16))
    pipe = nobubble.Pipeline(
        nobubble.split(model, ["1"]),
        lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()),
        schedule="1f1b",
        optimizer="muon",
    )
    routing = [w.optimizer.routing for w in pipe.workers]
    assert routing[0].muon == () and routing[0].adamw == ("0.weight",)
    assert routing[1].muon == ("1.weight", "2.weight")
    ids = torch.randint(0, 16, (8, 5), generator=torch.Generator().manual_seed(0))
    assert pipe.step(ids, ids).steps == [1]


@pytest.mark.parametrize("schedule", ["1f1b", "paci"])
def test_fused_adamw_steps_as_torchs_fused_adamw_written_out(schedule):
    """optimizer_options={"fused_adamw": True}: each stage's AdamW is torch's fused kernel.
    1f1b equals plain accumulation under a fused AdamW built here (the named optimizer's groups:
    decay on matrices only, betas (0.9, 0.95)); paci the live-weight loop under the same."""

    def fused(named: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
        groups = [
            {"params": [p for _, p in named if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), eps=1e-8, fused=True)

    steps = 6
    pipe, losses, _ = run_pipeline(
        SEQ, schedule, 2, steps, optimizer="adamw", lr=LR, optimizer_options={"fused_adamw": True}
    )
    assert all(w.optimizer.parts["adamw"].defaults["fused"] for w in pipe.workers)
    if schedule == "1f1b":
        ref_losses, ref_weights = plain_accumulation(SEQ, steps, optimizer=fused)
    else:
        sched = build_schedule("paci", 2, M, steps)
        loop = LiveLoop(SEQ, sched, build_ledger(sched))
        loop.opts = [fused(list(s.named_parameters())) for s in loop.stages]
        ref = loop.run()
        ref_losses, ref_weights = ref.losses, ref.params
    assert losses == ref_losses
    assert_bitwise(weights(pipe.stages), ref_weights)


def test_fused_adamw_is_refused_for_an_optimizer_without_adamw():
    refuses(
        r"fused_adamw=True does not apply to optimizer 'lion'.*"
        r"'adamw', 'muon', 'rotation', 'normuon'",
        lambda: nobubble.Pipeline(
            nobubble.split(make_model(), 2),
            loss_fn,
            optimizer="lion",
            optimizer_options={"fused_adamw": True},
        ),
    )


def test_a_callable_optimizer_is_used_as_returned_and_the_api_adds_nothing():
    """No clipping and no lr schedule unless asked: the lr stays the optimizer's own."""
    pipe, _, _ = run_pipeline(SEQ, "1f1b", 2, 3)
    assert [w.optimizer.lr for w in pipe.workers] == [LR, LR]
    scaled, _, _ = run_pipeline(SEQ, "1f1b", 2, 3, lr_schedule=lambda step: 0.5**step)
    assert [w.optimizer.lr for w in scaled.workers] == [LR / 4] * 2
