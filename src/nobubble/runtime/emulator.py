"""All stages in one process: each rank's order runs through the shared interpreter.

The emulator is a work list like the simulator's engine: it runs a rank until its next action's
input (named by the dependency rule) is not in the in-process mailbox yet, then moves to the
ranks that consume what it produced. The numbers depend only on the per-rank orders, so they are
those of the multi-process runtime, whatever the interleaving.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from nobubble.core.deps import remote_dependency
from nobubble.core.ir import STEP, Action, Schedule
from nobubble.engine.interpreter import Interpreter
from nobubble.engine.transport import InProcessTransport
from nobubble.engine.worker import StageWorker


class Emulator:
    def __init__(
        self,
        schedule: Schedule,
        interpreters: list[Interpreter],
        transport: InProcessTransport,
        start_step: int = 0,
    ) -> None:
        self.schedule, self.interpreters, self.transport = schedule, interpreters, transport
        self.pointer = [self._position_after_step(r, start_step) for r in range(schedule.num_ranks)]
        self.on_step: Callable[[Action], None] | None = None
        # optional gate: an action runs only once it says yes (the API: its batch was fed)
        self.available: Callable[[Action], bool] | None = None

    def set_schedule(self, schedule: Schedule) -> None:
        """Go on under a schedule whose actions so far are the ones already run."""
        self.schedule = schedule

    def _position_after_step(self, rank: int, step: int) -> int:
        if step == 0:
            return 0
        order = self.schedule.ranks[rank]  # past every stage's STEP of that number
        return max(i + 1 for i, a in enumerate(order) if a.kind == STEP and a.number == step)

    def _ready(self, rank: int, action: Action) -> bool:
        if self.available is not None and not self.available(action):
            return False
        if action.kind == STEP:
            global_clip = self.interpreters[rank].global_clip
            return not global_clip or self.transport.reduce_ready(action.number)
        source = remote_dependency(action, self.schedule.num_stages)
        return source is None or self.interpreters[rank].holds(source) or self.transport.has(source)

    def run(self, until_step: int) -> None:
        """Run every rank through its STEP ``until_step`` (a drain point, or the last step)."""
        num_ranks = self.schedule.num_ranks
        stop = [self._position_after_step(r, until_step) for r in range(num_ranks)]
        self._drive(stop)
        stuck = [r for r in range(num_ranks) if self.pointer[r] < stop[r]]
        assert not stuck, f"emulator stuck at {[(r, self.pointer[r]) for r in stuck]} (validate?)"

    def advance(self) -> None:
        """Run every action that can run now (inputs here, ``available`` says yes)."""
        self._drive([len(order) for order in self.schedule.ranks])

    def _drive(self, stop: list[int]) -> None:
        num_ranks = self.schedule.num_ranks
        pending = list(range(num_ranks - 1, -1, -1))
        queued = [True] * num_ranks
        while pending:
            rank = pending.pop()
            queued[rank] = False
            order, i, advanced = self.schedule.ranks[rank], self.pointer[rank], False
            while i < stop[rank] and self._ready(rank, order[i]):
                self.interpreters[rank].execute(order[i])
                if order[i].kind == STEP and self.on_step is not None:
                    self.on_step(order[i])
                i, advanced = i + 1, True
            self.pointer[rank] = i
            if advanced:  # every other rank may be waiting on this one (messages, the norm sum)
                for other in range(num_ranks):
                    if not queued[other] and self.pointer[other] < stop[other]:
                        queued[other] = True
                        pending.append(other)


def rank_interpreters(
    schedule: Schedule,
    workers: Sequence[StageWorker],
    transport: InProcessTransport,
    global_clip: bool = False,
    record: bool = False,
) -> list[Interpreter]:
    """One interpreter per rank of ``schedule``, holding that rank's stages (``workers`` are
    indexed by stage)."""
    return [
        Interpreter(
            [workers[s] for s in schedule.placement.stages_of(r)],
            transport,
            schedule.num_stages,
            global_clip,
            record=record,
        )
        for r in range(schedule.num_ranks)
    ]
