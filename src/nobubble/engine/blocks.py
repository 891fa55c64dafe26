"""Activation checkpointing and regional compilation, per block of a stage
(``nobubble.model.blocks.stage_blocks``).

Both replace a block's ``forward`` by a ``BlockCall`` (an instance attribute: parameter names,
state dicts and the module tree stay as they are).

Checkpointing (``torch.utils.checkpoint``, non-reentrant) keeps a block's inputs and rebuilds
its activations when the backward first needs them. The rebuild must read the weights the
forward read, not whatever the block's attributes hold at backward time: the worker runs a
stage with ``functional_call`` on the ledger's version (a stash under 2BW and PipeDream, a
prediction under weight prediction), and that reparametrization is over when the backward
runs. So the forward captures the tensors its block read, and the rebuild runs the block on
them with ``functional_call``. Those tensors are the version's own (the master's storage under
a live backward rule such as PACI's, so a rebuild there reads the live weights, as PACI's
backward does). A split backward (zb-h1, zbv, dualpipev) walks the same graph: non-reentrant
checkpointing leaves its nodes as they are, and each autograd call (I, then W) rebuilds the
activations it needs once; W finds its inputs because the version's tensors stay alive with the
pending micro-batch (``Pending.weights``) until W has run.

Compilation (``torch.compile``, regional) compiles each block's own forward; under
checkpointing the compiled forward is what the checkpoint runs and rebuilds.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from nobubble.model.blocks import stage_blocks

CHECKPOINTING = ("none", "full", "selective")


def read_weights(block: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors ``block`` reads now (a version's, inside the worker's functional_call)."""
    return {**dict(block.named_parameters()), **dict(block.named_buffers())}


class BlockCall:
    """A block's forward: compiled or not, under a checkpoint or not."""

    def __init__(self, block: nn.Module, checkpointed: bool, compiled: bool) -> None:
        self.block, self.checkpointed, self.compiled = block, checkpointed, compiled
        self.run: Any = block.forward  # the block's own forward (a bound method)
        if compiled:
            self.run = torch.compile(self.run)
        self.rebuilding = False  # inside the checkpointed function: run the block itself

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.checkpointed or self.rebuilding:
            return self.run(*args, **kwargs)
        weights = read_weights(self.block)
        return checkpoint(self._on, weights, *args, use_reentrant=False, **kwargs)

    def _on(self, weights: dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        """The block on ``weights``: the forward itself, and again at each rebuild."""
        self.rebuilding = True
        try:
            return functional_call(self.block, weights, args, kwargs)
        finally:
            self.rebuilding = False


def wrap_blocks(
    stage: nn.Module, checkpointing: str, every: int, compiled: bool, index: int | None = None
) -> list[str]:
    """Checkpoint (all blocks, or every ``every``-th under "selective") and/or compile the
    blocks of ``stage`` in place; returns the names of the blocks checkpointed or compiled."""
    assert checkpointing in CHECKPOINTING, checkpointing
    for module in stage.modules():  # an earlier pipeline's wrapping of the same modules
        if isinstance(module.__dict__.get("forward"), BlockCall):
            del module.forward
    if checkpointing == "none" and not compiled:
        return []
    wrapped = []
    for i, (name, block) in enumerate(stage_blocks(stage, index)):
        chosen = checkpointing == "full" or (checkpointing == "selective" and i % every == 0)
        if not (chosen or compiled):
            continue
        block.forward = BlockCall(block, chosen, compiled)
        wrapped.append(name)
    return wrapped


__all__ = [
    "CHECKPOINTING",
    "BlockCall",
    "read_weights",
    "wrap_blocks",
]
