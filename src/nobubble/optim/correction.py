"""Delay corrections of the asynchronous schedules, whatever the optimizer.

A correction wraps one optimizer step of one stage: it runs the step, which moves the
parameters in place by the optimizer's displacement d_t (learning rate and weight decay
included), and may then change that displacement, scale the step's learning rate, or ask the
stage's weight versions to predict. Each step gets the stage's delay ``tau`` at that step: the
mean, over the micro-batches of the batch it applies, of the versions between the one a
forward read and the one its gradient is applied to (the ledger's ``delay``: 1 for 2BW on every
stage, the crossed share for PACI, up to ceil((P-1-s)/a) for PipeDream, 0 on the last stage of
both). With tau = 0 at every step each correction is the plain update, bit for bit.

- ``ef``: error feedback (arXiv 2606.30634), generalised from its one-step delay to tau.
- ``predict``: weight prediction (SpecTrain; PipeMare's discrepancy correction): a delayed
  forward reads its version extrapolated tau updates ahead (``engine.versions``).
- ``delay-lr``: a per-stage learning-rate warm-up by delay (PipeMare's rescheduling).
- ``sync-warmup``: the first steps flushed; a change of schedule, not of the step (here: plain).
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

    predicts = False  # whether delayed forwards read predicted weights (engine.versions)
    scales_lr = False  # whether lr_factor can differ from 1
    # state_dict keys holding one tensor per parameter (a sharded stage cuts them as its weights)
    parameter_buffers: tuple[str, ...] = ()

    @abstractmethod
    def apply(self, params: list[Tensor], step_fn: Callable[[], None], delay: float = 1.0) -> None:
        """Call `step_fn()` (which updates `params` in place), then correct `params` in place;
        ``delay``: the stage's delay at this step (see the module docstring; 1 by default, paper
        A's one-step delay)."""

    def lr_factor(self, step: int, delay: float) -> float:
        """What step ``step`` (0-based) multiplies the stage's learning rate by."""
        return 1.0

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # noqa: B027 (stateless default)
        pass


class NoCorrection(DelayCorrection):
    """The plain update: x_{t+1} = x_t + d_t."""

    def apply(self, params: list[Tensor], step_fn: Callable[[], None], delay: float = 1.0) -> None:
        step_fn()


class WeightPrediction(NoCorrection):
    """Weight prediction: the update is plain; a forward whose gradient will be applied tau
    versions after the one it reads runs (with its backward) on ``w_v + tau * (w_v - w_{v-1})``,
    the version extrapolated along the update that made it (SpecTrain's rule with the last
    displacement as the velocity; the form paper A's EF is equivalent to at tau = 1).

    The stage's ``WeightVersions`` makes and frees the predictions (``predicts``); memory: one
    weight copy per prediction alive (the ledger's readers decide), and one transient copy
    during a step that makes predictions.
    """

    predicts = True


class DelayAwareLR(NoCorrection):
    """A learning-rate warm-up by delay, after PipeMare's rescheduling (arXiv 1910.05124):
    step k of a stage with delay tau runs at lr * (1 + tau) ** -(1 - k / steps) while
    k < ``steps``, then at lr. A stage of delay 1 starts at half the lr, one of delay 0 is
    untouched. (1 + tau) rather than PipeMare's tau, whose delays count from 1: nobubble's count
    from 0, and the last stage of an asynchronous pipeline has none.)
    """

    scales_lr = True

    def __init__(self, steps: int) -> None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(
                f"delay_lr_steps={steps!r} is not allowed: use the number of steps (>= 1) over "
                "which the delay's learning-rate damping fades out"
            )
        self.steps = steps

    def lr_factor(self, step: int, delay: float) -> float:
        exponent = max(0.0, 1.0 - step / self.steps)
        if delay == 0 or exponent == 0:
            return 1.0
        return float((1.0 + delay) ** -exponent)


class ErrorFeedback(DelayCorrection):
    """Update-level error feedback, arXiv 2606.30634, applied with the stage's delay tau.

    With d_t the raw displacement of optimizer step t (d_t = x after step - x before step):
        steps 1 and 2:  x_{t+1} = x_t + d_t
        step t >= 3:    x_{t+1} = x_t + d_t + lam * tau_t * (d_t - d_{t-1})
    At tau = 1 (2BW, every stage) this is the paper's x - u_{t-1} - lam * (u_{t-1} - u_{t-2})
    with u = -d, the displacement of a gradient delayed by one step: lam = 1 extrapolates the
    update one step ahead (equivalent to one-step weight prediction). A gradient tau steps old
    lags the updates by tau of their steps, so the first-order extrapolation is tau times
    longer (PipeDream's deeper stages); PACI's fractional tau weights it by the share of the
    batch that crossed an update. tau = 0 (a last stage) and lam = 0 give the plain update.

    Memory: one parameter-sized buffer per tensor holding the previous RAW d_{t-1} (never the
    corrected displacement), plus one transient copy of the parameters during `apply`.
    """

    parameter_buffers = ("prev",)

    def __init__(self, lam: float = 1.0) -> None:
        if isinstance(lam, bool) or not isinstance(lam, (int, float)):
            raise TypeError(f"ErrorFeedback lam must be a number, got {lam!r}")
        if not (math.isfinite(lam) and lam >= 0):
            raise ValueError(f"ErrorFeedback lam={lam!r} is not allowed: use a finite lam >= 0")
        self.lam = float(lam)
        self.steps = 0  # optimizer steps applied through this correction
        self._prev: list[Tensor] | None = None  # d_{t-1} per tensor, None before the first step

    @torch.no_grad()
    def apply(self, params: list[Tensor], step_fn: Callable[[], None], delay: float = 1.0) -> None:
        self._check_matches(params)
        displacement = [p.detach().clone() for p in params]  # x_t for now, d_t after the step
        step_fn()
        for p, d in zip(params, displacement, strict=True):
            d.neg_().add_(p)  # d = x_after - x_before; same bits as (x_after - x_before)
        if self._prev is None:  # step 1: plain update, the copy becomes the buffer
            self._prev = displacement
        else:
            use_ef = self.steps >= 2 and delay != 0  # steps 1 and 2 stay plain
            for p, d, prev in zip(params, displacement, self._prev, strict=True):
                if use_ef:
                    prev.sub_(d).neg_()  # prev <- d_t - d_{t-1}, reusing the buffer
                    p.add_(prev, alpha=self.lam * delay)
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


__all__ = [
    "DelayAwareLR",
    "DelayCorrection",
    "ErrorFeedback",
    "NoCorrection",
    "WeightPrediction",
]
