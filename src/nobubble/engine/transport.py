"""Transports move activations and gradients between stages; the in-process one lives here.

A message is keyed by the action that produced it (``deps.remote_dependency`` of the consumer
names it), so the dependency rule also names every message. The torch.distributed transport
(runtime/distributed/transport.py) implements the same methods: it posts what
``comm.rank_batches`` plans, at ``begin``.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from nobubble.core.ir import Action
from nobubble.optim import sum_over_stages


class Transport(Protocol):
    def begin(self, action: Action) -> None:
        """The rank is about to run ``action``: post what must be posted before it."""
        ...

    def send(self, producer: Action, tensor: torch.Tensor, dst_stage: int) -> None: ...

    def recv(self, producer: Action, dst_stage: int) -> torch.Tensor: ...

    def contribute(self, step: int, stage: int, value: torch.Tensor) -> None:
        """Offer this stage's share of a sum over stages (global gradient-norm clipping)."""
        ...

    def reduce(self, step: int, stage: int) -> torch.Tensor:
        """The sum of every stage's contribution for ``step``."""
        ...


class InProcessTransport:
    """Mailboxes in one process: ``has`` lets the emulator run only actions whose input is here."""

    def __init__(self, num_stages: int) -> None:
        self.num_stages = num_stages
        self.mailbox: dict[Action, torch.Tensor] = {}
        self.shares: dict[int, dict[int, Any]] = {}
        self.reduced: dict[int, int] = {}  # step -> stages that have read the sum

    def send(self, producer: Action, tensor: torch.Tensor, dst_stage: int) -> None:
        assert producer not in self.mailbox, f"message of {producer} sent twice"
        self.mailbox[producer] = tensor

    def has(self, producer: Action) -> bool:
        return producer in self.mailbox

    def recv(self, producer: Action, dst_stage: int) -> torch.Tensor:
        return self.mailbox.pop(producer)

    def begin(self, action: Action) -> None:
        return None

    def contribute(self, step: int, stage: int, value: Any) -> None:
        self.shares.setdefault(step, {})[stage] = value

    def reduce_ready(self, step: int) -> bool:
        return len(self.shares.get(step, {})) == self.num_stages

    def reduce(self, step: int, stage: int) -> torch.Tensor:
        return sum_over_stages(self.gather(step, stage))

    def gather(self, step: int, stage: int) -> list[Any]:
        """Every stage's contribution for ``step``, in stage order."""
        shares = self.shares[step]
        ordered = [shares[s] for s in range(self.num_stages)]
        self.reduced[step] = self.reduced.get(step, 0) + 1
        if self.reduced[step] == self.num_stages:  # everyone has read it
            del self.shares[step], self.reduced[step]
        return ordered
