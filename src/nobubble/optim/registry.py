"""The optimizer registry: one entry per optimizer name, carrying how it is built, what it works
with (sharded stages, the fused AdamW kernel) and its help text.

An entry builds the stage's single optimizer (``build``: over every tensor, or, for a matrix
optimizer, over the tensors that are not 2-D hidden matrices) and, for a matrix optimizer
(Muon and its variants), the optimizer of the hidden matrices (``matrix``). Adding an optimizer is
one ``register_optimizer`` call beside its code (library.py holds pytorch-optimizer's); the
command line's choices, ``OptimConfig``'s checks and ``build_optimizer`` read the registry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

import nobubble.optim.lookahead as lookahead
import nobubble.optim.rotation as rotation
from nobubble.optim.lion import Lion


class OptimSettings(Protocol):
    """What a builder reads of ``nobubble.optim.OptimConfig`` (config.py, which imports this
    module, documents the fields)."""

    lr: float
    eps: float
    momentum: float
    nesterov: bool
    ns_steps: int
    fused_adamw: bool

    @property
    def resolved_betas(self) -> tuple[float, float]: ...


Groups = list[dict[str, Any]]
Builder = Callable[[Any, Groups], torch.optim.Optimizer]
# (one of the stage's torch optimizers, the stage's delay, the pipeline's number of stages)
DelayHook = Callable[[torch.optim.Optimizer, float, int], None]


@dataclass(frozen=True)
class OptimizerEntry:
    """A registered optimizer.

    betas: the (beta1, beta2) used when ``OptimConfig.betas`` is None; None: the optimizer
        takes no pair, and a given pair is refused, saying ``own_betas`` (what it uses instead).
    matrix: builds the optimizer of the 2-D hidden matrices (routing.py routes them), None for
        an optimizer that steps every tensor itself.
    sharded: runs on a stage sharded with FSDP2 (elementwise updates run on each shard as on
        the whole tensor; Muon's Newton-Schulz runs on the gathered matrix).
    fused_adamw: runs torch's AdamW (alone, or beside the matrices), which ``fused_adamw`` fuses.
    library: comes from pytorch-optimizer (the ``optim`` extra).
    on_delay: reads the stage's delay: called on each of the stage's torch optimizers before
        every step with the delay the correction receives (the ledger's, engine/worker_step.py)
        and the pipeline's number of stages; None: the optimizer ignores the delay.
    """

    name: str
    help: str
    build: Builder
    betas: tuple[float, float] | None = (0.9, 0.95)
    own_betas: str = ""
    matrix: Builder | None = None
    sharded: bool = False
    fused_adamw: bool = False
    library: bool = False
    on_delay: DelayHook | None = None

    def check_shard(self, shard: str) -> None:
        if shard == "fsdp" and not self.sharded:
            usable = ", ".join(n for n, e in OPTIMIZER_ENTRIES.items() if e.sharded)
            raise ValueError(
                f"optimizer={self.name!r} with shard='fsdp': its update reads whole matrices and "
                f"has not been written for sharded parameters; use one of {usable} (Muon runs "
                "Newton-Schulz on the gathered matrix), or shard='none'"
            )


OPTIMIZER_ENTRIES: dict[str, OptimizerEntry] = {}


def register_optimizer(entry: OptimizerEntry) -> OptimizerEntry:
    """Add ``entry`` to the registry (the CLI's choices, its help and the checks follow)."""
    OPTIMIZER_ENTRIES[entry.name] = entry
    return entry


def optimizer_entry(name: str) -> OptimizerEntry:
    if name not in OPTIMIZER_ENTRIES:
        raise ValueError(
            f"optimizer name={name!r} is unknown: use one of {tuple(OPTIMIZER_ENTRIES)}"
        )
    return OPTIMIZER_ENTRIES[name]


def adamw(cfg: OptimSettings, groups: Groups) -> torch.optim.Optimizer:
    """torch's AdamW; ``fused_adamw``: one pass over every tensor, no per-tensor scratch."""
    fused = {"fused": True} if cfg.fused_adamw else {}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.resolved_betas, eps=cfg.eps, **fused)


def _nadam(cfg: OptimSettings, groups: Groups) -> torch.optim.Optimizer:
    return torch.optim.NAdam(
        groups, lr=cfg.lr, betas=cfg.resolved_betas, eps=cfg.eps, decoupled_weight_decay=True
    )


def _lion(cfg: OptimSettings, groups: Groups) -> torch.optim.Optimizer:
    return Lion(groups, lr=cfg.lr, betas=cfg.resolved_betas)


def _muon(cfg: OptimSettings, groups: Groups) -> torch.optim.Optimizer:
    return torch.optim.Muon(
        groups,
        lr=cfg.lr,
        momentum=cfg.momentum,
        nesterov=cfg.nesterov,
        ns_steps=cfg.ns_steps,
        adjust_lr_fn="match_rms_adamw",  # update RMS ~ AdamW's, so one lr serves both sides
    )


for _entry in (
    OptimizerEntry("adamw", "AdamW", adamw, sharded=True, fused_adamw=True),
    OptimizerEntry(
        "muon",
        "Muon on the 2-D hidden matrices, AdamW on embeddings, heads and 1-D tensors",
        adamw,  # the AdamW side: embeddings, head, norms
        matrix=_muon,
        sharded=True,
        fused_adamw=True,
    ),
    OptimizerEntry("nadam", "NAdam, decoupled weight decay", _nadam, sharded=True),
    # Lion's own paper (arXiv 2302.06675) recommends (0.9, 0.99)
    OptimizerEntry("lion", "Lion (sign update)", _lion, betas=(0.9, 0.99), sharded=True),
):
    register_optimizer(_entry)


def _delay_nadam(cfg: OptimSettings, groups: Groups) -> torch.optim.Optimizer:
    # built for one stage at delay 0; the worker gives it P and each step's delay (on_delay)
    return lookahead.build_delay_nadam(groups, lr=cfg.lr, betas=cfg.resolved_betas, eps=cfg.eps)


def _set_delay(opt: torch.optim.Optimizer, delay: float, stages: int) -> None:
    assert isinstance(opt, lookahead.DelayNAdam), "nadam-delay builds one DelayNAdam"
    opt.set_delay(delay, stages)


def _rotation(cfg: OptimSettings, groups: Groups) -> torch.optim.Optimizer:
    return rotation.build_basis_rotation(groups, lr=cfg.lr, betas=cfg.resolved_betas, eps=cfg.eps)


for _entry in (
    # arXiv 2505.01099's published runs use beta1 = 0.99, where the delay changes nothing; give
    # a smaller beta1 (betas=(0.9, 0.999)) for the delay to move it
    OptimizerEntry(
        "nadam-delay",
        "NAdam whose beta1 rises toward 0.99 with each stage's delay from the ledger (the "
        "delay-aware Nesterov look-ahead of arXiv 2505.01099)",
        _delay_nadam,
        betas=lookahead.DEFAULT_BETAS,
        sharded=True,
        on_delay=_set_delay,
    ),
    # the paper's rotated set is the hidden matrices; the rest goes to AdamW with the same
    # betas, as Muon's routing gives it
    OptimizerEntry(
        "rotation",
        "Adam in the gradients' eigenbasis on the 2-D hidden matrices (basis rotation, arXiv "
        "2602.03515), AdamW on the rest",
        adamw,
        betas=rotation.DEFAULT_BETAS,
        matrix=_rotation,
        fused_adamw=True,
    ),
):
    register_optimizer(_entry)


__all__ = [
    "OPTIMIZER_ENTRIES",
    "OptimizerEntry",
    "adamw",
    "optimizer_entry",
    "register_optimizer",
]
