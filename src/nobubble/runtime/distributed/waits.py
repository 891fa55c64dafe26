"""Bounded waits on posted work: ``Handle`` (a deadline on every backend, polled on the host so that
a hung peer is named here), ``PeerTimeout``, the strict transport's queued work (``QueuedWork``),
and ``shutdown`` of the process groups."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


def shutdown() -> None:
    """Destroy every process group, then collect the reference cycles that may still hold work
    handles, buffers or groups, while the interpreter is fully alive. Left to the cyclic GC they
    may be freed during interpreter finalization, where a gloo thread that needs the GIL ends
    the process with SIGABRT (docs/runtime.md). Callers drop their own references first."""
    dist.destroy_process_group()
    gc.collect()


class PeerTimeout(TimeoutError):
    """A peer did not deliver (or accept) a message within the timeout."""


class Handle:
    """Completion of posted work: ``wait`` with a deadline, on every backend. ``arrivals`` are
    copies (destination, source) to make once the work completed: the host buffers a staged
    receive filled (``staging.py``)."""

    def __init__(self, works: Sequence[Any], on_cuda: bool) -> None:
        self.works, self.on_cuda = list(works), on_cuda
        self.arrivals: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.waited = False

    def is_completed(self) -> bool:
        return self.waited or all(w.is_completed() for w in self.works)

    def wait(self, timeout_s: float, what: str) -> None:
        """Wait once: a batch that carries several messages is waited for by each of them, and
        gloo's ``Work.wait`` is not idempotent (a second wait on a completed receive waits for
        another message on its buffer, until the timeout)."""
        if self.waited:
            return
        if self.on_cuda or any(isinstance(w, QueuedWork) for w in self.works):
            # NCCL's wait() only orders the current stream after the work; poll on the host so a
            # hung peer is reported here, within our timeout, instead of by NCCL's watchdog.
            deadline = time.monotonic() + timeout_s
            while not self.is_completed():
                if time.monotonic() > deadline:
                    raise PeerTimeout(f"no progress on {what} within {timeout_s:g} s")
                time.sleep(1e-4)
        for w in self.works:  # gloo: bounded by the process group's timeout
            w.wait()
        for destination, source in self.arrivals:
            destination.copy_(source)
        self.arrivals.clear()
        self.waited = True


class QueuedWork:
    """Completion of one batch on the strict stream, with the interface of a ``dist.Work``."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: Exception | None = None

    def is_completed(self) -> bool:
        return self.done.is_set()

    def wait(self) -> bool:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return True
