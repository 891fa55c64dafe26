"""Parameters tied across stages (a tied embedding and head): the pair's type (``Tie``), what a
stage needs from the others before a step with tied parameters (``TieMeeting``), the squared norm of
a pair's summed gradient."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

Tie = tuple[int, str, int, str]


def tied_square(total: torch.Tensor) -> torch.Tensor:
    """The squared norm of a tied pair's summed gradient (float64), counted once globally."""
    return total.double().pow(2).sum()


@dataclass
class TieMeeting:
    """What a stage needs from the others before a step with tied parameters: every stage's
    squared gradient norm without its tied parameters, both gradients of each pair it holds a
    copy of (keyed by (stage, name)), and the squared norm of each other pair's sum (by index
    in ``ties``), which one of that pair's ranks computed."""

    squares: list[torch.Tensor]
    grads: dict[tuple[int, str], torch.Tensor]
    pair_squares: dict[int, torch.Tensor]

    @staticmethod
    def pool(shares: list[Any]) -> TieMeeting:
        """Every stage's ``share()``, all in one process (the emulator): all the gradients."""
        grads = {(s, name): g for s, share in enumerate(shares) for name, g in share[1].items()}
        return TieMeeting([share[0] for share in shares], grads, {})
