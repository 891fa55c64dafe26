"""The per-rank communication plan completes under NCCL's rules; the old prefetching order does not.

Pure schedule tests (no torch): ``check_communication`` replays every rank's batches with one
stream per rank, rendezvous sends, tags ignored and collectives that need every rank.
"""

from __future__ import annotations

import pytest

from nobubble.core.comm import (
    DRAIN,
    GATHER,
    RECV,
    SEND,
    Batch,
    CommDeadlock,
    CommOp,
    check_communication,
    prefetch_batches,
    rank_batches,
)
from nobubble.core.ir import Action
from nobubble.core.schedules import SCHEDULE_NAMES, SCHEDULES, build_schedule

STEPS = 4


def drain_points(name: str, drain_every: int | None) -> list[int]:
    """Where the runtime meets: every step for synchronous schedules, else every drain_every
    steps and the last step (as ``assemble.Plan.drain_points`` with eval_every)."""
    every = 1 if SCHEDULES[name].synchronous else (drain_every or STEPS)
    return sorted({*range(every, STEPS, every), STEPS})


# Schedules with several stages per rank are checked below, apart: the per-action pairing does
# not lower all of them yet.
ONE_PER_RANK = [name for name in SCHEDULE_NAMES if SCHEDULES[name].placement == "one"]
GRID = [
    (name, stages, microbatches, drain_every)
    for name in ONE_PER_RANK
    for stages in range(1, 9)
    for microbatches in (1, 2, 3, 4, 8)
    for drain_every in (None, 2)
    if not (name == "2bw" and microbatches < stages - 1)  # 2bw needs M >= P-1
]


@pytest.mark.parametrize(("name", "stages", "microbatches", "drain_every"), GRID)
def test_every_schedule_completes_under_nccl_rules(name, stages, microbatches, drain_every):
    schedule = build_schedule(name, stages, microbatches, STEPS, drain_every=drain_every)
    clip_options = (False, True) if SCHEDULES[name].synchronous else (False,)
    for global_clip in clip_options:  # asynchronous schedules never clip globally
        plans = check_communication(schedule, global_clip, drain_points(name, drain_every))
        assert len(plans) == stages
        for rank, batches in enumerate(plans):  # a receive is posted by its own consumer
            order = schedule.ranks[rank]
            for batch in batches:
                for op in batch.ops:
                    if op.kind == RECV:
                        consumer = order[batch.position]
                        assert consumer.number == op.message.number, (batch, consumer)


def multi_stage_outcome(name: str, stages: int, microbatches: int) -> str:
    try:
        check_communication(build_schedule(name, stages, microbatches, STEPS), True, [1, 2, 3, 4])
    except CommDeadlock as err:
        assert "rank" in str(err)  # names the ranks and what each waits for
        return "deadlock"
    return "ok"


def test_multi_stage_schedules_are_lowered_or_refused_by_name():
    """Known limit, pinned so that a better planner shows up here: the per-action pairing lowers
    interleaved-1f1b only while M < 2P and zbv only at M = 1 or P = 1 (their steady phases send
    messages between two ranks in an order the receiver does not consume them in, and with tags
    ignored the receives must follow the sender's order). ``check_communication`` says so by
    name; a hop between two stages of one rank is never a message."""
    outcomes = {
        (name, p, m): multi_stage_outcome(name, p, m)
        for name in ("interleaved-1f1b", "zbv")
        for p in range(1, 6)
        for m in (1, 2, 3, 4, 8)
        if not (name == "interleaved-1f1b" and m >= p and m % (m // p))  # not whole rounds
    }
    lowered = {k for k, v in outcomes.items() if v == "ok"}
    assert lowered == {
        (name, p, m)
        for name, p, m in outcomes
        if p == 1 or (m < 2 * p if name == "interleaved-1f1b" else m == 1)
    }
    schedule = build_schedule("zbv", 1, 2, 1)  # both stages on rank 0: nothing to send
    assert check_communication(schedule) == [[]]
