"""The blocks of a stage: the repeated units that activation checkpointing recomputes and
regional compilation compiles, one at a time.

A stage's blocks are the children of the stage itself when it is an ``nn.Sequential``, else the
entries of its first ``nn.ModuleList`` or ``nn.ModuleDict`` in registration order: the layers of
nobubble's GPT stages (``StageModule.layers``) and of Hugging Face stages (``HFStage``'s block
list). A block is called as a module (``block(...)``), so wrapping its forward changes no
parameter name."""

from __future__ import annotations

from torch import nn


def stage_blocks(stage: nn.Module, index: int | None = None) -> list[tuple[str, nn.Module]]:
    """The (name within the stage, module) of each block of ``stage``, in order; a stage in
    which none can be found is refused with the ways to give them (``index``: its number in
    the message)."""
    if isinstance(stage, nn.Sequential):
        return list(stage.named_children())
    for name, module in stage.named_modules():
        if isinstance(module, nn.ModuleList | nn.ModuleDict) and len(module) > 0:
            prefix = f"{name}." if name else ""
            return [(prefix + key, block) for key, block in module.named_children()]
    which = "a stage" if index is None else f"stage {index}"
    raise ValueError(
        f"{which} ({type(stage).__name__}) has no blocks to checkpoint or compile: a stage's "
        "blocks are its children when it is an nn.Sequential, else the entries of its first "
        "nn.ModuleList or nn.ModuleDict; hold the repeated layers in one of those, or set "
        "activation_checkpointing='none' and compile=False"
    )


__all__ = [
    "stage_blocks",
]
