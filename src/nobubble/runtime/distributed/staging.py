"""Host staging: the gloo backend for stages on a GPU (several ranks sharing one GPU, to debug).

NCCL refuses two ranks on one GPU ("Duplicate GPU detected" at communicator set-up), so with one
GPU the only transport left is gloo. gloo moves host memory only: its ``send`` and ``recv`` hand
the tensor's data pointer to the TCP transport without looking at its device
(``ProcessGroupGloo::send`` in torch's ``ProcessGroupGloo.cpp``), and torch documents gloo on GPU
tensors for ``broadcast`` and ``all_reduce`` only. So on gloo every tensor a rank hands to
``torch.distributed`` goes through host memory:

- a tensor sent (or contributed to a collective) is copied to the host first; on a GPU that copy
  waits for the kernels that produce it, which is also when gloo may read it;
- a tensor received arrives in a host buffer of its shape and dtype, and is copied into the
  device tensor the consumer gets once the wait for it returns (``Handle.arrivals``), never
  before: gloo writes the buffer from its own thread until then.

On a CPU both are the tensor itself: no copy, no extra buffer, the bits the plan moved before.
The plan, its order and NCCL's rules are untouched; only the memory the bytes travel through
changes. Every transfer now blocks the host on the GPU and crosses PCIe twice: a mode to run
the multi-process runtime on one GPU and check its numbers, not to measure pipeline speed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from nobubble.runtime.distributed.waits import Handle

HOST = torch.device("cpu")
Arrival = tuple[torch.Tensor, torch.Tensor]  # (the consumer's tensor, the host buffer it fills)


def outbound(tensor: torch.Tensor, always: bool = False) -> torch.Tensor:
    """What gloo sends for ``tensor``: the tensor itself on the host, else a host copy.
    ``always`` copies host tensors too (a testing aid: the CPU tests run every copy)."""
    if tensor.device == HOST and not always:
        return tensor
    return tensor.to(HOST, copy=True)


def inbound(tensor: torch.Tensor, always: bool = False) -> tuple[torch.Tensor, Arrival | None]:
    """Where gloo receives ``tensor``'s bytes: the tensor itself on the host, else a host buffer
    of its shape and dtype, with the copy into ``tensor`` to make once the receive completed."""
    if tensor.device == HOST and not always:
        return tensor, None
    buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device=HOST)
    return buffer, (tensor, buffer)


def stage_ops(
    ops: Sequence[dist.P2POp], always: bool = False
) -> tuple[list[dist.P2POp], list[Arrival]]:
    """``ops`` on host memory, and the copies to make after their wait: a send carries a host
    copy of its tensor, a receive fills a host buffer."""
    staged, arrivals = [], []
    for op in ops:
        if op.op is dist.isend:
            tensor = outbound(op.tensor, always)
        else:
            tensor, arrival = inbound(op.tensor, always)
            if arrival is not None:
                arrivals.append(arrival)
        if tensor is op.tensor:
            staged.append(op)
        else:
            staged.append(dist.P2POp(op.op, tensor, op.peer, op.group, op.tag))
    return staged, arrivals


class HostStaged:
    """Put before a ``DistTransport`` (``class T(HostStaged, TreeTransport)``): everything the
    transport posts, point to point and collective, travels through host memory (module
    docstring). Its works are gloo's, so its handles wait in the process group (bounded by
    its timeout) instead of polling as on NCCL, and receives are posted early as on any gloo."""

    copy_always = False  # testing aid: stage host tensors as well (real copies on a CPU)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.on_cuda = False  # the works move host memory over gloo: not NCCL's rules

    def _launch(self, ops: list[dist.P2POp]) -> Handle:
        staged, arrivals = stage_ops(ops, self.copy_always)
        handle: Handle = super()._launch(staged)  # type: ignore[misc]
        handle.arrivals += arrivals
        return handle

    def _all_gather(self, share: torch.Tensor) -> tuple[Handle, list[torch.Tensor]]:
        handle, parts = super()._all_gather(outbound(share, self.copy_always))  # type: ignore[misc]
        if share.device == HOST and not self.copy_always:
            return handle, parts
        mine = [torch.empty_like(share) for _ in parts]
        handle.arrivals += list(zip(mine, parts, strict=True))
        return handle, mine

    def _allreduce(self, flats: list[torch.Tensor]) -> Handle:
        host = [outbound(f, self.copy_always) for f in flats]
        handle: Handle = super()._allreduce(host)  # type: ignore[misc]
        handle.arrivals += [(f, h) for f, h in zip(flats, host, strict=True) if h is not f]
        return handle
