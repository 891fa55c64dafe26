"""Gradient-accumulation fusion (``Pipeline(fused_grad_accumulation=True)``): Linear and
Embedding layers add their weight gradient into ``.grad`` inside the backward. It trains as the
independent references do (plain accumulation, the delayed loop, PACI's live-weight loop) up to
the order of the additions, allocates no fresh gradient of a weight once ``.grad`` exists, and is
refused where it cannot apply."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import nobubble
from _api_reference import (
    LiveLoop,
    M,
    Problem,
    delayed_loop,
    plain_accumulation,
    run_pipeline,
    weights,
)
from nobubble.core.ledger import build_ledger
from nobubble.core.schedules import build_schedule
from nobubble.engine.grad_fusion import fuse_grad_accumulation
from test_api import loss_fn, make_model, refuses

VOCAB, DIM, PAD = 24, 16, 0


def token_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(VOCAB, DIM, padding_idx=PAD),
        nn.Linear(DIM, 32),
        nn.Tanh(),
        nn.Linear(32, 32, bias=False),
        nn.GELU(),
        nn.Linear(32, VOCAB),
    )


def token_batch(j: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(j)
    ids = torch.randint(0, VOCAB, (8, 6), generator=gen)
    ids[:, -1] = PAD  # padding rows: no gradient into the padding row
    return ids, torch.randint(0, VOCAB, (8, 6), generator=gen)


def token_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


TOKENS = Problem(
    token_model, lambda model, n: nobubble.split(model, {2: ["3"]}[n]), token_batch, token_loss
)
STEPS = 6


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Equal up to the order of float additions (fp32, a few steps of AdamW)."""
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("schedule", ["1f1b", "2bw", "paci"])
def test_fused_grad_accumulation_trains_as_the_reference(schedule):
    pipe, losses, _ = run_pipeline(TOKENS, schedule, 2, STEPS, fused_grad_accumulation=True)
    assert pipe.fused_layers == {0: ["0", "1"], 1: ["3", "5"]}
    if schedule == "1f1b":
        ref_losses, ref_weights = plain_accumulation(TOKENS, STEPS)
    elif schedule == "2bw":
        ref_losses, ref_weights = delayed_loop(TOKENS, STEPS)
    else:
        sched = build_schedule("paci", 2, M, STEPS)
        ref = LiveLoop(TOKENS, sched, build_ledger(sched)).run()
        ref_losses, ref_weights = ref.losses, ref.params
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert_close(weights(pipe.stages), ref_weights)
    assert pipe.merged_state_dict().keys() == token_model().state_dict().keys()
    ids, targets = token_batch(0)
    assert torch.isfinite(torch.tensor(pipe.evaluate(ids, targets)))  # forward-only path


class Allocations(TorchDispatchMode):
    """The shapes of the new tensors ops return while it is active (not an in-place op's
    result or a view: those share an argument's storage)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        given = [*args, *(kwargs or {}).values()]
        storages = {a.untyped_storage().data_ptr() for a in given if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, tuple | list) else [out]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in storages:
                self.shapes.append(tuple(t.shape))
        return out


@pytest.mark.parametrize("fused", [False, True])
def test_a_fused_backward_allocates_no_fresh_weight_gradient(fused):
    """Once ``.grad`` exists, the fused layers' backward writes into it; autograd's own
    accumulation computes a fresh gradient of each weight first (the check sees it)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(96, 40), nn.Linear(40, 72, bias=False))
    if fused:
        assert fuse_grad_accumulation(model) == ["0", "1"]
    ids = torch.randint(0, 96, (3, 5))
    model(ids).square().mean().backward()  # the first micro-batch: .grad adopted
    grads = [p.grad for p in model.parameters()]
    spy = Allocations()
    with spy:
        model(ids).square().mean().backward()
    weight_shapes = {tuple(p.shape) for p in model.parameters()}
    fresh = weight_shapes & set(spy.shapes)
    assert (not fresh) if fused else fresh == weight_shapes
    assert all(p.grad is g for p, g in zip(model.parameters(), grads, strict=True))


def test_fused_layers_follow_autocast_as_the_stock_ones():
    """Under bf16 autocast the fused Linear computes in bf16 and adds the bf16 product into
    the fp32 ``.grad``, as autocast's graph adds its upcast: the same gradients."""
    grads = []
    for fused in (False, True):
        model = token_model()
        if fused:
            fuse_grad_accumulation(model)
        for j in range(2):
            ids, targets = token_batch(j)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(ids)
            assert out.dtype == torch.bfloat16
            token_loss(out.float(), targets).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert_close(grads[1], grads[0])
    assert not grads[1]["0.weight"][PAD].any()  # the padding row gets no gradient


def test_fused_grad_accumulation_is_refused_where_it_cannot_apply():
    refuses(
        r"fused_grad_accumulation=True needs each micro-batch's backward in one pass; zb-h1",
        lambda: nobubble.Pipeline(
            nobubble.split(make_model(), 2), loss_fn, schedule="zb-h1", fused_grad_accumulation=True
        ),
    )
    refuses(
        r"fused_grad_accumulation=True with data_parallel=2",
        lambda: nobubble.Pipeline(
            nobubble.split(make_model(), 2),
            loss_fn,
            runtime="dist",
            data_parallel=2,
            fused_grad_accumulation=True,
        ),
    )
    refuses(
        r"fused_grad_accumulation must be a bool, got 'yes'",
        lambda: nobubble.Pipeline(
            nobubble.split(make_model(), 2), loss_fn, fused_grad_accumulation="yes"
        ),
        TypeError,
    )


def test_train_refuses_fused_grad_accumulation_under_a_split_backward(capsys):
    from nobubble.cli import main

    code = main(["train", "--schedule", "zbv", "--fused-grad-accumulation", "true"])
    assert code == 2
    err = capsys.readouterr().err
    # the API's refusal, one text (engine/grad_fusion.py)
    assert "fused_grad_accumulation=True needs each micro-batch's backward in one pass" in err
    assert "zbv splits it" in err


def test_a_second_derivative_through_a_fused_layer_is_refused_not_wrong():
    """The weight's gradient goes into ``.grad`` outside the graph: differentiating the
    backward again (a gradient penalty) would miss it, so it raises instead."""
    layer = nn.Linear(7, 4)
    fuse_grad_accumulation(layer)
    x = torch.randn(3, 7, requires_grad=True)
    (g,) = torch.autograd.grad(layer(x).pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        g.sum().backward()
