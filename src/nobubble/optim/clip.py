"""Gradient clipping and non-finite checks as pure helpers over one stage's parameters.

No communication happens here: a global norm over all stages is the sum of every stage's
`grad_sq_norm`, reduced by the caller; an asynchronous schedule clips per stage instead, so that
clipping never becomes a cross-stage barrier (the policy lives with the caller).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

CLIP_EPS = 1e-6  # keeps the coefficient finite when the norm is 0 (torch's clip_grad_norm_ too)


def _grads(params: Iterable[Tensor]) -> list[Tensor]:
    return [p.grad for p in params if p.grad is not None]


def grad_sq_norm(params: Iterable[Tensor]) -> Tensor:
    """Sum of squares of every `.grad` (missing grads count 0), as an fp32 scalar tensor.

    The result stays on the gradients' device (no host sync); it is a tensor 0 on CPU when no
    parameter has a gradient.
    """
    grads = _grads(params)
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    # fp32 accumulation, whatever the gradient dtype: bf16 squares would lose the small entries.
    squares = [torch.linalg.vector_norm(g, dtype=torch.float32).square() for g in grads]
    return torch.stack(squares).sum()


def sum_over_stages(squares: Sequence[Tensor]) -> Tensor:
    """The global squared gradient norm from each stage's share, given in stage order.

    Added one by one in stage order in float64, on the first share's device: every rank of the
    runtime and the emulator compute the same bits, whatever order a backend's all-reduce would
    add them in (float32 addition is not associative, and gloo's order depends on the machine).
    """
    total = torch.zeros((), dtype=torch.float64, device=squares[0].device)
    for share in squares:
        total = total + share.to(total.device, torch.float64).reshape(())
    return total


def clip_coefficient(total_norm: Tensor | float, max_norm: float) -> Tensor | float:
    """min(1, max_norm / (total_norm + 1e-6)): the factor that brings the norm under max_norm.

    A tensor norm gives a tensor (no host sync), a float gives a float. A non-finite norm gives a
    non-finite coefficient; check `grads_finite` first if that matters.
    """
    if not (max_norm > 0 and math.isfinite(max_norm)):
        raise ValueError(f"max_norm={max_norm!r} is not allowed: use a finite value > 0")
    if isinstance(total_norm, Tensor):
        return (max_norm / (total_norm + CLIP_EPS)).clamp(max=1.0)
    return min(1.0, max_norm / (float(total_norm) + CLIP_EPS))


def scale_grads_(params: Iterable[Tensor], coef: Tensor | float) -> None:
    """Multiply every `.grad` by `coef` in place (the trailing underscore says so)."""
    grads = _grads(params)
    if not grads or (not isinstance(coef, Tensor) and coef == 1.0):
        return
    for g in grads:
        g.mul_(coef.to(g.device) if isinstance(coef, Tensor) else coef)


def grads_finite(params: Iterable[Tensor]) -> bool:
    """True iff every `.grad` entry is finite (one host sync)."""
    grads = _grads(params)
    if not grads:
        return True
    return bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())
