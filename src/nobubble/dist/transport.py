"""Point-to-point transport on torch.distributed, the multi-process twin of InProcessTransport.

Activations and gradients between neighbouring stages have one shape per run, agreed before
training (``(B, T, D)``), so a receive allocates its buffer without a shape exchange. Sends are
asynchronous (``batch_isend_irecv``); their handles are kept until completed so the tensors stay
alive. The receive of the next action is posted before the current one computes
(``prefetch``). Receives block, with the process group's timeout, so a dead or hung peer turns
into an error on this rank instead of a hang. Tags carry (kind, micro-batch): messages never mix.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nobubble.ir import B, Action
from nobubble.placement import rank_of

# Tag space: 2 * micro-batch + direction; evaluation traffic lives far above training traffic.
EVAL_TAG_BASE = 1 << 30


def message_tag(producer: Action) -> int:
    return 2 * producer.number + (1 if producer.kind == B else 0)


class DistTransport:
    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 collective_group: dist.ProcessGroup | None = None) -> None:
        self.shape, self.dtype, self.device = shape, dtype, device
        self.group = collective_group
        self.pending: list[tuple[dist.Work, torch.Tensor]] = []
        self.posted: dict[Action, tuple[list[dist.Work], torch.Tensor]] = {}
        self.shares: dict[int, torch.Tensor] = {}
        self.peer_of_last_wait: int | None = None

    def _reap(self) -> None:
        self.pending = [(w, t) for w, t in self.pending if not w.is_completed()]

    def send(self, producer: Action, tensor: torch.Tensor, dst_stage: int) -> None:
        tensor = tensor.contiguous()
        op = dist.P2POp(dist.isend, tensor, rank_of(dst_stage), tag=message_tag(producer))
        self.pending += [(work, tensor) for work in dist.batch_isend_irecv([op])]
        self._reap()

    def prefetch(self, producer: Action, dst_stage: int) -> None:
        """Post the receive of a later action now, so its message lands while this rank computes
        (a process blocked in a receive pays the operating system's wake-up latency)."""
        if producer in self.posted:
            return
        buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        op = dist.P2POp(dist.irecv, buffer, rank_of(producer.stage), tag=message_tag(producer))
        self.posted[producer] = (dist.batch_isend_irecv([op]), buffer)

    def recv(self, producer: Action, dst_stage: int) -> torch.Tensor:
        self.prefetch(producer, dst_stage)
        works, buffer = self.posted.pop(producer)
        self.peer_of_last_wait = rank_of(producer.stage)
        for work in works:
            work.wait()
        self.peer_of_last_wait = None
        return buffer

    def contribute(self, step: int, stage: int, value: torch.Tensor) -> None:
        self.shares[step] = value.detach().to(self.device, torch.float32).reshape(1)

    def reduce(self, step: int, stage: int) -> torch.Tensor:
        total = self.shares.pop(step)
        dist.all_reduce(total, group=self.group)  # sync schedules only: a flush anyway
        return total[0]

    def flush(self) -> None:
        """Wait for every outstanding send (before a drain point's collectives or exit)."""
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()
