"""Data parallelism across pipeline replicas: a stage's gradients averaged over its dp group.

``GradReducer`` flattens one stage's gradients into buckets of at most ``bucket_bytes`` (one
dtype per bucket, parameter order), all-reduces them with SUM and divides by the dp size when
they come back: the mean over the replicas, the same on each (every replica receives the same
sums). The transport launches it where the communication plan puts it (``comm.with_allreduce``:
after the send of the last backward's gradient) and waits for it just before the STEP, so the
previous stage gets its gradient without waiting for the all-reduce; the time between launch
and wait is the overlap, recorded per step in ``spans``.
"""

from __future__ import annotations

import time
from typing import Any

import torch

DEFAULT_BUCKET_MB = 25.0  # DDP's default bucket size


class GradReducer:
    """The dp all-reduce of one stage worker's gradients over a dp group of ``size`` ranks."""

    def __init__(self, worker: Any, size: int, bucket_mb: float) -> None:
        self.params: list[torch.nn.Parameter] = [p for _, p in worker.named]
        self.share = worker.share  # the stage's norm share, of the averaged gradients
        self.size = size
        self.bucket_bytes = max(1, int(bucket_mb * 2**20))
        self.pending: dict[int, tuple[Any, list[torch.Tensor], float]] = {}
        # step -> (launched, wait began, done) on the host clock: the overlap is the share of
        # the all-reduce that passed before the wait began
        self.spans: dict[int, tuple[float, float, float]] = {}

    def buckets(self) -> list[list[torch.nn.Parameter]]:
        groups: list[list[torch.nn.Parameter]] = []
        size, dtype = 0, None
        for p in self.params:
            nbytes = p.numel() * p.element_size()
            if not groups or p.dtype != dtype or size + nbytes > self.bucket_bytes:
                groups.append([])
                size, dtype = 0, p.dtype
            groups[-1].append(p)
            size += nbytes
        return groups

    def flat(self) -> list[torch.Tensor]:
        """One flat tensor per bucket: the gradients (zeros for a parameter without one)."""
        out = []
        for bucket in self.buckets():
            grads = [
                (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in bucket
            ]
            out.append(torch.cat(grads))
        return out

    def launched(self, step: int, handle: Any, flats: list[torch.Tensor]) -> None:
        self.pending[step] = (handle, flats, time.perf_counter())

    def has(self, step: int) -> bool:
        return step in self.pending

    def finish(self, step: int, timeout_s: float, what: str) -> None:
        """Wait for step ``step``'s all-reduce; write the mean back into each ``.grad``."""
        handle, flats, launched = self.pending.pop(step)
        began = time.perf_counter()
        handle.wait(timeout_s, what)
        with torch.no_grad():
            for bucket, flat in zip(self.buckets(), flats, strict=True):
                flat.div_(self.size)
                offset = 0
                for p in bucket:
                    n = p.numel()
                    value = flat[offset : offset + n].view_as(p)
                    if p.grad is None:
                        p.grad = value.clone()
                    else:
                        p.grad.copy_(value)
                    offset += n
        self.spans[step] = (launched, began, time.perf_counter())


def overlap(spans: dict[int, tuple[float, float, float]]) -> dict[str, float]:
    """Mean all-reduce time per step and the share of it hidden behind other work."""
    if not spans:
        return {"allreduce_s": 0.0, "allreduce_overlap": 0.0}
    total = sum(done - launched for launched, _, done in spans.values())
    hidden = sum(min(began, done) - launched for launched, began, done in spans.values())
    return {
        "allreduce_s": total / len(spans),
        "allreduce_overlap": hidden / total if total > 0 else 0.0,
    }
