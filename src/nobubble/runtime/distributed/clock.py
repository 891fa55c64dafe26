"""Clocks for the measured timeline: the host's on a CPU, CUDA events on a GPU.

On a GPU the host only queues kernels, so host timestamps around an action time its launch,
not its work; ``CudaClock`` records an event on the current stream instead and turns events
into host seconds at drain points, after one synchronisation, against an anchor event whose
host time is known. ``settle`` rewrites the interpreter's spans in place; host-clock spans are
already seconds.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch


class Recorder(Protocol):
    spans: list[tuple[Any, Any, Any]]
    comm: list[tuple[str, Any, Any, Any]]


class HostClock:
    def __call__(self) -> float:
        return time.time()

    def settle(self, recorder: Recorder) -> None:
        return None


class CudaClock:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        torch.cuda.synchronize(device)
        self.anchor = torch.cuda.Event(enable_timing=True)
        self.anchor.record()
        self.anchor.synchronize()
        self.anchor_time = time.time()

    def __call__(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, mark: Any) -> float:
        if isinstance(mark, float):
            return mark
        return self.anchor_time + self.anchor.elapsed_time(mark) / 1e3

    def settle(self, recorder: Recorder) -> None:
        torch.cuda.synchronize(self.device)
        s = self.seconds
        recorder.spans[:] = [(a, s(t0), s(t1)) for a, t0, t1 in recorder.spans]
        recorder.comm[:] = [(k, a, s(t0), s(t1)) for k, a, t0, t1 in recorder.comm]
