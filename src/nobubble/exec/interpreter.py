"""Executes one rank's actions through a dispatch table; shared by emulator and runtime.

The interpreter asks the dependency rule which message an action consumes and which stage
consumes its output, hands tensors between the transport and the stage worker, and records the
wall-clock span of every action (the measured timeline).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from nobubble.deps import remote_dependency, sends_after
from nobubble.exec.transport import Transport
from nobubble.exec.worker import StageWorker
from nobubble.ir import STEP, Action, B, F


class Interpreter:
    def __init__(
        self,
        worker: StageWorker,
        transport: Transport,
        num_stages: int,
        global_clip: bool = False,
        record: bool = True,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.worker, self.transport, self.num_stages = worker, transport, num_stages
        self.global_clip, self.record = global_clip, record
        self.clock = clock
        self.spans: list[tuple[Action, float, float]] = []
        self.handlers: dict[str, Callable[[Action], None]] = {
            F: self._forward,
            B: self._backward,
            STEP: self._step,
        }

    def execute(self, action: Action) -> None:
        if not self.record:
            self.handlers[action.kind](action)
            return
        start = self.clock()
        self.handlers[action.kind](action)
        self.spans.append((action, start, self.clock()))

    def _receive(self, action: Action) -> torch.Tensor | None:
        source = remote_dependency(action, self.num_stages)
        return None if source is None else self.transport.recv(source, action.stage)

    def _ship(self, action: Action, tensor: torch.Tensor | None) -> None:
        consumer = sends_after(action, self.num_stages)
        if consumer is not None:
            assert tensor is not None, f"{action} produced nothing for {consumer}"
            self.transport.send(action, tensor, consumer.stage)

    def _forward(self, action: Action) -> None:
        self._ship(action, self.worker.forward(action.number, self._receive(action)))

    def _backward(self, action: Action) -> None:
        grad_in = self.worker.backward(action.number, self._receive(action))
        self._ship(action, grad_in)
        if self.global_clip and self.worker.batch_complete:
            step = action.number // self.worker.schedule.num_microbatches + 1
            self.transport.contribute(step, action.stage, self.worker.grad_sq_norm())

    def _step(self, action: Action) -> None:
        total = self.transport.reduce(action.number, action.stage) if self.global_clip else None
        self.worker.step(action.number, total)
