"""A rank's communication plan as data: one operation (``CommOp``), the batches a rank posts
(``Batch``), the message an action receives (``incoming``) and sends (``outgoing``), the
collectives added to a plan. ``comm`` lowers schedules into them, and so does ``sender_order``
(module docstring of ``comm`` for the rules the plans obey)."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from nobubble.core.deps import remote_dependency, sends_after
from nobubble.core.ir import STEP, Action
from nobubble.core.placement import Placement, rank_of

SEND, RECV, GATHER, DRAIN = "send", "recv", "gather", "drain"


COLLECTIVES = (GATHER, DRAIN)


# the dp all-reduce of a stage's gradients: a collective of the stage's dp group, not of the
# pipeline's ranks (see with_allreduce)
ALLREDUCE = "allreduce"


class CommOp(NamedTuple):
    """One operation: ``message`` is the action whose output travels (for a gather, the STEP
    whose gradient norm every rank contributes; for a drain point, the STEP it follows, where
    the ranks meet for validation, metrics and checkpoints); ``peer`` is the other rank (-1:
    all ranks)."""

    kind: str
    peer: int
    message: Action

    def __str__(self) -> str:
        if self.kind == GATHER:
            return f"gather for {self.message}"
        if self.kind == DRAIN:
            return f"drain point after {self.message}"
        if self.kind == ALLREDUCE:
            return f"dp all-reduce for {self.message}"
        direction = "to" if self.kind == SEND else "from"
        return f"{self.kind} {self.message} {direction} rank {self.peer}"


@dataclass(frozen=True)
class Batch:
    """Operations posted together before the action at ``position`` of the rank's order
    (``position == len(order)``: after the last action)."""

    position: int
    ops: tuple[CommOp, ...]

    def __str__(self) -> str:
        return "{" + ", ".join(str(op) for op in self.ops) + "}"


def incoming(action: Action, num_stages: int, placement: Placement | None = None) -> CommOp | None:
    """The receive an action consumes, or None (first-stage forwards, last-stage backwards,
    inputs from a stage on the same rank)."""
    source = remote_dependency(action, num_stages)
    if source is None:
        return None
    peer = rank_of(source.stage, placement)
    return None if peer == rank_of(action.stage, placement) else CommOp(RECV, peer, source)


def outgoing(action: Action, num_stages: int, placement: Placement | None = None) -> CommOp | None:
    """The send that ships an action's output, or None (also when the consumer is local)."""
    consumer = sends_after(action, num_stages)
    if consumer is None:
        return None
    peer = rank_of(consumer.stage, placement)
    return None if peer == rank_of(action.stage, placement) else CommOp(SEND, peer, action)


def exchange_ops(
    previous: Action | None,
    action: Action | None,
    num_stages: int,
    placement: Placement | None = None,
) -> tuple[CommOp, ...]:
    """The batch posted before ``action``: the previous action's send, then this one's receive."""
    ops = []
    if previous is not None and (send := outgoing(previous, num_stages, placement)) is not None:
        ops.append(send)
    if action is not None and (recv := incoming(action, num_stages, placement)) is not None:
        ops.append(recv)
    return tuple(ops)


def with_collectives(
    order: Sequence[Action],
    exchanges: Mapping[int, Sequence[CommOp]],
    global_clip: bool,
    drain_points: Collection[int],
) -> list[Batch]:
    """The batches in posting order. At each position i: the drain point that action i-1 closes
    (the rank's last STEP of a step in ``drain_points``), then the point-to-point batch
    ``exchanges[i]``, then with ``global_clip`` the gather before the rank's first STEP of a
    step (after the exchange that ships the last gradient's send)."""
    first_step: dict[int, int] = {}  # step -> position of the rank's first STEP of it
    last_step: dict[int, int] = {}
    for pos, a in enumerate(order):
        if a.kind == STEP:
            first_step.setdefault(a.number, pos)
            last_step[a.number] = pos
    batches = []
    for i in range(len(order) + 1):
        previous = order[i - 1] if i else None
        action = order[i] if i < len(order) else None
        if (
            previous is not None
            and previous.kind == STEP
            and previous.number in drain_points
            and last_step[previous.number] == i - 1
        ):
            batches.append(Batch(i, (CommOp(DRAIN, -1, previous),)))
        if exchanges.get(i):
            batches.append(Batch(i, tuple(exchanges[i])))
        if global_clip and action is not None and first_step.get(action.number) == i:
            batches.append(Batch(i, (CommOp(GATHER, -1, action),)))
    return batches
