"""Data parallelism across pipeline replicas: a stage's gradients averaged over its dp group.

``GradReducer`` flattens one stage's gradients into buckets of at most ``bucket_bytes`` (one
dtype per bucket, parameter order), all-reduces them with SUM and divides by the dp size when
they come back: the mean over the replicas, the same on each (every replica receives the same
sums). The STEP waits for it (``finish``), so the previous stage gets its gradient without
waiting for the all-reduce.

Where it is launched: as DDP does, from inside the backward that completes the stage's batch
(its last B, or the last W of a split backward). A hook on each weight leaf of that backward
accumulates the weight's gradient into ``.grad`` as soon as autograd has it, and a bucket is
launched once all its weights are final, while autograd still computes the earlier layers'
(backward reaches the last parameters first, so buckets go from the last one down; every
replica launches them in that fixed order, as collectives must be). Buckets whose weights the
backward never reached go when it returns. A split backward's last W launches from hooks when it
is one autograd call (a stage without input gradient); its per-group calls give a weight only
part of its gradient each, so there its buckets go when W returns.

Measured (docs/runtime.md, ``nobubble train --model mini --vocab-size 1024 --data-parallel 2
--stages 2 --runtime dist --steps 20 --threads 1 --seq-len 64 --micro-batch-size 4
--microbatches 4 --bucket-mb 1`` on 2 CPU cores): the share of the all-reduce hidden went from
0.0015 (launched after the backward) to 0.63. The bucket launched first holds at most 1 MB, as
DDP's first bucket: at the default 25 MB a stage of that model was one bucket, final only at
the backward's end (0.20-0.22 hidden), and is now a 1 MB bucket and the rest (0.62-0.68). The
step time did not change beyond the runs' spread on 2 cores.

The strict transport (one serialized stream, ``--strict-p2p``) keeps the plan's placement
(``comm.with_allreduce``: after the send of the last backward's gradient), see
``StrictTransport.eager_allreduce``. Either way the buckets and the arithmetic are the same, so
the averaged gradients are bitwise equal. ``spans`` records, per step, the first launch, the
start of the wait and its end: the overlap is the share of that time not spent waiting.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

DEFAULT_BUCKET_MB = 25.0  # DDP's default bucket size
FIRST_BUCKET_MB = 1.0  # and its first bucket's: the one the backward completes first


@dataclass
class Reduction:
    """One step's all-reduce: per bucket its flat tensor once launched, the handles of the
    launches, how many of each bucket's weights are not final yet, and the next bucket to
    launch (they go from the last down)."""

    left: list[int]
    flats: dict[int, torch.Tensor] = field(default_factory=dict)
    handles: list[Any] = field(default_factory=list)
    launched: float = 0.0  # the first launch, on the host clock
    early: int = 0  # buckets launched while the backward still ran

    @property
    def next(self) -> int:
        return len(self.left) - 1 - len(self.flats)


class GradReducer:
    """The dp all-reduce of one stage worker's gradients over a dp group of ``size`` ranks."""

    def __init__(self, worker: Any, size: int, bucket_mb: float) -> None:
        self.worker = worker
        self.params: list[torch.nn.Parameter] = [p for _, p in worker.named]
        self.share = worker.share  # the stage's norm share, of the averaged gradients
        self.size = size
        self.bucket_bytes = max(1, int(bucket_mb * 2**20))
        self.groups = self.buckets()
        self.bucket_of = [k for k, bucket in enumerate(self.groups) for _ in bucket]
        # the transport's launch of some buckets' all-reduce (flat tensors -> one handle)
        self.start: Callable[[list[torch.Tensor]], Any] | None = None
        self.pending: dict[int, Reduction] = {}
        # step -> (launched, wait began, done) on the host clock: the overlap is the share of
        # the all-reduce that passed before the wait began
        self.spans: dict[int, tuple[float, float, float]] = {}
        self.early: dict[int, int] = {}  # step -> buckets launched inside its last backward

    def bind(self, start: Callable[[list[torch.Tensor]], Any], eager: bool) -> None:
        """Launch through ``start``; ``eager``: from inside the worker's last backward (the
        worker calls ``launching``), else only where the plan puts it (``launch_rest``)."""
        self.start = start
        self.worker.reducer = self if eager else None

    def buckets(self) -> list[list[torch.nn.Parameter]]:
        """Buckets in parameter order, cut from the last parameter back (the order the backward
        finishes them): the last bucket, launched first, holds at most FIRST_BUCKET_MB (or the
        bucket size if smaller), so an all-reduce starts early in the backward; the others at
        most ``bucket_bytes``; one dtype each; a parameter larger than its cap is a bucket alone."""
        groups: list[list[torch.nn.Parameter]] = []
        size, dtype = 0, None
        first = min(self.bucket_bytes, int(FIRST_BUCKET_MB * 2**20))
        for p in reversed(self.params):
            nbytes = p.numel() * p.element_size()
            cap = first if len(groups) == 1 else self.bucket_bytes
            if not groups or p.dtype != dtype or size + nbytes > cap:
                groups.append([])
                size, dtype = 0, p.dtype
            groups[-1].append(p)
            size += nbytes
        return [group[::-1] for group in groups[::-1]]

    def _flat(self, bucket: Sequence[torch.nn.Parameter]) -> torch.Tensor:
        """The bucket's gradients in one tensor (zeros for a parameter without one)."""
        zeros = torch.zeros_like
        return torch.cat([(zeros(p) if p.grad is None else p.grad).reshape(-1) for p in bucket])

    def _reduction(self, step: int) -> Reduction:
        if step not in self.pending:
            self.pending[step] = Reduction([len(b) for b in self.groups])
        return self.pending[step]

    def _launch(self, reduction: Reduction, upto: int) -> None:
        """Launch the buckets from the next one down to ``upto``, in one call."""
        ks = list(range(reduction.next, upto - 1, -1))
        if not ks:
            return
        assert self.start is not None, "GradReducer.bind was not called"
        flats = [self._flat(self.groups[k]) for k in ks]
        if not reduction.flats:
            reduction.launched = time.perf_counter()
        reduction.flats.update(zip(ks, flats, strict=True))
        reduction.handles.append(self.start(flats))

    def launch_rest(self, step: int) -> None:
        """Launch every bucket of step ``step`` not launched yet (after its last backward, or
        at the plan's position)."""
        reduction = self._reduction(step)
        self._launch(reduction, 0)
        self.early.setdefault(step, reduction.early)

    @contextlib.contextmanager
    def launching(self, step: int, leaves: Sequence[torch.Tensor]) -> Iterator[set[int]]:
        """Around step ``step``'s last backward, whose weight leaves are ``leaves`` (in
        parameter order): each leaf's gradient goes into its parameter's ``.grad`` as autograd
        produces it, and each bucket whose weights are all final is launched at once. Yields
        the indices of the parameters done so, which the caller's accumulation skips."""
        reduction = self._reduction(step)
        done: set[int] = set()

        def final(i: int, grad: torch.Tensor) -> None:
            if i in done:
                return
            p = self.params[i]
            with torch.no_grad():  # as accumulate_grads does, but never adopting ``grad``:
                if p.grad is None:  # it may be the input gradient the transport sends
                    p.grad = grad.to(p.dtype).clone()
                else:
                    p.grad.add_(grad)
            done.add(i)
            reduction.left[self.bucket_of[i]] -= 1
            upto = reduction.next
            while upto >= 0 and reduction.left[upto] == 0:
                upto -= 1
            before = len(reduction.flats)
            self._launch(reduction, upto + 1)
            reduction.early += len(reduction.flats) - before

        handles = [
            leaf.register_hook(lambda grad, i=i: final(i, grad))
            for i, leaf in enumerate(leaves)
            if leaf.requires_grad
        ]
        try:
            yield done
        finally:
            for handle in handles:
                handle.remove()

    def has(self, step: int) -> bool:
        return step in self.pending

    def finish(self, step: int, timeout_s: float, what: str) -> None:
        """Wait for step ``step``'s all-reduce; write the mean back into each ``.grad``."""
        reduction = self.pending.pop(step)
        began = time.perf_counter()
        for handle in reduction.handles:
            handle.wait(timeout_s, what)
        with torch.no_grad():
            for k, bucket in enumerate(self.groups):
                flat = reduction.flats[k]
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
        self.spans[step] = (reduction.launched, began, time.perf_counter())


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
