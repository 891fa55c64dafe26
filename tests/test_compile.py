"""Compiled blocks (``Pipeline(compile=True)``): torch.compile on each block of each stage.

One test (a first compile costs tens of seconds on a CPU): losses within a stated tolerance of
the uncompiled run (inductor fuses and reorders float arithmetic) under 1f1b, under PACI with
weight prediction, whose forwards read versions and predictions (tensors other than the
parameters, swapped in by functional_call), and under PACI with every block checkpointed (some
rebuilds run on fresh tensors holding a stash); and no recompilation once the first two steps
have shown every kind of weight set (the graph count stays put)."""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters

import nobubble
from _api_reference import M, adamw, run_pipeline
from test_checkpointing import GPT

STEPS, WARM = 5, 2


def compiled(schedule: str, **kwargs: object) -> tuple[list[float], list[int]]:
    """Losses of a compiled run, and the graph count after each step."""
    pipe = nobubble.Pipeline(
        GPT.cut(GPT.make_model(), 2),
        GPT.loss_fn,
        schedule=schedule,
        microbatches=M,
        optimizer=adamw,
        compile=True,
        **kwargs,
    )
    assert pipe.wrapped_blocks == {0: ["layers.0", "layers.1"], 1: ["layers.2", "layers.3"]}
    losses, graphs = {}, []
    for j in range(STEPS):
        losses.update({x.microbatch: x.value for x in pipe.step(*GPT.batch(j)).losses})
        graphs.append(counters["stats"]["unique_graphs"])
    losses.update({x.microbatch: x.value for x in pipe.drain().losses})
    return [losses[m] for m in range(STEPS * M)], graphs


def test_compiled_blocks_train_as_uncompiled_without_recompiling():
    cases: list[tuple[str, dict[str, object]]] = [
        ("1f1b", {}),
        ("paci", {"correction": "predict"}),
        ("paci", {"activation_checkpointing": "full"}),
    ]
    for schedule, kwargs in cases:
        _, ref, _ = run_pipeline(GPT, schedule, 2, STEPS, **kwargs)
        losses, graphs = compiled(schedule, **kwargs)
        torch.testing.assert_close(losses, ref, rtol=1e-5, atol=1e-5)
        assert graphs[WARM - 1 :] == [graphs[WARM - 1]] * (STEPS - WARM + 1), (schedule, graphs)
