"""nobubble: pipeline-parallel LM pretraining with synchronous and asynchronous schedules.

The front door (docs/api.md)::

    import nobubble
    stages = nobubble.split(model, ["4"])  # or your own list of stage modules
    pipe = nobubble.Pipeline(stages, loss_fn, schedule="paci", microbatches=4)
    result = pipe.step(inputs, targets)  # one optimizer step's batch

The package's folders are its layers, each importing only the ones below it (docs/architecture.md):
``cli`` > ``app`` (train, bench, experiments, demo, ...) > ``api`` (``Pipeline``, ``split``,
``materialize``) > ``runtime`` (emulator, torch.distributed) > ``engine`` > ``model``, ``data``,
``optim`` > ``core`` (no torch). ``nobubble.hf`` names the Hugging Face support.
Importing the package imports nothing heavy: the names below load their module on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "Pipeline": "nobubble.api.pipeline",
    "PipelineConfig": "nobubble.api.config",
    "StepResult": "nobubble.api.pipeline",
    "MicrobatchLoss": "nobubble.api.pipeline",
    "split": "nobubble.api.splitting",
    "materialize": "nobubble.api.materializing",
    "SCHEDULE_NAMES": "nobubble.core.schedules",
    "tune_host_allocator": "nobubble.core.host_memory",
}
__all__ = ["__version__", *_EXPORTS]

if TYPE_CHECKING:
    from nobubble.api.config import PipelineConfig as PipelineConfig
    from nobubble.api.materializing import materialize as materialize
    from nobubble.api.pipeline import MicrobatchLoss as MicrobatchLoss
    from nobubble.api.pipeline import Pipeline as Pipeline
    from nobubble.api.pipeline import StepResult as StepResult
    from nobubble.api.splitting import split as split
    from nobubble.core.host_memory import tune_host_allocator as tune_host_allocator
    from nobubble.core.schedules import SCHEDULE_NAMES as SCHEDULE_NAMES


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
