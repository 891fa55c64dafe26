"""Which tensor goes to which update rule, and which tensor gets weight decay.

Both are single, named rules so that every optimizer, the logs and the tests agree on them.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from torch import Tensor

from nobubble.optim.registry import OPTIMIZER_ENTRIES


def matrix_optimizers() -> tuple[str, ...]:
    """Optimizers that step the 2-D hidden matrices with an orthogonalized update (the
    ``muon`` group of a Routing) and everything else with AdamW (registry.py's ``matrix``)."""
    return tuple(n for n, e in OPTIMIZER_ENTRIES.items() if e.matrix is not None)


class GroupCount(NamedTuple):
    tensors: int
    elements: int


@dataclass(frozen=True)
class Routing:
    """Names of the tensors per update rule, in the order they were given.

    `muon` holds the tensors stepped by Muon or NorMuon (empty unless the optimizer is one of
    matrix_optimizers()); `adamw` holds every other tensor, stepped by AdamW, or by the single
    optimizer (NAdam, Lion, SOAP, ...) otherwise.
    """

    optimizer: str
    muon: tuple[str, ...]
    adamw: tuple[str, ...]
    numel: Mapping[str, int] = field(repr=False, hash=False)

    def counts(self) -> dict[str, GroupCount]:
        """Number of tensors and of elements per group: {"muon": ..., "adamw": ...}."""
        return {
            group: GroupCount(len(names), sum(self.numel[n] for n in names))
            for group, names in (("muon", self.muon), ("adamw", self.adamw))
        }

    def describe(self) -> str:
        """One line, e.g. `muon: 8 tensors (1,048,576 elements) | adamw: 5 tensors (...)`."""
        counts = self.counts()
        if self.optimizer not in matrix_optimizers():  # one optimizer holds everything
            c = counts["adamw"]
            return f"{self.optimizer}: {c.tensors} tensors ({c.elements:,} elements)"
        return " | ".join(
            f"{group}: {c.tensors} tensors ({c.elements:,} elements)" for group, c in counts.items()
        )


def muon_group(name: str, p: Tensor, adamw_names: Collection[str] = ()) -> str:
    """The routing rule of the "muon" optimizer, ordered: the first matching line decides."""
    # 1. Norm gains, biases and scalars are not matrices; orthogonalizing them is meaningless.
    if p.ndim != 2:
        return "adamw"
    # 2. The embedding is a lookup table and the head an output layer: their rows are not mixed
    #    by a matrix product of the hidden state, so Muon's spectral-norm geometry does not apply.
    #    A model other than nobubble's GPT names its embeddings and heads in ``adamw_names``.
    if name.startswith(("embed.", "head.")) or name in adamw_names:
        return "adamw"
    # 3. Every remaining 2-D tensor is a hidden matrix (attention wq/wk/wv/wo, MLP w1/w2/w3).
    return "muon"


def wants_weight_decay(p: Tensor) -> bool:
    """Decay matrices only; norm gains (1-D) keep weight decay 0 under every optimizer."""
    return p.ndim == 2


def route_parameters(
    named_params: Iterable[tuple[str, Tensor]],
    optimizer: str,
    adamw_names: Collection[str] = (),
    require_muon: bool = True,
) -> Routing:
    """Split `named_params` between Muon and the AdamW-side optimizer (see `muon_group`).

    For optimizers other than the matrix ones (muon, normuon, ...: ``matrix_optimizers``) every
    tensor goes to the one optimizer (`Routing.adamw`). Raises ValueError on an unknown
    optimizer, duplicate or no names, and for the matrix ones when no 2-D hidden matrix is
    present.
    """
    if optimizer not in OPTIMIZER_ENTRIES:
        raise ValueError(
            f"optimizer={optimizer!r} is unknown: use one of {tuple(OPTIMIZER_ENTRIES)}"
        )
    named = list(named_params)
    if not named:
        raise ValueError("route_parameters got no parameters: pass module.named_parameters()")
    numel: dict[str, int] = {}
    for name, p in named:
        if name in numel:
            raise ValueError(f"parameter name {name!r} appears twice: names must be unique")
        numel[name] = p.numel()
    if optimizer not in matrix_optimizers():
        return Routing(optimizer, (), tuple(numel), numel)
    groups = [(name, muon_group(name, p, adamw_names)) for name, p in named]
    muon = tuple(name for name, group in groups if group == "muon")
    if not muon and require_muon:
        raise ValueError(
            f"optimizer={optimizer!r} found no 2-D hidden matrix among {list(numel)}: it would "
            "have nothing to update; use optimizer='adamw' for this parameter set"
        )
    adamw = tuple(name for name, group in groups if group == "adamw")
    return Routing(optimizer, muon, adamw, numel)
