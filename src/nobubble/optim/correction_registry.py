"""The correction registry: one entry per ``--correction`` name, carrying what it builds (a
``DelayCorrection`` of correction.py), what it works with (asynchronous schedules, sharded
stages), the option only it reads and its help text; and ``CorrectionSpec``, a run's choice.

Adding a correction is its class in correction.py and one ``register_correction`` call here; the
command line's choices and help, the checks and the pipeline's workers read the registry.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from nobubble.optim.correction import (
    DelayAwareLR,
    DelayCorrection,
    ErrorFeedback,
    NoCorrection,
    WeightPrediction,
)


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
    "correction_entry",
    "make_correction",
    "register_correction",
]
