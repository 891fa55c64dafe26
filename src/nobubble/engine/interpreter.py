"""Executes one rank's actions through a dispatch table; shared by emulator and runtime.

The interpreter asks the dependency rule which message an action consumes and which stage
consumes its output, hands tensors between the transport and the rank's stage workers, and
records the wall-clock span of every action (the measured timeline). A rank may hold several
stages (interleaved and V placements): a hand-off between two of them stays in the rank, in
``local``, and never reaches the transport.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from nobubble.core.deps import remote_dependency, sends_after
from nobubble.core.ir import STEP, Action, B, F, I, W
from nobubble.engine.transport import Transport
from nobubble.engine.worker import StageWorker


class Interpreter:
    """One rank: ``workers`` are its stages (one, or several in interleaved and V placements)."""

    def __init__(
        self,
        workers: Sequence[StageWorker],
        transport: Transport,
        num_stages: int,
        global_clip: bool = False,
        record: bool = True,
        clock: Callable[[], Any] = time.perf_counter,
    ) -> None:
        self.workers = {w.stage: w for w in workers}
        self.transport, self.num_stages = transport, num_stages
        self.local: dict[Action, Any] = {}  # hand-offs between this rank's stages, by producer
        self.global_clip, self.record = global_clip, record
        self.clock = clock
        # compute spans (aligned with the order) and communication spans (recv wait, send), in
        # the clock's marks: seconds, or CUDA events until the runtime's clock settles them
        self.spans: list[tuple[Action, Any, Any]] = []
        self.comm: list[tuple[str, Action, Any, Any]] = []
        self.handlers: dict[str, Callable[[Action, torch.Tensor | None], torch.Tensor | None]] = {
            F: self._forward,
            B: self._backward,
            I: self._backward_input,
            W: self._backward_weight,
            STEP: self._step,
        }

    def holds(self, producer: Action) -> bool:
        """Whether ``producer``'s output waits in this rank (a hand-off between its stages)."""
        return producer in self.local

    def execute(self, action: Action) -> None:
        """Receive what the action consumes, run it, ship what it produces; time each part.

        ``begin`` lets the transport post what its plan puts before this action (in the
        runtime: the previous action's send together with this action's receive).
        """
        t0 = self.clock()
        self.transport.begin(action)
        waiting = len(self.local)
        received = self._receive(action)
        remote = received is not None and len(self.local) == waiting  # a hand-off pops one
        t1 = self.clock()
        output = self.handlers[action.kind](action, received)
        t2 = self.clock()
        shipped = self._ship(action, output)
        if self.record:
            t3 = self.clock()
            self.spans.append((action, t1, t2))
            if remote:  # only actions that really received or sent
                self.comm.append(("recv", action, t0, t1))
            if shipped:
                self.comm.append(("send", action, t2, t3))

    def _receive(self, action: Action) -> torch.Tensor | None:
        if action.kind == STEP:  # the global gradient norm is a sum over stages
            if not self.global_clip:
                return None
            if self.workers[action.stage].ties:  # every stage's share: tied gradients travel
                return self.transport.gather(action.number, action.stage)  # type: ignore[attr-defined]
            return self.transport.reduce(action.number, action.stage)
        source = remote_dependency(action, self.num_stages)
        if source is None:
            return None
        if source.stage in self.workers:
            return self.local.pop(source)
        return self.transport.recv(source, action.stage)

    def _ship(self, action: Action, tensor: torch.Tensor | None) -> bool:
        consumer = sends_after(action, self.num_stages)
        if consumer is None:
            return False
        assert tensor is not None, f"{action} produced nothing for {consumer}"
        if consumer.stage in self.workers:
            self.local[action] = tensor
            return False
        self.transport.send(action, tensor, consumer.stage)
        return True

    def _forward(self, action: Action, received: torch.Tensor | None) -> torch.Tensor | None:
        return self.workers[action.stage].forward(action.number, received)

    def _backward(self, action: Action, received: torch.Tensor | None) -> torch.Tensor | None:
        grad_in = self.workers[action.stage].backward(action.number, received)
        self._gradient_done(action)
        return grad_in

    def _backward_input(self, action: Action, received: torch.Tensor | None) -> Any:
        return self.workers[action.stage].backward_input(action.number, received)

    def _backward_weight(self, action: Action, received: torch.Tensor | None) -> None:
        self.workers[action.stage].backward_weight(action.number)
        self._gradient_done(action)

    def _gradient_done(self, action: Action) -> None:
        """After a micro-batch's weight gradient (B or W): offer the batch's share once full."""
        worker = self.workers[action.stage]
        if self.global_clip and worker.batch_complete:
            step = action.number // worker.schedule.num_microbatches + 1
            self.transport.contribute(step, action.stage, worker.share())

    def _step(self, action: Action, total_sq_norm: torch.Tensor | None) -> None:
        self.workers[action.stage].step(action.number, total_sq_norm)
        return None
