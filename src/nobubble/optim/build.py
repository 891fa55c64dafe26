"""One stage's optimizer: one or two torch optimizers behind a small, uniform face.

Each pipeline stage builds its own `StageOptimizer` over its own parameters and steps it on its
own; nothing here communicates across stages.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Collection, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from nobubble.optim.config import OptimConfig
from nobubble.optim.registry import optimizer_entry
from nobubble.optim.routing import Routing, route_parameters, wants_weight_decay

logger = logging.getLogger(__name__)


class StageOptimizer:
    """The update rule(s) of one stage, stepped together.

    `params` lists the master parameters in the order `named_params` gave them; `parts` maps a
    group of the routing ("muon", "adamw") to the torch optimizer that steps it.
    """

    def __init__(
        self,
        cfg: OptimConfig,
        named_params: list[tuple[str, nn.Parameter]],
        routing: Routing,
        parts: dict[str, torch.optim.Optimizer],
    ) -> None:
        self.cfg = cfg
        self.names = tuple(name for name, _ in named_params)
        self.params = [p for _, p in named_params]
        self.routing = routing
        self.parts = parts

    def on_delay(self, delay: float, stages: int) -> None:
        """Give the stage's delay (the ledger's, as the correction receives it) and the
        pipeline's number of stages to an optimizer that reads them (the registry entry's
        ``on_delay``) before the next step; the others ignore it."""
        hook = optimizer_entry(self.cfg.name).on_delay
        if hook is not None:
            for opt in self.parts.values():
                hook(opt, delay, stages)

    def step(self) -> None:
        for opt in self.parts.values():
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.parts.values():
            opt.zero_grad(set_to_none=set_to_none)

    @property
    def lr(self) -> float:
        return float(next(iter(self.parts.values())).param_groups[0]["lr"])

    def set_lr(self, lr: float) -> None:
        """Set the lr of every group (Muon rescales its own by 0.2 * sqrt(max(rows, cols)))."""
        if not (math.isfinite(lr) and lr >= 0):
            raise ValueError(f"lr={lr!r} is not allowed: use a finite lr >= 0")
        for opt in self.parts.values():
            for group in opt.param_groups:
                group["lr"] = lr

    def state_dict(self) -> dict[str, Any]:
        """Optimizer name, tensor names per group and each part's state (live tensors)."""
        return {
            "optimizer": self.cfg.name,
            "routing": {"muon": list(self.routing.muon), "adamw": list(self.routing.adamw)},
            "parts": {key: opt.state_dict() for key, opt in self.parts.items()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a copy of `state_dict`; refuses one saved by another optimizer or routing."""
        saved = (state_dict["optimizer"], state_dict["routing"])
        ours = (self.cfg.name, {"muon": list(self.routing.muon), "adamw": list(self.routing.adamw)})
        if saved != ours:
            raise ValueError(
                f"optimizer state saved for {saved[0]!r} with routing {saved[1]} does not match "
                f"this {ours[0]!r} optimizer with routing {ours[1]}: build the optimizer with "
                "the config and parameters the checkpoint was written with"
            )
        # torch's load keeps same-device tensors aliased; a deep copy keeps the caller's
        # state_dict from being mutated by our later steps.
        parts = copy.deepcopy(state_dict["parts"])
        for key, opt in self.parts.items():
            opt.load_state_dict(parts[key])


def _param_groups(
    names: Iterable[str], by_name: dict[str, Tensor], weight_decay: float
) -> list[dict[str, Any]]:
    """Split into a decayed group (2-D) and an undecayed one (norm gains); drop empty groups."""
    tensors = [by_name[n] for n in names]
    decay = [p for p in tensors if wants_weight_decay(p)]
    no_decay = [p for p in tensors if not wants_weight_decay(p)]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def build_optimizer(
    cfg: OptimConfig,
    named_params: Iterable[tuple[str, nn.Parameter]],
    adamw_names: Collection[str] = (),
    require_muon: bool = True,
) -> StageOptimizer:
    """Build one stage's optimizer over `named_params` (e.g. `stage_module.named_parameters()`).

    Routing follows `route_parameters` (`adamw_names`: the 2-D tensors of another model that
    Muon must leave to AdamW, its embeddings and output heads); weight decay goes to 2-D
    tensors only (embedding, head and hidden matrices), never to the 1-D norm gains, under
    every optimizer. The routing counts are logged at INFO.
    """
    named = list(named_params)
    routing = route_parameters(named, cfg.name, adamw_names, require_muon)
    logger.info("optimizer routing: %s", routing.describe())
    by_name: dict[str, Tensor] = dict(named)
    entry = optimizer_entry(cfg.name)
    parts: dict[str, torch.optim.Optimizer] = {}
    if routing.muon:
        assert entry.matrix is not None, "routing gives matrices to matrix optimizers only"
        parts["muon"] = entry.matrix(cfg, _param_groups(routing.muon, by_name, cfg.weight_decay))
    if routing.adamw:
        parts["adamw"] = entry.build(cfg, _param_groups(routing.adamw, by_name, cfg.weight_decay))
    return StageOptimizer(cfg, named, routing, parts)


__all__ = ["StageOptimizer", "build_optimizer"]
