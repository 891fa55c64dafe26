"""What ``Pipeline`` checks and resolves from its stages before any work starts (the stages
themselves, tied parameters, ranks, the device of meta stages, learning rates), and
``TorchOptimizer``: a user's ``torch.optim.Optimizer`` as a stage optimizer. The configuration's
own checks live with its specs (api/config.py and the registries)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from nobubble.core.schedules import schedule_info
from nobubble.engine.ties import Tie


class TorchOptimizer:
    """A user's ``torch.optim.Optimizer`` behind the stage-optimizer face, used as returned.

    ``set_lr(factor)`` scales each group's learning rate as built (an ``lr_schedule`` factor).
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.base_lrs = [float(g["lr"]) for g in optimizer.param_groups]

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def set_lr(self, factor: float) -> None:
        for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = base * factor

    def on_delay(self, delay: float, stages: int) -> None:
        """A user's optimizer is used as returned: the stage's delay is not given to it."""

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": "callable", "state": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("optimizer") != "callable":
            raise ValueError(
                f"optimizer state of {state.get('optimizer')!r} given to a pipeline built with a "
                "callable optimizer: build the pipeline with the optimizer it was saved with"
            )
        self.optimizer.load_state_dict(state["state"])


def check_stages(stages: Sequence[nn.Module]) -> list[nn.Module]:
    if isinstance(stages, nn.Module) or not isinstance(stages, Sequence) or not stages:
        raise TypeError(
            "stages must be a non-empty list of nn.Module, one per pipeline stage (cut a model "
            f"with nobubble.split), got {type(stages).__name__}"
        )
    owner: dict[int, tuple[int, str]] = {}
    for s, module in enumerate(stages):
        if not isinstance(module, nn.Module):
            raise TypeError(f"stage {s} is a {type(module).__name__}, not an nn.Module")
        named = list(module.named_parameters())
        if not named:
            raise ValueError(
                f"stage {s} has no parameters: a pipeline stage must own weights to train; move "
                "a split point so that every stage holds at least one layer"
            )
        for name, p in named:
            if id(p) in owner and owner[id(p)][0] != s:
                other, other_name = owner[id(p)]
                raise ValueError(
                    f"parameter {name!r} of stage {s} is also {other_name!r} of stage {other} "
                    "(tied weights): each stage must own its weights; untie them (e.g. "
                    "clone the output embedding) before splitting"
                )
            owner[id(p)] = (s, name)
    return list(stages)


def target_device(device: str | torch.device | None, runtime: str) -> torch.device | None:
    """Where stages on meta get their tensors: ``device``, or under runtime="dist" the GPU of
    LOCAL_RANK when CUDA is available (None: decide from the stages)."""
    if device is not None:
        try:
            return torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(
                f"device={device!r} is not a torch device: use 'cpu' or 'cuda:0'"
            ) from None
    if runtime == "dist" and torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return None


def fsdp_module() -> Any:
    """Sharding within a stage (runtime/distributed/fsdp.py), imported only with shard="fsdp"."""
    from nobubble.runtime.distributed import fsdp

    return fsdp


def num_ranks_of(schedule: str, num_stages: int, virtual: int) -> int:
    """P, the ranks ``num_stages`` stage modules make under ``schedule`` (v stages per rank)."""
    if num_stages % virtual == 0:
        return num_stages // virtual
    fit = ", ".join(str(virtual * p) for p in range(1, 4))
    # the looped placements take any v (virtual_stages); the V placements hold 2 per rank
    looped = schedule_info(schedule).placement == "loop"
    what = "virtual_stages" if looped else "stages per rank"
    raise ValueError(
        f"schedule={schedule!r} places {virtual} stages on each rank ({what}={virtual}), so it "
        f"needs a multiple of {virtual} stage modules, got {num_stages}: split the model into "
        f"{fit}, ... stages" + (", or set virtual_stages to a divisor of it" if looped else "")
    )


def find_ties(stages: list[nn.Module]) -> list[Tie]:
    """The (stage a, name a, stage b, name b) pairs, a < b, that stages declare tied in a
    ``tied_parameters`` dict (own name -> the other copy's name); both must start equal."""
    owner = {n: (s, p) for s, m in enumerate(stages) for n, p in m.named_parameters()}
    ties = []
    for s, module in enumerate(stages):
        for name, other in getattr(module, "tied_parameters", {}).items():
            if other not in owner or name not in owner or owner[name][0] != s:
                raise ValueError(
                    f"stage {s} declares {name!r} tied to {other!r}, but "
                    + (
                        f"no stage holds {other!r}"
                        if other not in owner
                        else f"it holds no {name!r}"
                    )
                )
            t, p = owner[other]
            both = not (p.is_meta or owner[name][1].is_meta)  # a process holds both copies
            if both and not torch.equal(p, owner[name][1]):
                raise ValueError(f"tied parameters {name!r} and {other!r} start unequal")
            a, b = sorted([(s, name), (t, other)])
            ties.append((a[0], a[1], b[0], b[1]))
    return sorted(ties)


def scaled_lr(
    lr: float | Callable[[int], float], factor: Callable[[int], float] | None
) -> Callable[[int], float]:
    base = lr if callable(lr) else (lambda step: lr)
    if factor is None:
        return base
    return lambda step: base(step) * factor(step)


def adamw_matrices(module: nn.Module) -> set[str]:
    """Names of the 2-D tensors Muon must not take: embedding tables and output heads."""
    names: set[str] = set()
    for prefix, sub in module.named_modules():
        if isinstance(sub, nn.Embedding):
            names.update(f"{prefix}.{n}" if prefix else n for n, _ in sub.named_parameters())
    for name, _ in module.named_parameters():
        parts = name.split(".")
        if any(p in ("lm_head", "head", "output", "wte", "wpe", "embed_tokens") for p in parts):
            names.add(name)
    return names


__all__ = [
    "TorchOptimizer",
    "adamw_matrices",
    "check_stages",
    "find_ties",
    "fsdp_module",
    "num_ranks_of",
    "scaled_lr",
    "target_device",
]
