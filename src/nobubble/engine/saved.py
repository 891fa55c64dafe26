"""What a stage keeps between actions: a forward's saved graph and inputs for its backward
(``Saved``), a split backward's I awaiting its W (``Pending``), and gradients added into ``.grad``
as the fused backward does (``accumulate_grads``)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nobubble.engine.split_backward import WeightWork
from nobubble.engine.tree import (
    Tree,
)


@dataclass
class Saved:
    """What a forward keeps for its backward."""

    version: int
    weights: dict[str, torch.Tensor]  # the leaves the graph was built on (see _weights)
    inputs: Tree  # stage input: the batch's on stage 0, grad-requiring leaves elsewhere
    output: Tree | None  # None in recompute mode (the graph is rebuilt at backward)
    activation_bytes: int  # autograd's saved tensors (the stage input alone when recomputing)


@dataclass
class Pending:
    """What a split backward's I leaves for its W."""

    weights: list[torch.Tensor]  # the leaves the graph was built on (see _weights)
    work: WeightWork
    held: list[torch.Tensor]  # the output and input gradients, which W must not adopt
    activation_bytes: int


def no_work() -> contextlib.AbstractContextManager[set[int]]:
    """No dp hooks: no gradient accumulated ahead of ``accumulate_grads``."""
    return contextlib.nullcontext(set())


def accumulate_grads(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    held: Sequence[torch.Tensor | None] = (),
) -> None:
    """Add one micro-batch's weight gradients ``grads`` into ``params``' ``.grad``.

    A parameter without ``.grad`` adopts autograd's result without a copy (as autograd's own
    accumulation does), unless that tensor may be shared: a view, a storage of ``held`` (the
    incoming gradient, a transport buffer the next receive overwrites; the input gradient, which
    the transport sends or hands on), or a storage already adopted by another parameter; those
    are copied, so a later in-place accumulation never changes a tensor someone else reads.
    """
    taken = {t.untyped_storage().data_ptr() for t in held if t is not None}
    with torch.no_grad():
        for p, g in zip(params, grads, strict=True):
            if p.grad is not None:
                p.grad.add_(g)
                continue
            ptr = g.untyped_storage().data_ptr()
            owned = not g._is_view() and ptr not in taken
            if owned and g.dtype == p.dtype and g.stride() == p.stride():
                p.grad = g
            else:
                p.grad = g.to(p.dtype).clone()
            taken.add(ptr)
