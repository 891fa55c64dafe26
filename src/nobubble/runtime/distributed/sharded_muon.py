"""Muon on FSDP-sharded matrices: Newton-Schulz on the whole matrix, everything else on shards.

Muon's update orthogonalizes each hidden matrix's momentum (Newton-Schulz on the whole 2-D
matrix); run on a shard of rows it would orthogonalize the wrong matrix. ``torch.optim.Muon``
over DTensor parameters does not do that (DTensor computes on the global matrix), but it reaches
the global products by reducing partial bf16 matmuls across the dp group, which is not the
unsharded computation: measured 4e-3 away from it after three steps on a 5x6 and a 3x5 matrix.

``ShardedMuon`` keeps the momentum sharded (an elementwise update, exact on each shard),
all-gathers this step's update matrices (one collective per dtype), runs the iteration below on
each whole matrix on every replica (the same input and the same kernels give every replica the
same result), and applies this rank's rows. The iteration and the learning-rate rule are
``torch.optim.Muon``'s, written out as pure functions, so the step equals torch's on unsharded
matrices (tests/test_fsdp.py checks it bitwise); the state dict has torch's format
(``momentum_buffer``), so a checkpoint moves between sharded and unsharded runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from nobubble.runtime.distributed.shard_comm import DpGroup, Rows


def newton_schulz(
    update: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> Tensor:
    """The quintic Newton-Schulz iteration of Muon (Keller Jordan; ``torch.optim.Muon``) on a
    whole matrix, in bf16: it maps G = U S V^T to about U S' V^T with S' near 1, the nearest
    semi-orthogonal matrix up to the iteration's spread of singular values (0.5 .. 1.5)."""
    a, b, c = coefficients
    x = update.bfloat16()
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, rule: str | None, shape: Sequence[int]) -> float:
    """``torch.optim.Muon``'s per-matrix learning rate: "original" sqrt(max(1, rows/cols)), or
    "match_rms_adamw" 0.2 sqrt(max(rows, cols)) (the update's RMS near AdamW's)."""
    rows, cols = shape[:2]
    ratio = 1.0
    if rule is None or rule == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif rule == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    return lr * ratio


class ShardedMuon(torch.optim.Optimizer):
    """``torch.optim.Muon`` (its param groups and hyperparameters) over FSDP-sharded matrices
    of one stage, whose dp group is ``dp``."""

    def __init__(self, muon: torch.optim.Optimizer, dp: DpGroup) -> None:
        super().__init__(muon.param_groups, dict(muon.defaults))
        self.dp = dp

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        params, updates = [], []
        for group in self.param_groups:
            momentum = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                grad, buf = p.grad.to_local(), state["momentum_buffer"].to_local()
                buf.lerp_(grad, 1 - momentum)
                params.append((p, group))
                updates.append(grad.lerp(buf, momentum) if group["nesterov"] else buf)
        if not params:
            return
        layouts = [Rows(p.shape, self.dp.size) for p, _ in params]
        whole = [
            torch.empty(p.shape, dtype=u.dtype, device=u.device)
            for (p, _), u in zip(params, updates, strict=True)
        ]
        self.dp.gather(updates, layouts, whole, "Muon all-gather")
        for (p, group), update, rows in zip(params, whole, layouts, strict=True):
            ortho = newton_schulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"])
            lr = group["lr"]
            local = p.to_local()
            local.mul_(1 - lr * group["weight_decay"])
            local.add_(
                rows.local(ortho, self.dp.rank),
                alpha=-adjusted_lr(lr, group["adjust_lr_fn"], p.shape),
            )
