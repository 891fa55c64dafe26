"""A stage's device: inputs checked to live on it (``expect_device``, ``misplaced``) and trees of
tensors moved to it (``to_device``)."""

from __future__ import annotations

from typing import Any

import torch


def expect_device(tensor: torch.Tensor, device: torch.device, what: str) -> torch.Tensor:
    """``tensor``, after checking it lives on the stage's device (a cheap comparison that turns
    a forgotten ``.to(device)`` into an error naming the tensor, on any machine)."""
    if tensor.device != device:
        raise RuntimeError(f"{what} is on {tensor.device}, but the stage runs on {device}")
    return tensor


def misplaced(tree: Any, device: torch.device, path: str = "state") -> list[str]:
    """Paths of the tensors of a nested dict/list/tuple that are not on ``device``."""
    if isinstance(tree, torch.Tensor):
        return [f"{path} ({tree.device})"] if tree.device != device else []
    if isinstance(tree, dict):
        return [p for k, v in tree.items() for p in misplaced(v, device, f"{path}.{k}")]
    if isinstance(tree, list | tuple):
        return [p for i, v in enumerate(tree) for p in misplaced(v, device, f"{path}[{i}]")]
    return []


def tensors_of(tree: Any) -> list[torch.Tensor]:
    """The tensors of a nested dict/list/tuple (a batch's inputs or targets)."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in tensors_of(v)]
    if isinstance(tree, list | tuple):
        return [t for v in tree for t in tensors_of(v)]
    return []


def to_device(tree: Any, device: torch.device) -> Any:
    """Every tensor of a nested dict/list/tuple moved to ``device`` (checkpoint state)."""
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, dict):
        return {k: to_device(v, device) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(to_device(v, device) for v in tree)
    return tree
