"""nobubble: pipeline-parallel LM pretraining with synchronous and asynchronous schedules.

The front door (docs/api.md)::

    import nobubble
    stages = nobubble.split(model, ["4"])  # or your own list of stage modules
    pipe = nobubble.Pipeline(stages, loss_fn, schedule="paci", microbatches=4)
    result = pipe.step(inputs, targets)  # one optimizer step's batch

Layer 0 (no torch): ``ir``, ``deps``, ``placement``, ``schedules``, ``ledger``, ``validate``,
``sim``, ``viz``.
Layer 1 (torch): ``model``, ``data``, ``optim``, ``exec``; ``pipeline``, ``splitting`` and
``materializing`` (the public API). Layer 2: ``dist``. Layer 3: ``config``, ``train``, ``cli``.
Importing the package imports nothing heavy: the names below load their module on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "Pipeline": "nobubble.pipeline",
    "StepResult": "nobubble.pipeline",
    "MicrobatchLoss": "nobubble.pipeline",
    "split": "nobubble.splitting",
    "materialize": "nobubble.materializing",
    "SCHEDULE_NAMES": "nobubble.core.schedules",
    "tune_host_allocator": "nobubble.host_memory",
}
__all__ = ["__version__", *_EXPORTS]

if TYPE_CHECKING:
    from nobubble.core.schedules import SCHEDULE_NAMES as SCHEDULE_NAMES
    from nobubble.host_memory import tune_host_allocator as tune_host_allocator
    from nobubble.materializing import materialize as materialize
    from nobubble.pipeline import MicrobatchLoss as MicrobatchLoss
    from nobubble.pipeline import Pipeline as Pipeline
    from nobubble.pipeline import StepResult as StepResult
    from nobubble.splitting import split as split


def __getattr__(name: str) -> Any:
    if name == "hf":  # Hugging Face models: the optional extra nobubble[hf]
        import importlib

        return importlib.import_module("nobubble.hf")
    if name not in _EXPORTS:
        raise AttributeError(f"module 'nobubble' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
