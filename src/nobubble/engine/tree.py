"""Stage inputs and outputs that are a tensor, or a tuple, list or dict of tensors.

A stage boundary carries one such value per micro-batch. A tuple or list is passed to the next
stage as positional arguments, a dict as keyword arguments, a tensor as the one argument. The
gradient message going back holds one gradient per floating-point leaf, in flattening order: the
tensor itself when there is one, else a tuple. Every later micro-batch must keep the structure,
shapes and dtypes of the first one (``BoundarySpec``), so a silent reshape never reaches the
transport.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

Tree = Any  # a tensor, or a (nested) tuple / list / dict of tensors


def call_args(value: Tree) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """How a boundary value is passed to the stage module."""
    if isinstance(value, dict):
        return (), value
    if isinstance(value, tuple | list):
        return tuple(value), {}
    return (value,), {}


def tensor_leaves(value: Tree) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def non_tensor_leaves(value: Tree) -> list[str]:
    """Type names of the leaves that are not tensors (a boundary may hold tensors only)."""
    return [type(t).__name__ for t in pytree.tree_leaves(value) if not isinstance(t, torch.Tensor)]


def differentiable(value: Tree) -> list[torch.Tensor]:
    """The floating-point leaves: the ones a gradient flows through."""
    return [t for t in tensor_leaves(value) if t.is_floating_point()]


def detached(value: Tree, requires_grad: bool) -> Tree:
    """The value cut from its graph; floating leaves become grad-requiring leaves on request."""

    def cut(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        return t.requires_grad_(True) if requires_grad and t.is_floating_point() else t

    return pytree.tree_map_only(torch.Tensor, cut, value)


def moved(value: Tree, device: torch.device) -> Tree:
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(device, non_blocking=True), value)


def pack_grads(grads: list[torch.Tensor]) -> torch.Tensor | tuple[torch.Tensor, ...]:
    return grads[0] if len(grads) == 1 else tuple(grads)


def unpack_grads(message: torch.Tensor | tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    return [message] if isinstance(message, torch.Tensor) else list(message)


@dataclass(frozen=True)
class BoundarySpec:
    """Structure, shapes and dtypes of one boundary value."""

    structure: str
    leaves: tuple[tuple[tuple[int, ...], torch.dtype], ...]

    @staticmethod
    def of(value: Tree) -> BoundarySpec:
        flat, spec = pytree.tree_flatten(value)
        return BoundarySpec(str(spec), tuple((tuple(t.shape), t.dtype) for t in flat))

    def describe(self) -> str:
        shapes = ", ".join(
            f"{list(shape)} {str(dtype).removeprefix('torch.')}" for shape, dtype in self.leaves
        )
        return f"[{shapes}]"
