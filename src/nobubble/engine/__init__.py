"""The engine: a schedule executed on real modules (stage worker, weight versions, interpreter).

The runtimes that drive it (the in-process emulator, torch.distributed) sit above it in
``nobubble.runtime``."""

from __future__ import annotations

from nobubble.engine.devices import misplaced
from nobubble.engine.interpreter import Interpreter
from nobubble.engine.transport import InProcessTransport, Transport
from nobubble.engine.versions import WeightVersions, alias
from nobubble.engine.worker import Batch, StageWorker

__all__ = [
    "Batch",
    "InProcessTransport",
    "Interpreter",
    "StageWorker",
    "Transport",
    "WeightVersions",
    "alias",
    "misplaced",
]
