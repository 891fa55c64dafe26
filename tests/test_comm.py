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


# Schedules with several stages per rank are checked apart, at the end: the per-action pairing
# does not lower all of them yet.
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


def test_one_f_one_b_batches_pair_each_send_with_the_next_receive():
    """The Megatron pattern at P=2, M=2, pinned as a literal table."""
    schedule = build_schedule("1f1b", 2, 2, 1)
    a = Action.parse

    def send(text: str, peer: int) -> CommOp:
        return CommOp(SEND, peer, a(text))

    def recv(text: str, peer: int) -> CommOp:
        return CommOp(RECV, peer, a(text))

    assert [str(x) for x in schedule.ranks[0]] == ["0F0", "0F1", "0B0", "0B1", "0STEP1"]
    assert rank_batches(schedule, 0, global_clip=True, drain_points=[1]) == [
        Batch(1, (send("0F0", 1),)),
        Batch(2, (send("0F1", 1), recv("1B0", 1))),
        Batch(3, (recv("1B1", 1),)),
        Batch(4, (CommOp(GATHER, -1, a("0STEP1")),)),
        Batch(5, (CommOp(DRAIN, -1, a("0STEP1")),)),
    ]
    assert [str(x) for x in schedule.ranks[1]] == ["1F0", "1B0", "1F1", "1B1", "1STEP1"]
    assert rank_batches(schedule, 1, global_clip=True, drain_points=[1]) == [
        Batch(0, (recv("0F0", 0),)),
        Batch(2, (send("1B0", 0), recv("0F1", 0))),
        Batch(4, (send("1B1", 0),)),
        Batch(4, (CommOp(GATHER, -1, a("1STEP1")),)),
        Batch(5, (CommOp(DRAIN, -1, a("1STEP1")),)),
    ]


def test_the_old_prefetching_order_deadlocks_and_the_cycle_is_printed():
    """Receives posted one action ahead, each operation alone: gloo forgave it, NCCL would not."""
    schedule = build_schedule("1f1b", 2, 2, 3)
    with pytest.raises(CommDeadlock) as failure:
        check_communication(schedule, planner=prefetch_batches)
    message = str(failure.value)
    print("\n" + message)
    assert "1f1b (P=2, M=2) deadlocks under NCCL's rules" in message
    # the cycle: rank 0 waits in a receive for rank 1, which waits in a receive for rank 0
    assert "rank 0 is blocked in its batch 1 {recv 1B0 from rank 1}" in message
    assert "rank 1 is blocked in its batch 1 {recv 0F1 from rank 0}" in message


@pytest.mark.parametrize("name", ["2bw", "paci"])
def test_the_old_prefetching_order_deadlocks_on_asynchronous_schedules_too(name):
    with pytest.raises(CommDeadlock, match="deadlocks under NCCL's rules"):
        check_communication(build_schedule(name, 2, 2, 3), planner=prefetch_batches)


def test_messages_in_a_different_order_are_refused_since_tags_are_ignored():
    """GPipe's last stage used to post the receive of 0F1 before that of 0F0: with tags ignored
    the first message to arrive (0F0) would land in the buffer meant for 0F1."""
    with pytest.raises(CommDeadlock, match=r"message 0 from rank 0 to rank 1 is 0F0 but rank 1 "):
        check_communication(build_schedule("gpipe", 2, 2, 1), planner=prefetch_batches)


def test_global_clipping_on_an_asynchronous_schedule_deadlocks():
    """Why the config refuses --clip-scope global for asynchronous schedules: the collective
    of stage 1's step waits for stage 0, whose next batch waits for stage 1."""
    with pytest.raises(CommDeadlock, match="gather for"):
        check_communication(build_schedule("pipedream", 2, 1, 2), global_clip=True)


def test_a_rank_that_skips_a_collective_is_named():
    schedule = build_schedule("1f1b", 2, 1, 2)

    def planner(s, rank, global_clip, drains):
        return rank_batches(s, rank, global_clip, drains if rank == 0 else [2])

    with pytest.raises(CommDeadlock, match="rank 1 joins the collectives"):
        check_communication(schedule, drain_points=[1, 2], planner=planner)


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
