"""DualPipeV and Looped BFS in the emulator: both are synchronous, so a run must equal plain
gradient accumulation on the unsplit model, bitwise (docs/semantics.md, "Executing them").

DualPipeV runs every micro-batch's backward in forward order on each stage (FIFO), so its oracle
is _api_reference's plain accumulation. Looped BFS runs a stage's backwards newest first, so
``.grad`` sums the M gradients in the reverse order; its oracle, written here in plain PyTorch,
is plain accumulation with the backwards in that order (floating-point sums depend on order).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from _api_reference import (
    M,
    Problem,
    adamw,
    assert_bitwise,
    plain_accumulation,
    run_pipeline,
    weights,
)
from test_api import SEQ
from test_zero_bubble_exec import GPT


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def newest_first_accumulation(
    problem: Problem, steps: int
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Every forward of the batch, then the backwards from the last micro-batch to the first."""
    model = problem.make_model()
    opt = adamw(list(model.named_parameters()))
    losses = []
    for j in range(steps):
        batch = []
        for i in range(M):
            xs, ys = problem.micro(j * M + i)
            batch.append(problem.loss_fn(problem.forward(model, xs), ys))
        for loss in reversed(batch):
            (loss / M).backward()
        losses += [loss.item() for loss in batch]
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, weights([model])


@pytest.mark.parametrize(("problem", "steps"), [(SEQ, 20), (GPT, 3)], ids=["seq", "gpt"])
def test_dualpipev_equals_plain_accumulation_bitwise(problem, steps):
    """P=2 ranks, 4 stage modules, M=4 = the number of stages (torch's least M); 20 steps pass
    the open-ended loop's first horizon (16 steps)."""
    pipe, losses, _ = run_pipeline(problem, "dualpipev", 4, steps)
    ref_losses, ref_weights = plain_accumulation(problem, steps)
    assert losses == ref_losses
    assert_bitwise(weights(pipe.stages), ref_weights)


def test_dualpipev_passes_drain_points():
    pipe, losses, _ = run_pipeline(SEQ, "dualpipev", 4, 5, drain_every=2)
    ref_losses, ref_weights = plain_accumulation(SEQ, 5)
    assert losses == ref_losses
    assert_bitwise(weights(pipe.stages), ref_weights)


@pytest.mark.parametrize(("problem", "steps"), [(SEQ, 6), (GPT, 2)], ids=["seq", "gpt"])
def test_looped_bfs_equals_newest_first_accumulation_bitwise(problem, steps):
    pipe, losses, _ = run_pipeline(problem, "looped-bfs", 4, steps)
    ref_losses, ref_weights = newest_first_accumulation(problem, steps)
    assert losses == ref_losses
    assert_bitwise(weights(pipe.stages), ref_weights)
