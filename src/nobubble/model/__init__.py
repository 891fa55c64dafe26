"""Llama-style GPT, its presets, and its split into pipeline stages (layer 1, torch).

``config`` and ``partition`` are torch-free; ``gpt`` holds the model, ``stages`` the split.
"""

from nobubble.model.config import (
    MODEL_PRESETS,
    ModelConfig,
    ModelShape,
    model_config,
    swiglu_hidden_dim,
)
from nobubble.model.gpt import GPT, build_model, init_weights, lm_loss
from nobubble.model.partition import (
    StageRow,
    block_cost,
    check_layer_ranges,
    describe_partition,
    partition_layers,
    partition_rows,
)
from nobubble.model.stages import StageModule, split_model

__all__ = [
    "GPT",
    "MODEL_PRESETS",
    "ModelConfig",
    "ModelShape",
    "StageModule",
    "StageRow",
    "block_cost",
    "build_model",
    "check_layer_ranges",
    "describe_partition",
    "init_weights",
    "lm_loss",
    "model_config",
    "partition_layers",
    "partition_rows",
    "split_model",
    "swiglu_hidden_dim",
]
