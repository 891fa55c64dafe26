"""Execution of schedules on real modules: stage worker, versions, interpreter, emulator."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from nobubble.core.ir import Schedule
from nobubble.core.ledger import Ledger
from nobubble.exec.emulator import Emulator, rank_interpreters
from nobubble.exec.interpreter import Interpreter
from nobubble.exec.transport import InProcessTransport, Transport
from nobubble.exec.versions import WeightVersions, alias
from nobubble.exec.worker import Batch, LossFn, StageWorker, misplaced
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
    "rank_interpreters",
]


def build_workers(
    schedule: Schedule,
    ledger: Ledger,
    stages: list[nn.Module],
    optimizers: list[StageOptimizer],
    corrections: list[DelayCorrection],
    batch_fn: Callable[[int], Batch],
    lr_fn: Callable[[int], float],
    clip_norm: float | None,
    autocast_dtype: torch.dtype | None = None,
    recompute: bool = False,
    loss_fn: LossFn | None = None,
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
            loss_fn=loss_fn,
        )
        for s, module in enumerate(stages)
    ]
