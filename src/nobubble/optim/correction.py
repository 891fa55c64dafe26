"""Delay corrections applied at the update level, whatever the optimizer.

A correction wraps one optimizer step: it runs the step, which moves the parameters in place by
the optimizer's displacement d_t (learning rate and weight decay included), and may then change
that displacement. Error feedback (EF) is the correction of arXiv 2606.30634 for a one-step
gradient delay.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor


class DelayCorrection(ABC):
    """Runs an optimizer step and post-processes the displacement it applied."""

    @abstractmethod
    def apply(self, params: list[Tensor], step_fn: Callable[[], None]) -> None:
        """Call `step_fn()` (which updates `params` in place), then correct `params` in place."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # noqa: B027 (stateless default)
        pass


class NoCorrection(DelayCorrection):
    """The plain update: x_{t+1} = x_t + d_t."""

    def apply(self, params: list[Tensor], step_fn: Callable[[], None]) -> None:
        step_fn()


class ErrorFeedback(DelayCorrection):
    """Update-level error feedback, arXiv 2606.30634.

    With d_t the raw displacement of optimizer step t (d_t = x after step - x before step):
        steps 1 and 2:  x_{t+1} = x_t + d_t
        step t >= 3:    x_{t+1} = x_t + d_t + lam * (d_t - d_{t-1})
    i.e. the paper's x - u_{t-1} - lam * (u_{t-1} - u_{t-2}) with u = -d, the displacement of a
    gradient delayed by one step. lam = 1 extrapolates the update one step ahead (equivalent to
    one-step weight prediction); lam = 0 is the plain update.

    Memory: one parameter-sized buffer per tensor holding the previous RAW d_{t-1} (never the
    corrected displacement), plus one transient copy of the parameters during `apply`.
    """

    def __init__(self, lam: float = 1.0) -> None:
        if isinstance(lam, bool) or not isinstance(lam, (int, float)):
            raise TypeError(f"ErrorFeedback lam must be a number, got {lam!r}")
        if not (math.isfinite(lam) and lam >= 0):
            raise ValueError(f"ErrorFeedback lam={lam!r} is not allowed: use a finite lam >= 0")
        self.lam = float(lam)
        self.steps = 0  # optimizer steps applied through this correction
        self._prev: list[Tensor] | None = None  # d_{t-1} per tensor, None before the first step

    @torch.no_grad()
    def apply(self, params: list[Tensor], step_fn: Callable[[], None]) -> None:
        self._check_matches(params)
        displacement = [p.detach().clone() for p in params]  # x_t for now, d_t after the step
        step_fn()
        for p, d in zip(params, displacement, strict=True):
            d.neg_().add_(p)  # d = x_after - x_before; same bits as (x_after - x_before)
        if self._prev is None:  # step 1: plain update, the copy becomes the buffer
            self._prev = displacement
        else:
            use_ef = self.steps >= 2  # steps 1 and 2 stay plain
            for p, d, prev in zip(params, displacement, self._prev, strict=True):
                if use_ef:
                    prev.sub_(d).neg_()  # prev <- d_t - d_{t-1}, reusing the buffer
                    p.add_(prev, alpha=self.lam)
                prev.copy_(d)  # the buffer always holds the raw d_t
        self.steps += 1

    def _check_matches(self, params: list[Tensor]) -> None:
        if self._prev is None:
            return
        shapes = [tuple(p.shape) for p in params]
        expected = [tuple(b.shape) for b in self._prev]
        if shapes != expected:
            raise ValueError(
                f"ErrorFeedback got parameters of shapes {shapes} but its buffer holds {expected}: "
                "pass the same parameter list, in the same order, at every step"
            )

    def state_dict(self) -> dict[str, Any]:
        """`steps` and the raw previous displacement `prev` (live tensors: save or clone them)."""
        return {"steps": self.steps, "prev": self._prev}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore `steps` and a copy of `prev` (the caller's tensors are not aliased)."""
        steps, prev = state_dict["steps"], state_dict["prev"]
        if not isinstance(steps, int) or steps < 0 or (prev is None) != (steps == 0):
            raise ValueError(
                f"ErrorFeedback state has steps={steps!r} and prev "
                f"{'missing' if prev is None else 'present'}: expected prev exactly when steps > 0"
            )
        self.steps = steps
        self._prev = None if prev is None else [t.detach().clone() for t in prev]
