"""The engine: a schedule executed on real modules (stage worker, weight versions, interpreter).

The runtimes that drive it (the in-process emulator, torch.distributed) sit above it in
``nobubble.runtime``."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from nobubble.core.ir import Schedule
from nobubble.core.ledger import Ledger
from nobubble.engine.devices import misplaced
from nobubble.engine.interpreter import Interpreter
from nobubble.engine.transport import InProcessTransport, Transport
from nobubble.engine.versions import WeightVersions, alias
from nobubble.engine.worker import Batch, LossFn, StageWorker
from nobubble.optim import DelayCorrection, StageOptimizer

__all__ = [
    "Batch",
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
