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
from dataclasses import dataclass, field, replace
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


@dataclass(frozen=True, kw_only=True)
class CorrectionSpec:
    """The delay correction of a run (its part of the configuration; ``CORRECTION_ENTRIES``
    documents each name).

    correction: a name of ``CORRECTIONS``. ef_lambda: error feedback's lambda.
    delay_lr_steps: the steps over which delay-lr's damping fades (0: a quarter of the run's
        steps). sync_warmup: the synchronous steps of sync-warmup (0: a tenth of the run's steps).
    """

    correction: str = field(default="none", metadata={"help": "the delay correction"})
    ef_lambda: float = field(default=1.0, metadata={"help": "error feedback's lambda"})
    delay_lr_steps: int = field(
        default=0, metadata={"help": "steps over which delay-lr's damping fades (0: steps/4)"}
    )
    sync_warmup: int = field(
        default=0, metadata={"help": "synchronous steps first with sync-warmup (0: steps/10)"}
    )

    def __post_init__(self) -> None:
        entry = correction_entry(self.correction)
        lam = self.ef_lambda
        if isinstance(lam, bool) or not isinstance(lam, int | float) or not math.isfinite(lam):
            raise ValueError(f"ef_lambda={lam!r} is not allowed: use a finite number >= 0")
        if lam < 0:
            raise ValueError(f"ef_lambda={lam!r} is not allowed: use a finite number >= 0")
        if self.delay_lr_steps is None:  # the API's former spelling of "the default"
            object.__setattr__(self, "delay_lr_steps", 0)
        for name in ("delay_lr_steps", "sync_warmup"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"{name}={value!r} is not allowed: use a number of steps >= 1 (0: the "
                    "default share of the run's steps)"
                )
        for name in ("delay_lr_steps", "sync_warmup"):
            owner = next(e for e in CORRECTION_ENTRIES.values() if e.option == name)
            if getattr(self, name) and entry is not owner:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} applies to correction={owner.name!r} only, "
                    f"not {self.correction!r}: drop it or use correction={owner.name!r}"
                )

    @property
    def entry(self) -> CorrectionEntry:
        return CORRECTION_ENTRIES[self.correction]

    def resolved(self, steps: int | None) -> CorrectionSpec:
        """The spec with its defaults (0) replaced by their share of a run of ``steps`` steps."""
        entry, option = self.entry, self.entry.option
        if option is None or getattr(self, option):
            value = getattr(self, option) if option else 0
        elif steps is None:
            raise ValueError(
                f"correction={self.correction!r} with {option}=0 takes its default from the "
                f"run's steps, and steps=None: give {option} >= 1, or steps"
            )
        else:
            value = max(1, steps // entry.default_share)
        if option == "sync_warmup" and steps is not None and value >= steps:
            raise ValueError(f"sync_warmup={value} must be below steps={steps}")
        return self if option is None else _replace_option(self, option, value)

    def check(self, schedule: str, synchronous: bool, shard: str) -> None:
        self.entry.check(self, schedule, synchronous, shard)

    def build(self) -> DelayCorrection:
        """One stage's correction (of a resolved spec)."""
        return self.entry.build(self)


def _replace_option(spec: CorrectionSpec, option: str, value: int) -> CorrectionSpec:
    values: dict[str, Any] = {option: value}
    return replace(spec, **values)


@dataclass(frozen=True)
class CorrectionEntry:
    """A registered correction: what it builds, what it works with, its help text. Every
    refusal of a correction is written here, once."""

    name: str
    help: str
    build: Callable[[CorrectionSpec], DelayCorrection]
    asynchronous_only: bool = True  # a synchronous schedule has no delay to correct
    unsharded: str = ""  # why it cannot run with shard="fsdp" ("": it can)
    option: str | None = None  # the spec field only this correction reads
    default_share: int = 1  # option 0 means steps // default_share

    def check(self, spec: CorrectionSpec, schedule: str, synchronous: bool, shard: str) -> None:
        if self.asynchronous_only and synchronous:
            raise ValueError(
                f"correction={self.name!r} corrects asynchronous schedules; {schedule} is "
                "synchronous: use correction='none'"
            )
        if shard == "fsdp" and self.unsharded:
            usable = [e.name for e in CORRECTION_ENTRIES.values() if e.asynchronous_only]
            usable = [n for n in usable if not CORRECTION_ENTRIES[n].unsharded]
            raise ValueError(
                f"correction={self.name!r} with shard='fsdp': {self.unsharded}; use correction="
                + " or ".join(repr(n) for n in usable)
                + ", or shard='none'"
            )


CORRECTION_ENTRIES: dict[str, CorrectionEntry] = {}


def register_correction(entry: CorrectionEntry) -> CorrectionEntry:
    """Add ``entry`` to the registry (the CLI's choices, its help and the checks follow)."""
    CORRECTION_ENTRIES[entry.name] = entry
    return entry


def correction_entry(name: str) -> CorrectionEntry:
    if name not in CORRECTION_ENTRIES:
        raise ValueError(f"correction={name!r} is unknown: use one of {tuple(CORRECTION_ENTRIES)}")
    return CORRECTION_ENTRIES[name]


for _entry in (
    CorrectionEntry("none", "no correction", lambda spec: NoCorrection(), asynchronous_only=False),
    CorrectionEntry(
        "ef",
        "error feedback, scaled by each stage's delay (ef_lambda)",
        lambda spec: ErrorFeedback(spec.ef_lambda),
    ),
    CorrectionEntry(
        "predict",
        "delayed forwards read weights extrapolated by their delay",
        lambda spec: WeightPrediction(),
        unsharded="a prediction is a whole-stage weight copy, which the sharded versions do "
        "not keep",
    ),
    CorrectionEntry(
        "delay-lr",
        "per-stage lr warm-up by delay over delay_lr_steps (0: a quarter of the steps)",
        lambda spec: DelayAwareLR(spec.delay_lr_steps),
        option="delay_lr_steps",
        default_share=4,
    ),
    CorrectionEntry(
        "sync-warmup",
        "the first sync_warmup steps synchronous (0: a tenth of the steps)",
        lambda spec: NoCorrection(),  # a change of schedule, not of the step
        option="sync_warmup",
        default_share=10,
    ),
):
    register_correction(_entry)
CORRECTIONS = tuple(CORRECTION_ENTRIES)


def make_correction(name: str, ef_lambda: float = 1.0, delay_lr_steps: int = 1) -> DelayCorrection:
    """The correction object of one stage for ``name`` (sync-warmup changes the schedule, not
    the step: its steps are plain)."""
    return CorrectionSpec(
        correction=name,
        ef_lambda=ef_lambda,
        delay_lr_steps=delay_lr_steps if name == "delay-lr" else 0,
    ).build()


__all__ = [
    "CORRECTIONS",
    "CORRECTION_ENTRIES",
    "CorrectionEntry",
    "CorrectionSpec",
    "DelayAwareLR",
    "DelayCorrection",
    "ErrorFeedback",
    "NoCorrection",
    "WeightPrediction",
    "correction_entry",
    "make_correction",
    "register_correction",
]
