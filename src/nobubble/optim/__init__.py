"""Optimizers of one pipeline stage: config, routing to Muon/AdamW, update rules, the learning-rate
schedule, clipping helpers and delay corrections (error feedback, weight prediction, delay-aware
learning rate)."""

from nobubble.optim.build import StageOptimizer, build_optimizer
from nobubble.optim.clip import (
    clip_coefficient,
    grad_sq_norm,
    grads_finite,
    scale_grads_,
    sum_over_stages,
)
from nobubble.optim.config import DEFAULT_BETAS, FUSED_ADAMW_OPTIMIZERS, OPTIMIZERS, OptimConfig
from nobubble.optim.correction import (
    CORRECTIONS,
    DelayAwareLR,
    DelayCorrection,
    ErrorFeedback,
    NoCorrection,
    WeightPrediction,
    make_correction,
)
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
    "CORRECTIONS",
    "DEFAULT_BETAS",
    "FUSED_ADAMW_OPTIMIZERS",
    "OPTIMIZERS",
    "DelayAwareLR",
    "DelayCorrection",
    "ErrorFeedback",
    "GroupCount",
    "Lion",
    "NoCorrection",
    "OptimConfig",
    "Routing",
    "StageOptimizer",
    "WeightPrediction",
    "build_optimizer",
    "clip_coefficient",
    "grad_sq_norm",
    "grads_finite",
    "lion_update",
    "lr_at",
    "make_correction",
    "muon_group",
    "route_parameters",
    "scale_grads_",
    "sum_over_stages",
    "wants_weight_decay",
    "warmup_steps",
]
