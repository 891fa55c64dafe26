"""One stage's optimizer: one or two torch optimizers behind a small, uniform face.

Each pipeline stage builds its own `StageOptimizer` over its own parameters and steps it on its
own; nothing here communicates across stages.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass
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
        """Optimizer name, tensor names per group, each part's state (live tensors) and, per
        part, the parameter name of each of torch's state indices (``names``: the state moves
        by name to another split, ``state_by_name``)."""
        return {
            "optimizer": self.cfg.name,
            "routing": {"muon": list(self.routing.muon), "adamw": list(self.routing.adamw)},
            "parts": {key: opt.state_dict() for key, opt in self.parts.items()},
            "names": {key: self._index_names(opt) for key, opt in self.parts.items()},
        }

    def _index_names(self, opt: torch.optim.Optimizer) -> list[str]:
        """The parameter names in the order torch numbers a part's state (group by group)."""
        name_of = {id(p): n for n, p in zip(self.names, self.params, strict=True)}
        return [name_of[id(p)] for group in opt.param_groups for p in group["params"]]

    def restaged(self, entries: dict[str, ParamState]) -> dict[str, Any]:
        """A ``state_dict`` of this optimizer assembled from other stages' saved entries
        (``state_by_name``): each parameter's state and its group's options move with it by
        name, whatever split saved them. Refuses a parameter saved under another part of the
        routing, and a group whose parameters come from groups of other options."""
        parts, names = {}, {}
        for key, opt in self.parts.items():
            index_names = names[key] = self._index_names(opt)
            state: dict[int, Any] = {}
            groups, index = [], 0
            for group in opt.param_groups:
                members = index_names[index : index + len(group["params"])]
                options = _agreed_options(key, members, entries)
                groups.append({**options, "params": list(range(index, index + len(members)))})
                for i, name in enumerate(members, start=index):
                    if entries[name].state is not None:
                        state[i] = entries[name].state
                index += len(members)
            parts[key] = {"state": state, "param_groups": groups}
        return {**self.state_dict(), "parts": parts, "names": names}

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


@dataclass(frozen=True)
class ParamState:
    """One parameter's share of a saved ``StageOptimizer.state_dict``: the routing part that
    stepped it, its group's options and its per-parameter state (None: never stepped)."""

    part: str
    options: dict[str, Any]
    state: dict[str, Any] | None


def state_by_name(state_dict: dict[str, Any]) -> dict[str, ParamState]:
    """Each parameter's entry of a saved ``StageOptimizer.state_dict``, by name. torch keys a
    state by position; the names saved beside it make it movable to another split."""
    if "names" not in state_dict:
        raise ValueError(
            f"the {state_dict['optimizer']!r} optimizer state was saved without parameter names "
            "(by an older nobubble): it cannot move to another split; resume at the --stages "
            "and --virtual-stages it was written with"
        )
    entries = {}
    for key, part in state_dict["parts"].items():
        names = state_dict["names"][key]
        for group in part["param_groups"]:
            options = {k: v for k, v in group.items() if k != "params"}
            for i in group["params"]:
                entries[names[i]] = ParamState(key, options, part["state"].get(i))
    return entries


# per-stage by design (a delay correction scales a stage's lr) and set again before every step
_STAGE_OPTIONS = ("lr",)


def _agreed_options(key: str, members: list[str], entries: dict[str, ParamState]) -> dict[str, Any]:
    """The saved group options of ``members``, which must agree (parameters that shared a
    group before the split share one after it)."""
    wrong = [n for n in members if entries[n].part != key]
    if wrong:
        raise ValueError(
            f"parameters {wrong[:3]} were stepped by the {entries[wrong[0]].part!r} part of the "
            f"optimizer and are routed to {key!r} now: resume with the routing they were saved with"
        )
    first = entries[members[0]].options
    for name in members[1:]:
        other = entries[name].options
        differ = [
            k
            for k in set(first) | set(other)
            if k not in _STAGE_OPTIONS and not _same(first.get(k), other.get(k))
        ]
        if differ:
            raise ValueError(
                f"parameters {members[0]!r} and {name!r} share an optimizer group now but were "
                f"saved with different {sorted(differ)}: this optimizer's state cannot move to "
                "another split; resume at the --stages it was written with"
            )
    return dict(first)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and torch.equal(a, b)
    return bool(a == b)


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


__all__ = ["ParamState", "StageOptimizer", "build_optimizer", "state_by_name"]
