"""Executes one rank's actions through a dispatch table; shared by emulator and runtime.

The interpreter asks the dependency rule which message an action consumes and which stage
consumes its output, hands tensors between the transport and the stage worker, and records the
wall-clock span of every action (the measured timeline).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from nobubble.core.deps import remote_dependency, sends_after
from nobubble.core.ir import STEP, Action, B, F
from nobubble.exec.transport import Transport
from nobubble.exec.worker import StageWorker


class Interpreter:
    def __init__(
        self,
        worker: StageWorker,
        transport: Transport,
        num_stages: int,
        global_clip: bool = False,
        record: bool = True,
        clock: Callable[[], Any] = time.perf_counter,
    ) -> None:
        self.worker, self.transport, self.num_stages = worker, transport, num_stages
        self.global_clip, self.record = global_clip, record
        self.clock = clock
        # compute spans (aligned with the order) and communication spans (recv wait, send), in
        # the clock's marks: seconds, or CUDA events until the runtime's clock settles them
        self.spans: list[tuple[Action, Any, Any]] = []
        self.comm: list[tuple[str, Action, Any, Any]] = []
        self.handlers: dict[str, Callable[[Action, torch.Tensor | None], torch.Tensor | None]] = {
            F: self._forward,
            B: self._backward,
            STEP: self._step,
        }

    def execute(self, action: Action) -> None:
        """Receive what the action consumes, run it, ship what it produces; time each part.

        ``begin`` lets the transport post what its plan puts before this action (in the
        runtime: the previous action's send together with this action's receive).
        """
        t0 = self.clock()
        self.transport.begin(action)
        received = self._receive(action)
        t1 = self.clock()
        output = self.handlers[action.kind](action, received)
        t2 = self.clock()
        shipped = self._ship(action, output)
        if self.record:
            t3 = self.clock()
            self.spans.append((action, t1, t2))
            if received is not None:  # only actions that really received or sent
                self.comm.append(("recv", action, t0, t1))
            if shipped:
                self.comm.append(("send", action, t2, t3))

    def _receive(self, action: Action) -> torch.Tensor | None:
        if action.kind == STEP:  # the global gradient norm is a sum over stages
            if not self.global_clip:
                return None
            if self.worker.ties:  # every stage's share: the tied gradients travel too
                return self.transport.gather(action.number, action.stage)  # type: ignore[attr-defined]
            return self.transport.reduce(action.number, action.stage)
        source = remote_dependency(action, self.num_stages)
        return None if source is None else self.transport.recv(source, action.stage)

    def _ship(self, action: Action, tensor: torch.Tensor | None) -> bool:
        consumer = sends_after(action, self.num_stages)
        if consumer is None:
            return False
        assert tensor is not None, f"{action} produced nothing for {consumer}"
        self.transport.send(action, tensor, consumer.stage)
        return True

    def _forward(self, action: Action, received: torch.Tensor | None) -> torch.Tensor | None:
        return self.worker.forward(action.number, received)

    def _backward(self, action: Action, received: torch.Tensor | None) -> torch.Tensor | None:
        grad_in = self.worker.backward(action.number, received)
        if self.global_clip and self.worker.batch_complete:
            step = action.number // self.worker.schedule.num_microbatches + 1
            self.transport.contribute(step, action.stage, self.worker.share())
        return grad_in

    def _step(self, action: Action, total_sq_norm: torch.Tensor | None) -> None:
        self.worker.step(action.number, total_sq_norm)
        return None
