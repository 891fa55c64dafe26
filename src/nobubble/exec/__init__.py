"""Execution of schedules on real modules: stage worker, versions, interpreter, emulator."""

from __future__ import annotations

from collections.abc import Callable

import torch

from nobubble.exec.emulator import Emulator
from nobubble.exec.interpreter import Interpreter
from nobubble.exec.transport import InProcessTransport, Transport
from nobubble.exec.versions import WeightVersions, alias
from nobubble.exec.worker import Batch, StageWorker, misplaced
from nobubble.ir import Schedule
from nobubble.ledger import Ledger
from nobubble.model import StageModule
from nobubble.optim import DelayCorrection, StageOptimizer

__all__ = [
    "Batch",
    "Emulator",
    "InProcessTransport",
    "Interpreter",
    "StageWorker",
    "Transport",
    "WeightVersions",
    "alias",
    "build_workers",
    "misplaced",
]


def build_workers(
    schedule: Schedule,
    ledger: Ledger,
    stages: list[StageModule],
    optimizers: list[StageOptimizer],
    corrections: list[DelayCorrection],
    batch_fn: Callable[[int], Batch],
    lr_fn: Callable[[int], float],
    clip_norm: float | None,
    autocast_dtype: torch.dtype | None = None,
    recompute: bool = False,
) -> list[StageWorker]:
    return [
        StageWorker(
            module,
            schedule,
            ledger.stages[s],
            optimizers[s],
            corrections[s],
            batch_fn,
            lr_fn,
            clip_norm,
            autocast_dtype,
            recompute,
        )
        for s, module in enumerate(stages)
    ]
