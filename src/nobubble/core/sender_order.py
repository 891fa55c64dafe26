"""The communication plan of a rank that holds several stages: receives in the sender's order.

With one stage per rank, ``comm.rank_batches`` pairs each action's receive with the previous
action's send, and every receive is posted by its consumer. With several stages per rank
(interleaved and V placements) that is not enough: a rank sends a neighbour messages of two of
its stages (ZB-V's rank r sends stage r's activations and stage 2P-1-r's input gradients both
to rank r+1), the neighbour consumes them in its own order, and with tags ignored (NCCL) the
k-th receive on b from a meets the k-th send a->b whatever the receiver meant it for. So here:

1. Every message gets one key, the same on both ranks: (batch, finish time of its producer in
   a simulation of the batch with unit costs and free transfers, sender, sender's position).
   The simulation gives an order that respects every dependency; its times are not a forecast.
2. Each rank posts its operations (the sends of its stages' outputs and the receives of their
   inputs) in key order. A send goes right after the action that produced it; a receive right
   before its consumer, or earlier, with the next operation in key order when that one is
   posted before the consumer's turn: its tensor then waits in a buffer of the transport until
   the consumer runs. So a send and a receive that are next in key order progress in one
   batch, the pairing of the 1F1B steady state.
3. Consecutive operations at one position form one batch, in key order.

Why it completes under NCCL's rules (``comm.check_communication`` replays it anyway): take the
message with the smallest key not yet delivered. On both its ranks every operation of a smaller
key is done, and batches hold runs of consecutive keys, so the batches holding its send and its
receive are both active: it completes, and by induction every message does. Positions never decrease
along the key order: a send of a smaller key than a receive comes from an action that finished
before the receive's consumer started, so it is posted before that consumer too.

The schedules this serves flush between batches (every message of batch j is produced and
consumed between the ranks' steps j and j+1), and each batch is lowered on its own: batch j's
operations are posted at or after the rank's first action of batch j, after batch j-1's gather
and drain point, so nothing is pending at a collective, and a longer or drained schedule has the
same plan for the batches already run (``Pipeline`` regenerates its schedule as it goes).
"""

from __future__ import annotations

from collections.abc import Collection

from nobubble.core.comm_ops import SEND, Batch, CommOp, incoming, outgoing, with_collectives
from nobubble.core.deps import remote_dependency
from nobubble.core.ir import STEP, Action, B, F, I, Schedule, ScheduleError, W

# Relative costs of the simulation that orders the messages (any positive costs give a valid
# order; these are the zero-bubble paper's unit costs).
COSTS = {F: 1, B: 2, I: 1, W: 1, STEP: 0}

Key = tuple[int, int, int, int]  # (batch, producer's finish time, sender rank, sender position)


def batch_of(action: Action, num_microbatches: int) -> int:
    """The batch (0-based) an action belongs to; STEP j applies batch j-1."""
    return action.number - 1 if action.kind == STEP else action.number // num_microbatches


def _segments(schedule: Schedule) -> list[list[tuple[int, int]]]:
    """Per rank, per batch j, the slice of its order holding batch j's actions; refuses an
    order that does not flush between batches."""
    m, segments = schedule.num_microbatches, []
    for rank, order in enumerate(schedule.ranks):
        bounds: list[tuple[int, int]] = []
        for pos, action in enumerate(order):
            j = batch_of(action, m)
            if j == len(bounds):
                bounds.append((pos, pos + 1))
            elif j == len(bounds) - 1:
                bounds[-1] = (bounds[-1][0], pos + 1)
            else:
                raise ScheduleError(
                    f"{schedule.name}: rank {rank} runs {action} (batch {j}) at position {pos}, "
                    f"inside batch {len(bounds) - 1}: the sender-order plan of a rank with "
                    "several stages needs a flush between batches"
                )
        segments.append(bounds)
    return segments


def _finish_times(schedule: Schedule, segments: list[list[tuple[int, int]]]) -> dict[Action, int]:
    """Finish time of every action, each batch simulated from time 0 on all ranks (actions
    start when the rank is free and their input is done; transfers are free)."""
    P, finish = schedule.num_stages, dict[Action, int]()
    for j in range(max((len(s) for s in segments), default=0)):
        bounds = [s[j] if j < len(s) else (0, 0) for s in segments]
        pointer, free = [start for start, _ in bounds], [0] * len(bounds)
        progressed = True
        while progressed:
            progressed = False
            for rank, order in enumerate(schedule.ranks):
                while pointer[rank] < bounds[rank][1]:
                    action = order[pointer[rank]]
                    source = remote_dependency(action, P)
                    if source is not None and source not in finish:
                        break  # its input is not produced yet in this batch
                    ready = 0 if source is None else finish[source]
                    start = max(free[rank], ready)
                    finish[action] = free[rank] = start + COSTS[action.kind]
                    pointer[rank] += 1
                    progressed = True
        stuck = [r for r in range(len(bounds)) if pointer[r] < bounds[r][1]]
        if stuck:  # validate() refuses such a schedule first
            raise ScheduleError(f"{schedule.name}: batch {j} cannot run on ranks {stuck}")
    return finish


def sender_order_plans(
    schedule: Schedule, global_clip: bool = False, drain_points: Collection[int] = ()
) -> list[list[Batch]]:
    """Every rank's batches (what ``comm.rank_batches`` returns for a rank with several stages):
    gathers and drain points are placed as there, at the rank's first and after its last STEP."""
    P, where = schedule.num_stages, schedule.placement
    segments = _segments(schedule)
    finish = _finish_times(schedule, segments)
    position = {a: (r, i) for r, order in enumerate(schedule.ranks) for i, a in enumerate(order)}

    def key(producer: Action) -> Key:
        rank, pos = position[producer]
        return (batch_of(producer, schedule.num_microbatches), finish[producer], rank, pos)

    plans = []
    for rank, order in enumerate(schedule.ranks):
        by_position: dict[int, list[CommOp]] = {}
        for start, end in segments[rank]:
            ops: list[tuple[Key, CommOp, int]] = []  # (key, op, earliest or latest position)
            for pos in range(start, end):
                if (send := outgoing(order[pos], P, where)) is not None:
                    ops.append((key(order[pos]), send, pos + 1))
                if (recv := incoming(order[pos], P, where)) is not None:
                    ops.append((key(recv.message), recv, pos))
            ops.sort(key=lambda o: o[0])
            placed, at = [], end  # backwards: a receive no later than the operation after it
            for _, op, bound in reversed(ops):
                at = bound if op.kind == SEND else min(at, bound)
                placed.append((at, op))
            for at, op in reversed(placed):
                by_position.setdefault(at, []).append(op)
        plans.append(with_collectives(order, by_position, global_clip, drain_points))
    return plans
