"""Gradient-accumulation fusion: a stage's ``nn.Linear`` and ``nn.Embedding`` layers add their
weight gradient into ``weight.grad`` inside the backward's own kernel (``addmm_``,
``index_add_``), instead of computing a fresh gradient that autograd then adds. A backward then
never holds a micro-batch's gradient of a weight beside the accumulated one: on a stage whose
largest tensor is an embedding or an output head, that copy is the largest thing a rank holds
beyond its weights, gradients, optimizer state and activations (docs/benchmarks.md, memory).

Megatron-LM fuses the same way inside its own linear layers; here it is done to a user's stock
modules by changing their class to a subclass (``FusedGradLinear``, ``FusedGradEmbedding``)
whose forward, under autograd, goes through the functions below. Parameters, state dicts and
everything outside a backward are unchanged. Opt-in (``Pipeline(fused_grad_accumulation=True)``):
the sums round in another order (``grad + a @ b`` summed inside the matrix product), so the
results differ from autograd's accumulation in the last bits.

It needs the whole backward of a micro-batch in one autograd call that lets the weight gradients
land in ``.grad`` (the fused backward of a stage without data parallelism): a split backward
(zb-h1, zbv) computes them apart from the input gradients, and data parallelism reduces them
from autograd's results, so both are refused (``check_fusable``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable


def _compute_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast runs a linear layer in on x's device, or None without autocast."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


def _add_into_grad(weight: torch.Tensor, grad: torch.Tensor) -> None:
    """``weight.grad += grad``; a weight without ``.grad`` adopts it (as autograd's own
    accumulation does)."""
    if weight.grad is None:
        weight.grad = grad if grad.dtype == weight.dtype else grad.to(weight.dtype)
    else:
        weight.grad.add_(grad)


class _LinearGradInto(torch.autograd.Function):
    """``F.linear`` whose backward adds the weight's gradient into ``weight.grad`` in place and
    returns none for it. Under autocast it casts as autocast does (input, weight and bias to the
    autocast dtype) and keeps the cast input for backward, as autocast's graph would."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        dtype = _compute_dtype(x)
        ctx.x_dtype = x.dtype
        if dtype is not None:
            with torch.autocast(x.device.type, enabled=False):
                x = x.to(dtype)
                out = F.linear(x, weight.to(dtype), None if bias is None else bias.to(dtype))
        else:
            out = F.linear(x, weight, bias)
        ctx.save_for_backward(x)
        ctx.weight = weight  # a leaf: its .grad is where the gradient goes
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out

    @staticmethod
    @once_differentiable  # its weight gradient goes into .grad: no graph to differentiate again
    def backward(
        ctx: Any, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor | None, None, torch.Tensor | None]:
        (x,) = ctx.saved_tensors
        weight: torch.Tensor = ctx.weight
        grad_x = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad_out @ weight.to(grad_out.dtype)).to(ctx.x_dtype)
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, x.shape[-1])
            with torch.no_grad():
                if weight.grad is not None and weight.grad.dtype == g2.dtype:
                    weight.grad.addmm_(g2.t(), x2)  # the fusion: no fresh gradient
                else:  # the first micro-batch, or a low-precision product added to fp32
                    _add_into_grad(weight, g2.t() @ x2)
        if ctx.needs_input_grad[2]:
            grad_b = g2.sum(0).to(ctx.bias_dtype)
        return grad_x, None, grad_b


class _EmbeddingGradInto(torch.autograd.Function):
    """``F.embedding`` whose backward adds the rows' gradients into ``weight.grad`` in place
    (``index_add_``), none into a ``padding_idx`` row, and returns none for the weight."""

    @staticmethod
    def forward(
        ctx: Any, ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None
    ) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.weight, ctx.padding_idx = weight, padding_idx
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[None, None, None]:
        (ids,) = ctx.saved_tensors
        weight: torch.Tensor = ctx.weight
        if ctx.needs_input_grad[1]:
            rows = ids.reshape(-1)
            g = grad_out.reshape(rows.numel(), weight.shape[1])
            if ctx.padding_idx is not None:
                g = g.masked_fill((rows == ctx.padding_idx).unsqueeze(1), 0)
            with torch.no_grad():
                if weight.grad is None:
                    weight.grad = torch.zeros_like(weight)
                weight.grad.index_add_(0, rows, g.to(weight.grad.dtype))
        return None, None, None


class FusedGradLinear(nn.Linear):
    """An ``nn.Linear`` whose backward adds its weight gradient into ``weight.grad``."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and self.weight.requires_grad:
            return _LinearGradInto.apply(input, self.weight, self.bias)
        return F.linear(input, self.weight, self.bias)


class FusedGradEmbedding(nn.Embedding):
    """An ``nn.Embedding`` whose backward adds its rows' gradients into ``weight.grad``."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and self.weight.requires_grad:
            return _EmbeddingGradInto.apply(input, self.weight, self.padding_idx)
        return F.embedding(input, self.weight, self.padding_idx)


def fusable(module: nn.Module) -> type[nn.Module] | None:
    """The fused class for a stock ``nn.Linear`` or plain ``nn.Embedding`` (no max_norm,
    scale_grad_by_freq or sparse gradient), else None: a subclass may compute otherwise."""
    if type(module) is nn.Linear:
        return FusedGradLinear
    if (
        type(module) is nn.Embedding
        and module.max_norm is None
        and not module.scale_grad_by_freq
        and not module.sparse
    ):
        return FusedGradEmbedding
    return None


def fuse_grad_accumulation(module: nn.Module) -> list[str]:
    """Give every fusable layer of ``module`` its fused class, in place; return their names.
    Layers of another class keep autograd's accumulation (a fresh gradient, then added)."""
    fused = []
    for name, sub in module.named_modules():
        cls = fusable(sub)
        if cls is not None:
            sub.__class__ = cls
            fused.append(name)
    return fused


def check_fusable(schedule: str, split_backward: bool, data_parallel: int) -> None:
    """Refuse ``fused_grad_accumulation=True`` where the weight gradients do not go straight
    into ``.grad`` in one backward call."""
    if split_backward:
        raise ValueError(
            f"fused_grad_accumulation=True needs each micro-batch's backward in one pass; "
            f"{schedule} splits it and computes the weight gradients apart (W): use a schedule "
            "with a fused backward (1f1b, gpipe, interleaved-1f1b, paci, 2bw, pipedream) or drop "
            "fused_grad_accumulation"
        )
    if data_parallel > 1:
        raise ValueError(
            f"fused_grad_accumulation=True with data_parallel={data_parallel}: the data-parallel "
            "reduction launches from autograd's gradients, which fusion does not produce; use "
            "data_parallel=1 or drop fused_grad_accumulation"
        )
