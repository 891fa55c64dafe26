"""The per-rank communication plan completes under NCCL's rules; the old prefetching order does not.

Pure schedule tests (no torch): ``check_communication`` replays every rank's batches with one
stream per rank, rendezvous sends, tags ignored and collectives that need every rank.
"""

from __future__ import annotations

import itertools

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
    paired_batches,
    prefetch_batches,
    rank_batches,
)
from nobubble.core.deps import sends_after
from nobubble.core.ir import Action
from nobubble.core.schedules import SCHEDULE_NAMES, SCHEDULES, build_schedule
from nobubble.core.sender_order import batch_of

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


MULTI_STAGE_GRID = [
    (name, virtual, stages, microbatches, global_clip, drain_every)
    for name, virtual in (("interleaved-1f1b", 2), ("interleaved-1f1b", 3), ("zbv", 2))
    for stages in (2, 3, 4)
    for microbatches in sorted({1, stages, 2 * stages, 3 * stages, 4 * stages})
    for global_clip in (False, True)
    for drain_every in (None, 1)  # a drain point after the last step only, or after every step
]


@pytest.mark.parametrize(
    ("name", "virtual", "stages", "microbatches", "global_clip", "drain_every"), MULTI_STAGE_GRID
)
def test_several_stages_per_rank_complete_under_nccl_rules_in_the_senders_order(
    name, virtual, stages, microbatches, global_clip, drain_every
):
    """Every (P, M) the generators accept: the plan replays under NCCL's rules; between two
    ranks the receives follow the sender's order; a receive is posted no later than its
    consumer and no earlier than the rank's first action of its batch (so none is pending at
    the previous step's gather or drain point); no hop between stages of one rank is posted."""
    schedule = build_schedule(name, stages, microbatches, STEPS, virtual_stages=virtual)
    points = sorted({*range(drain_every or STEPS, STEPS, drain_every or STEPS), STEPS})
    plans = check_communication(schedule, global_clip, points)
    where, m = schedule.placement, microbatches
    for rank, batches in enumerate(plans):
        order = schedule.ranks[rank]
        first_of_batch, index = {}, {a: i for i, a in enumerate(order)}
        for pos, action in enumerate(order):
            first_of_batch.setdefault(batch_of(action, m), pos)
        sent, received = [], []
        for batch in batches:
            for op in batch.ops:
                if op.kind == RECV:
                    consumer = sends_after(op.message, schedule.num_stages)
                    assert where.rank_of(consumer.stage) == rank != op.peer
                    assert first_of_batch[batch_of(consumer, m)] <= batch.position
                    assert batch.position <= index[consumer], (rank, batch, consumer)
                    received.append((op.peer, op.message))
                elif op.kind == SEND:
                    assert batch.position > index[op.message], (rank, batch)
                    sent.append((op.peer, op.message))
        held = [  # receives posted ahead of their consumer: their buffers wait for it
            (batch.position, index[sends_after(op.message, schedule.num_stages)])
            for batch in batches
            for op in batch.ops
            if op.kind == RECV
        ]
        change = [0] * (len(order) + 1)
        for posted, consumed in held:
            change[posted] += 1
            change[consumed] -= 1
        most = max(itertools.accumulate(change))
        assert most <= (1 if name == "zbv" else 3), (rank, most)  # docs/runtime.md's figures
        for peer in range(stages):  # the receives from each peer in the peer's send order
            theirs = [msg for to, msg in _sends_of(plans[peer]) if to == rank]
            assert [msg for p, msg in received if p == peer] == theirs
        assert all(where.rank_of(msg.stage) == rank for _, msg in sent)


def _sends_of(batches):
    return [(op.peer, op.message) for b in batches for op in b.ops if op.kind == SEND]


def test_the_per_action_pairing_cannot_order_a_v_and_the_sender_order_can():
    """Why the receives follow the sender's order: ZB-V at P=2, M=4. Rank 0 sends rank 1 stage
    0's activations and stage 3's input gradients interleaved as it computes them; rank 1's
    order consumes them differently, so receives posted by their consumers name messages in
    another order than the sends (tags are ignored: the k-th receive meets the k-th send)."""
    schedule = build_schedule("zbv", 2, 4, 1)
    with pytest.raises(CommDeadlock, match="the two ranks must post their messages in the same"):
        check_communication(schedule, planner=paired_batches)
    plans = check_communication(schedule)  # rank_batches: sender order for several stages
    early = [  # a receive posted before its consumer's turn: its tensor waits in a buffer
        (batch.position, op.message)
        for batch in plans[1]
        for op in batch.ops
        if op.kind == RECV and schedule.ranks[1][batch.position].number != op.message.number
    ]
    assert early, "at M = 2P a V rank receives some messages ahead of their consumers"


def test_a_lone_v_rank_posts_only_its_collectives():
    schedule = build_schedule("zbv", 1, 2, 1)  # both stages on rank 0: nothing to send
    assert check_communication(schedule) == [[]]
