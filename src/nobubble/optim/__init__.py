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
from nobubble.optim.config import OPTIMIZERS, OptimConfig
from nobubble.optim.correction import (
    DelayAwareLR,
    DelayCorrection,
    ErrorFeedback,
    NoCorrection,
    WeightPrediction,
)
from nobubble.optim.correction_registry import (
    CORRECTION_ENTRIES,
    CORRECTIONS,
    CorrectionEntry,
    CorrectionSpec,
    make_correction,
)
from nobubble.optim.lion import Lion, lion_update
from nobubble.optim.lr import lr_at, warmup_steps
from nobubble.optim.registry import (
    OPTIMIZER_ENTRIES,
    OptimizerEntry,
    optimizer_entry,
    register_optimizer,
)
from nobubble.optim.routing import (
    GroupCount,
    Routing,
    muon_group,
    route_parameters,
    wants_weight_decay,
)

__all__ = [
    "CORRECTIONS",
    "CORRECTION_ENTRIES",
    "OPTIMIZERS",
    "OPTIMIZER_ENTRIES",
    "CorrectionEntry",
    "CorrectionSpec",
    "DelayAwareLR",
    "DelayCorrection",
    "ErrorFeedback",
    "GroupCount",
    "Lion",
    "NoCorrection",
    "OptimConfig",
    "OptimizerEntry",
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
    "optimizer_entry",
    "register_optimizer",
    "route_parameters",
    "scale_grads_",
    "sum_over_stages",
    "wants_weight_decay",
    "warmup_steps",
]
