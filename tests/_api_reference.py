"""Independent references for the public API's oracles, on any model: a ``Problem`` names the
model, its split, its data, its loss and its optimizer.

Written from the semantics of docs/semantics.md in plain PyTorch: gradient accumulation on
the unsplit model, the one-step delayed loop of 2BW, and _reference's per-stage live-weight loop
over the simulator's global order (PACI). Nothing here imports ``nobubble.engine`` or
``nobubble.api.pipeline``; ``run_pipeline`` is the code under test, driven the way a user drives it.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import nobubble
from _reference import LiveWeightsLoop
from nobubble.api.pipeline import Observer
from nobubble.core.ir import Schedule
from nobubble.core.ledger import Ledger

M = 4  # micro-batches per step
LR = 1e-2


def adamw(named: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for _, p in named], lr=LR, weight_decay=0.1)


@dataclass(frozen=True)
class Problem:
    make_model: Callable[[], nn.Module]  # the same initial model at every call
    cut: Callable[[nn.Module, int], list[nn.Module]]  # the model into P stages (shared modules)
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # step j's inputs and targets
    loss_fn: Callable[[Any, Any], torch.Tensor]
    forward: Callable[[nn.Module, torch.Tensor], Any] = lambda model, x: model(x)  # unsplit

    def micro(self, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.batch(m // M)
        return x.chunk(M)[m % M], y.chunk(M)[m % M]


def built_on_meta(problem: Problem) -> Problem:
    """The same problem with its model built under ``torch.device("meta")`` (no memory): a
    pipeline then materializes its stages (``seed=``, ``weights=``)."""

    def make_model() -> nn.Module:
        with torch.device("meta"):
            return problem.make_model()

    return dataclasses.replace(problem, make_model=make_model)


def weights(modules: list[nn.Module]) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for m in modules for n, p in m.named_parameters()}


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def run_pipeline(
    problem: Problem,
    schedule: str,
    stages_n: int,
    steps: int,
    drain_every: int | None = None,
    **kwargs: Any,
) -> tuple[nobubble.Pipeline, list[float], nn.Module]:
    model = problem.make_model()
    # runtime="dist": NCCL's completion rules on any backend (strict_p2p=True), or eager posting
    observe = Observer(strict_p2p=kwargs.pop("strict_p2p", False))
    pipe = nobubble.Pipeline(
        problem.cut(model, stages_n),
        problem.loss_fn,
        schedule=schedule,
        microbatches=M,
        optimizer=kwargs.pop("optimizer", adamw),
        observe=observe,
        **kwargs,
    )
    losses: dict[int, float] = {}
    for j in range(steps):
        result = pipe.step(*problem.batch(j))
        losses.update({x.microbatch: x.value for x in result.losses})
        if drain_every and (j + 1) % drain_every == 0:
            losses.update({x.microbatch: x.value for x in pipe.drain().losses})
    losses.update({x.microbatch: x.value for x in pipe.drain().losses})
    if not losses:  # a "dist" rank without the last stage reports no loss
        return pipe, [], model
    return pipe, [losses[m] for m in range(steps * M)], model


def plain_accumulation(
    problem: Problem,
    steps: int,
    clip: float | None = None,
    optimizer: Callable[[list[tuple[str, nn.Parameter]]], torch.optim.Optimizer] = adamw,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = problem.make_model()
    opt = optimizer(list(model.named_parameters()))
    losses = []
    for j in range(steps):
        for i in range(M):
            xs, ys = problem.micro(j * M + i)
            loss = problem.loss_fn(problem.forward(model, xs), ys)
            (loss / M).backward()
            losses.append(loss.item())
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, weights([model])


def delayed_loop(problem: Problem, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """x[j+1] = x[j] - u(g_j(x[j-1])): batch j's gradient taken on the weights of one step
    earlier (batches 0 and 1 at x[0]), applied by the optimizer of the current weights."""
    model = problem.make_model()
    opt = adamw(list(model.named_parameters()))
    stale, losses = copy.deepcopy(model), []
    for j in range(steps):
        for i in range(M):
            xs, ys = problem.micro(j * M + i)
            loss = problem.loss_fn(problem.forward(stale, xs), ys)
            (loss / M).backward()
            losses.append(loss.item())
        read_next = copy.deepcopy(model)
        for p, q in zip(model.parameters(), stale.parameters(), strict=True):
            p.grad = q.grad
        opt.step()
        opt.zero_grad(set_to_none=True)
        stale = read_next
    return losses, weights([model])


class LiveLoop(LiveWeightsLoop):
    """_reference's PACI loop (live weights updated in place, autograd versions restored) on a
    problem's model, loss, data and optimizer."""

    def __init__(self, problem: Problem, schedule: Schedule, ledger: Ledger) -> None:
        # not the GPT of _reference: the fields are set here
        self.problem, self.schedule, self.ledger, self.recompute = problem, schedule, ledger, False
        self.stages = problem.cut(problem.make_model(), schedule.num_stages)  # type: ignore[assignment]
        self.opts = [adamw(list(s.named_parameters())) for s in self.stages]  # type: ignore[misc]
        self.steps = [0] * schedule.num_stages
        self.acts, self.grads, self.losses = {}, {}, {}
        self.saved, self.bwd_steps = {}, {}

    def stage_input(self, s: int, m: int) -> torch.Tensor:
        if s == 0:
            return self.problem.micro(m)[0]
        return self.acts.pop((s, m)).detach().requires_grad_(True)

    def run_stage(self, module, s, m, inputs, record=True):  # type: ignore[no-untyped-def]
        out = module(inputs)
        if s < self.schedule.num_stages - 1:
            return out
        loss = self.problem.loss_fn(out, self.problem.micro(m)[1])
        if record:
            self.losses[m] = loss.item()
        return loss / M

    def step(self, s: int, number: int) -> None:
        self.opts[s].step()
        self.opts[s].zero_grad(set_to_none=True)
        self.steps[s] += 1


class Head(nn.Module):
    """A first stage whose output is a dict: two floating tensors and an integer one."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"h": torch.tanh(self.a(x)), "skip": self.b(x), "n": torch.ones(1).long()}


class Tail(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Linear(16, 4)

    def forward(self, h: torch.Tensor, skip: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        return self.c(h + skip) * n


def tree_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Head(), Tail())  # the stages are its two children


def tree_forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model[1](**model[0](x))  # type: ignore[index,operator]
