"""The collectives of a stage sharded over its dp group (``shard="fsdp"``, distributed/fsdp.py).

``Rows`` is FSDP2's dim-0 layout of one tensor over the D replicas; ``DpGroup`` runs the two
collectives FSDP2 runs, over flat buffers of every tensor of one dtype (one collective per
dtype, as FSDP2's copy-in and copy-out): the all-gather that makes the whole tensors from the
replicas' rows, and the reduce-scatter that leaves each replica its rows of the mean. Each wait
is bounded by the pipeline's timeout and names what it carried.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from nobubble.runtime.distributed.waits import Handle


@dataclass(frozen=True)
class Rows:
    """The dim-0 layout of a tensor of ``shape`` over ``size`` ranks (FSDP2's Shard(0)): rank r
    holds rows r·per .. min((r+1)·per, n), so the last ranks may hold fewer rows, or none."""

    shape: torch.Size
    size: int

    @property
    def per(self) -> int:
        return -(-self.shape[0] // self.size)

    @property
    def slot(self) -> int:
        """Elements of one rank's part in a flat buffer: ``per`` rows, padded."""
        return self.per * math.prod(self.shape[1:])

    def span(self, rank: int) -> tuple[int, int]:
        start = min(rank * self.per, self.shape[0])
        return start, min(start + self.per, self.shape[0])

    def local(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        start, stop = self.span(rank)
        return full[start:stop]


def _by_dtype(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` grouped by dtype, in a fixed order (one flat buffer each)."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return [groups[d] for d in sorted(groups, key=str)]


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group: Any) -> Any:
    gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)  # renamed in 2.13
    return gather(out, inp, group=group, async_op=True)


def _reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: Any) -> Any:
    scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    return scatter(out, inp, op=dist.ReduceOp.SUM, group=group, async_op=True)


class DpGroup:
    """The collectives of one stage's dp group (its D replicas), each waited for with the
    pipeline's timeout and a message naming what it carried."""

    def __init__(self, mesh: DeviceMesh, timeout_s: float, stage: int) -> None:
        self.mesh, self.group = mesh, mesh.get_group()
        self.rank, self.size = mesh.get_local_rank(), mesh.size()
        self.timeout_s, self.stage = timeout_s, stage
        self.on_cuda = mesh.device_type == "cuda"

    def _wait(self, work: Any, what: str) -> None:
        Handle([work], self.on_cuda).wait(self.timeout_s, f"the dp {what} of stage {self.stage}")

    def gather(
        self,
        shards: Sequence[torch.Tensor],
        layouts: Sequence[Rows],
        into: Sequence[torch.Tensor],
        what: str = "all-gather",
    ) -> None:
        """``into[i]`` = the whole tensor whose part on this rank is ``shards[i]``."""
        for idx in _by_dtype(shards):
            slot = sum(layouts[i].slot for i in idx)
            send = shards[idx[0]].new_zeros(slot)  # the padding rows stay zero
            offset = 0
            for i in idx:
                n = shards[i].numel()
                send[offset : offset + n].copy_(shards[i].reshape(-1))
                offset += layouts[i].slot
            received = send.new_empty(self.size * slot)
            self._wait(_all_gather(received, send, self.group), what)
            grid = received.view(self.size, slot)  # (D, slot): rank r's parts in row r
            offset = 0
            for i in idx:
                rows = layouts[i]
                whole = grid[:, offset : offset + rows.slot].reshape(-1, *rows.shape[1:])
                into[i].copy_(whole[: rows.shape[0]])  # (D·per, ...) -> (n, ...)
                offset += rows.slot

    def reduce_scatter_mean(
        self, fulls: Sequence[torch.Tensor], layouts: Sequence[Rows]
    ) -> list[torch.Tensor]:
        """This rank's rows of the mean over the dp group of each of ``fulls``: a SUM, then a
        division by D (the arithmetic of the replicated all-reduce)."""
        out: list[torch.Tensor] = list(fulls)
        for idx in _by_dtype(fulls):
            slot = sum(layouts[i].slot for i in idx)
            send = fulls[idx[0]].new_zeros(self.size, slot)  # row r: what rank r receives
            offset = 0
            for i in idx:
                rows = layouts[i]
                for r in range(self.size):
                    part = rows.local(fulls[i], r).reshape(-1)
                    send[r, offset : offset + part.numel()].copy_(part)
                offset += rows.slot
            mine = send.new_empty(slot)
            self._wait(_reduce_scatter(mine, send.view(-1), self.group), "reduce-scatter")
            mine.div_(self.size)
            offset = 0
            for i in idx:
                rows = layouts[i]
                start, stop = rows.span(self.rank)
                shape = (stop - start, *rows.shape[1:])
                out[i] = mine[offset : offset + math.prod(shape)].view(shape)
                offset += rows.slot
        return out

    def sum(self, value: torch.Tensor, what: str) -> torch.Tensor:
        """The float64 sum over the dp group of one number per rank, added in dp-rank order
        (the same bits on every replica, whatever order a backend's all-reduce adds in)."""
        share = value.detach().to(self.mesh.device_type, torch.float64).reshape(1)
        parts = share.new_empty(self.size)
        self._wait(_all_gather(parts, share, self.group), what)
        total = torch.zeros((), dtype=torch.float64, device=share.device)
        for r in range(self.size):
            total = total + parts[r]
        return total
