"""Activation checkpointing and regional compilation, per block of a stage
(``nobubble.model.blocks.stage_blocks``).

Both replace a block's ``forward`` by a ``BlockCall`` (an instance attribute: parameter names,
state dicts and the module tree stay as they are).

Checkpointing (``torch.utils.checkpoint``, non-reentrant) keeps a block's inputs and rebuilds
its activations when the backward first needs them. The rebuild must read the weights the
forward read, not whatever the block's attributes hold at backward time: the worker runs a
stage with ``functional_call`` on the ledger's version (a stash under 2BW and PipeDream, a
prediction under weight prediction), and that reparametrization is over when the backward
runs. So the forward captures the tensors its block read (a ``Capture``), and the rebuild runs
the block on them with ``functional_call``.

Under a live backward rule (PACI) those tensors are aliases on the master's storage, which the
steps between forward and backward update in place. Without checkpointing the backward then
reads activations computed from the forward's version and, through every tensor the graph saved
by reference to a weight (the weight, a view such as ``.t()``), the live weights. Non-reentrant
checkpointing keeps the forward's graph and only substitutes its saved tensors, so the rebuild
reproduces both: right before a step updates a block's parameters (``BlockCall.stash_live``,
called by the worker), every capture still to be rebuilt that reads them by reference gets a
copy of their values (one copy per parameter and step, shared by the captures of that version);
the rebuild runs the block on fresh tensors holding that copy, then writes the live values into
those tensors without bumping their version counters, so the saved references read the live
weights as the aliases do. A split backward (zb-h1, zbv, dualpipev) walks the same graph:
non-reentrant checkpointing leaves its nodes as they are, and each autograd call (I, then W)
rebuilds the activations it needs once; W finds its inputs because the version's tensors stay
alive with the pending micro-batch (``Pending.weights``) until W has run.

Compilation (``torch.compile``, regional) compiles each block's own forward; under
checkpointing the compiled forward is what the checkpoint runs and rebuilds.
"""

from __future__ import annotations

import weakref
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


class Capture:
    """The tensors one forward of a checkpointed block read, and ``stash``: their values at
    that forward, once a step has updated them in place before the rebuild (else None)."""

    __slots__ = ("__weakref__", "stash", "weights")

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        self.weights = weights
        self.stash: dict[str, torch.Tensor] | None = None

    def rebuilt_on(self) -> dict[str, torch.Tensor]:
        """The tensors a rebuild runs the block on: the captured ones, or with a stash fresh
        leaves holding it (the stash stays intact for a later rebuild of the same graph)."""
        if self.stash is None:
            return self.weights
        return {
            n: self.stash[n].clone().requires_grad_(w.requires_grad) if n in self.stash else w
            for n, w in self.weights.items()
        }

    def to_live(self, fresh: dict[str, torch.Tensor]) -> None:
        """Give the rebuild's fresh leaves the live values, through ``.data`` (a version counter
        of its own): the tensors the rebuilt graph saved by reference then read the live weights
        at backward, the activations it computed stay those of the forward's version."""
        assert self.stash is not None
        with torch.no_grad():
            for n in self.stash:
                fresh[n].data.copy_(self.weights[n])


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    sa, sb = a.untyped_storage(), b.untyped_storage()
    return sa.nbytes() > 0 and sa.data_ptr() == sb.data_ptr()


class BlockCall:
    """A block's forward: compiled or not, under a checkpoint or not."""

    def __init__(self, block: nn.Module, checkpointed: bool, compiled: bool) -> None:
        self.block, self.checkpointed, self.compiled = block, checkpointed, compiled
        self.run: Any = block.forward  # the block's own forward (a bound method)
        if compiled:
            self.run = torch.compile(self.run)
        self.rebuilding = False  # inside the checkpointed function: run the block itself
        # captures whose graph is alive (a rebuild may still come); weak: a freed graph's go
        self.pending: weakref.WeakSet[Capture] = weakref.WeakSet()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # no graph (evaluation, paci_recompute's forward): nothing is rebuilt, nothing kept
        if not self.checkpointed or self.rebuilding or not torch.is_grad_enabled():
            return self.run(*args, **kwargs)
        capture = Capture(read_weights(self.block))
        self.pending.add(capture)
        return checkpoint(self._on, capture, *args, use_reentrant=False, **kwargs)

    def _on(self, capture: Capture, *args: Any, **kwargs: Any) -> Any:
        """The block on the captured weights: the forward itself, and again at each rebuild
        (on the stash's values when a step updated them in place since)."""
        weights = capture.rebuilt_on()
        self.rebuilding = True
        try:
            return functional_call(self.block, weights, args, kwargs)
        finally:  # also when torch stops a rebuild early, once it has what the backward needs
            self.rebuilding = False
            if weights is not capture.weights:
                capture.to_live(weights)

    def stash_live(self) -> None:
        """Right before a step updates the block's parameters in place: each capture still to
        be rebuilt that reads them by reference (an alias on their storage) keeps a copy of
        their values now, the ones its forward read; one copy per parameter, shared."""
        masters = dict(self.block.named_parameters())
        copies: dict[str, torch.Tensor] = {}
        for capture in list(self.pending):
            if capture.stash is not None:  # stashed at an earlier step: the values it read
                continue
            live = [
                n
                for n, w in capture.weights.items()
                if n in masters and _shares_storage(w, masters[n])
            ]
            if not live:  # its own tensors (a stash of the schedule's, a prediction)
                continue
            for n in live:
                if n not in copies:
                    copies[n] = masters[n].detach().clone()
            capture.stash = {n: copies[n] for n in live}


def stash_bytes(calls: list[BlockCall]) -> int:
    """The bytes of the stashes alive in ``calls``' pending captures (each copy once)."""
    copies = {
        id(t): t.numel() * t.element_size()
        for call in calls
        for capture in call.pending
        if capture.stash is not None
        for t in capture.stash.values()
    }
    return sum(copies.values())


def block_calls(stage: nn.Module) -> list[BlockCall]:
    """The checkpointed blocks of ``stage`` (``wrap_blocks``'s), whose captures a step stashes."""
    calls = [m.__dict__.get("forward") for m in stage.modules()]
    return [c for c in calls if isinstance(c, BlockCall) and c.checkpointed]


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
    "Capture",
    "block_calls",
    "read_weights",
    "stash_bytes",
    "wrap_blocks",
]
