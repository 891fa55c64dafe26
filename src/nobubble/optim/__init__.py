"""Optimizers of one pipeline stage: config, routing to Muon/AdamW, update rules, the learning-rate
schedule, clipping helpers and update-level delay corrections (error feedback)."""

from nobubble.optim.build import StageOptimizer, build_optimizer
from nobubble.optim.clip import (
    clip_coefficient,
    grad_sq_norm,
    grads_finite,
    scale_grads_,
    sum_over_stages,
)
from nobubble.optim.config import DEFAULT_BETAS, OPTIMIZERS, OptimConfig
from nobubble.optim.correction import DelayCorrection, ErrorFeedback, NoCorrection
from nobubble.optim.lion import Lion, lion_update
from nobubble.optim.lr import lr_at, warmup_steps
from nobubble.optim.routing import (
    GroupCount,
    Routing,
    muon_group,
    route_parameters,
    wants_weight_decay,
)

__all__ = [
    "DEFAULT_BETAS",
    "OPTIMIZERS",
    "DelayCorrection",
    "ErrorFeedback",
    "GroupCount",
    "Lion",
    "NoCorrection",
    "OptimConfig",
    "Routing",
    "StageOptimizer",
    "build_optimizer",
    "clip_coefficient",
    "grad_sq_norm",
    "grads_finite",
    "lion_update",
    "lr_at",
    "muon_group",
    "route_parameters",
    "scale_grads_",
    "sum_over_stages",
    "wants_weight_decay",
    "warmup_steps",
]
