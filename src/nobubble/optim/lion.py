"""Lion (EvoLved Sign Momentum), arXiv 2302.06675: the update math as a pure function, plus a
minimal torch.optim.Optimizer that holds its state."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor


def lion_update(grad: Tensor, exp_avg: Tensor, beta1: float, beta2: float) -> tuple[Tensor, Tensor]:
    """One Lion step for one tensor, without touching the inputs.

    Returns `(direction, new_exp_avg)` where
        direction   = sign(beta1 * m + (1 - beta1) * g)   every entry in {-1, 0, +1}
        new_exp_avg = beta2 * m + (1 - beta2) * g
    The parameter then moves by `-lr * direction` after decoupled weight decay
    `p <- p * (1 - lr * wd)`. Because the direction is a sign, each entry moves by exactly lr,
    which is why Lion wants a 3-10x smaller lr than AdamW. The interpolation (beta1) and the
    momentum tracking (beta2) use different betas: that is Lion's distinguishing choice.

    Both mixes are written as ``lerp`` so that the rounding is pytorch-optimizer's: its Lion, an
    independent implementation of the same paper, gives the same bits (tests/test_optim_library.py).
    """
    direction = torch.sign(exp_avg.lerp(grad, 1.0 - beta1))
    new_exp_avg = exp_avg.lerp(grad, 1.0 - beta2)
    return direction, new_exp_avg


class Lion(torch.optim.Optimizer):
    """Lion with decoupled weight decay; state per tensor: `exp_avg` (the momentum)."""

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"Lion lr={lr} is not allowed: use lr >= 0")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Lion betas={betas} are not allowed: each must be in [0, 1)")
        if not weight_decay >= 0.0:
            raise ValueError(f"Lion weight_decay={weight_decay} is not allowed: use >= 0")
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                direction, new_exp_avg = lion_update(p.grad, state["exp_avg"], beta1, beta2)
                p.mul_(1.0 - lr * wd)
                p.add_(direction, alpha=-lr)
                state["exp_avg"].copy_(new_exp_avg)
        return loss
