"""The gloo transport posts receives ahead of their consumers, in the plan's order.

gloo moves a message only once its receive is posted, so ``DistTransport`` posts the receives of
the next ``recv_lookahead`` actions early (distributed/transport.py, ``_post_early``). Checked
here on the plans themselves, with gloo's calls recorded instead of made: the receives keep the
plan's order (the k-th receive from a peer meets its k-th send), none is posted later than the
plan says or more than the lookahead earlier, none for a micro-batch not fed, none across a
gather or drain point, and NCCL's strict stream posts none early.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from nobubble.app.ranks.launch import free_port, rank_env
from nobubble.core.comm import (
    COLLECTIVES,
    GATHER,
    RECV,
    SEND,
    check_communication,
    incoming,
    outgoing,
)
from nobubble.core.ir import STEP
from nobubble.core.schedules import build_schedule
from nobubble.runtime.distributed import transport as tr


@dataclass
class Op:  # what dist.P2POp would carry
    fn: object
    tensor: torch.Tensor
    peer: int
    tag: int = 0


def replay(monkeypatch, kind, schedule, rank, fed_batches, global_clip=False, drains=()):
    """Run rank ``rank``'s order through the transport's side of the interpreter; returns the
    plan's receives with their planned position and the positions they were posted at."""
    monkeypatch.setattr(tr.dist, "P2POp", Op)
    monkeypatch.setattr(tr.dist, "batch_isend_irecv", lambda ops: [])
    batches = check_communication(schedule, global_clip, drains)[rank]
    transport = kind(batches, (2,), torch.float32, torch.device("cpu"), schedule.num_stages)
    m = schedule.num_microbatches
    transport.fed = lambda message: message.number // m < fed_batches
    posted: list[tuple[object, int]] = []
    launch = transport._post

    def record(ops):
        posted.extend((op.message, transport.position) for op in ops if op.kind == RECV)
        launch(ops)

    transport._post = record
    order = schedule.ranks[rank]
    for action in order:
        number = action.number - 1 if action.kind == STEP else action.number // m
        if number >= fed_batches:
            break
        transport.begin(action)
        source = incoming(action, schedule.num_stages, schedule.placement)
        if source is not None:
            transport.recv(source.message, action.stage)
        if action.kind != STEP:
            transport.send(action, torch.zeros(2), action.stage)
        elif (batch := transport._next_batch(transport.position)) and batch.ops[0].kind == GATHER:
            transport.cursor += 1  # the norm's gather, which the STEP meets (not replayed)
    planned = [(op.message, b.position) for b in batches for op in b.ops if op.kind == RECV]
    gathers = [b.position for b in batches if b.ops[0].kind in COLLECTIVES]
    return planned, posted, gathers


@pytest.mark.parametrize(
    ("name", "stages", "clip"), [("1f1b", 2, False), ("1f1b", 4, True), ("paci", 3, False)]
)
def test_receives_go_up_to_the_lookahead_early_in_the_plans_order(monkeypatch, name, stages, clip):
    schedule = build_schedule(name, stages, 4, 3)
    for rank in range(1, stages):
        planned, posted, gathers = replay(
            monkeypatch, tr.DistTransport, schedule, rank, 3, global_clip=clip
        )
        at = dict(posted)
        assert [msg for msg, _ in posted] == [msg for msg, _ in planned][: len(posted)]
        early = 0
        for message, position in planned:
            if message in at:
                assert position - tr.DistTransport.recv_lookahead <= at[message] <= position
                # never before a gather or drain point that comes before its planned position
                assert not [g for g in gathers if at[message] < g <= position], message
                early += at[message] < position
        assert early > 0, (name, rank)


def test_a_receive_of_a_micro_batch_not_fed_is_not_posted(monkeypatch):
    """Batch 1 is not fed: nothing of it is posted, however near its receives are planned."""
    schedule = build_schedule("paci", 2, 4, 3)
    _, posted, _ = replay(monkeypatch, tr.DistTransport, schedule, 1, 1)
    assert posted and all(msg.number < 4 for msg, _ in posted)


def test_without_lookahead_and_on_the_strict_stream_every_receive_is_where_the_plan_puts_it(
    monkeypatch,
):
    schedule = build_schedule("1f1b", 3, 4, 2)
    monkeypatch.setattr(tr.DistTransport, "recv_lookahead", 0)
    planned, posted, _ = replay(monkeypatch, tr.DistTransport, schedule, 1, 2)
    assert posted == planned
    monkeypatch.undo()
    assert tr.StrictTransport.recv_lookahead == 0


class GlooWork:
    """What gloo's ``Work`` does: ``is_completed`` stays False until ``wait`` is called."""

    def __init__(self) -> None:
        self.waited = False

    def is_completed(self) -> bool:
        return self.waited

    def wait(self) -> bool:
        self.waited = True
        return True


def sends_held(monkeypatch, schedule, rank) -> tuple[list[int], int]:
    """Run rank ``rank``'s order with gloo-like works; the sends in flight after each STEP, and
    the most sends the rank's plan makes in one step."""
    monkeypatch.setattr(tr.dist, "P2POp", Op)
    monkeypatch.setattr(tr.dist, "batch_isend_irecv", lambda ops: [GlooWork() for _ in ops])
    batches = check_communication(schedule, False, ())[rank]
    transport = tr.DistTransport(batches, (2,), torch.float32, torch.device("cpu"), 99)
    transport.num_stages = schedule.num_stages
    held = []
    for action in schedule.ranks[rank]:
        transport.begin(action)
        source = incoming(action, schedule.num_stages, schedule.placement)
        if source is not None:
            transport.recv(source.message, action.stage)
        if action.kind == STEP:
            held.append(len(transport.sending))
        elif outgoing(action, schedule.num_stages, schedule.placement) is not None:
            transport.send(action, torch.zeros(2), action.stage)
    transport.flush()
    m, steps = schedule.num_microbatches, len(held)
    sends = [op for b in batches for op in b.ops if op.kind == SEND]
    per_step = max(sum(op.message.number // m == j for op in sends) for j in range(steps))
    return held, per_step


@pytest.mark.parametrize(("name", "stages"), [("1f1b", 2), ("1f1b", 4), ("gpipe", 3), ("paci", 3)])
def test_on_gloo_a_sent_tensor_is_let_go_by_the_next_receive_not_kept_to_the_drain_point(
    monkeypatch, name, stages
):
    """gloo's sends report completion only once waited for, so a transport that only polls
    them would keep every step's sent activations and gradients until the next drain point:
    memory growing by a step's sends per step. Over 8 steps with no drain point, the sends held
    after each step stay within one step's sends, on every rank."""
    schedule = build_schedule(name, stages, 4, 8)
    for rank in range(stages):
        held, per_step = sends_held(monkeypatch, schedule, rank)
        assert len(held) == 8
        assert max(held) <= per_step, (name, rank, held)
        assert max(held[2:]) <= max(held[:2]), (name, rank, held)  # not growing with the steps


RANK_SCRIPT = """
import json, sys, torch, torch.distributed as dist
from nobubble.core.comm import check_communication, incoming, outgoing
from nobubble.core.ir import STEP
from nobubble.core.schedules import build_schedule
from nobubble.runtime.distributed.transport import DistTransport
dist.init_process_group("gloo")
rank, schedule = dist.get_rank(), build_schedule("1f1b", 2, 4, 8)
batches = check_communication(schedule, False, ())[rank]
transport = DistTransport(batches, (64, 64), torch.float32, torch.device("cpu"), 2, timeout_s=60)
held, sent = [], 0
for action in schedule.ranks[rank]:
    transport.begin(action)
    source = incoming(action, 2)
    if source is not None:
        got = transport.recv(source.message, action.stage)
        assert float(got[0, 0]) == source.message.number, (action, float(got[0, 0]))
    if action.kind == STEP:
        held.append(len(transport.sending))
    elif outgoing(action, 2) is not None:
        transport.send(action, torch.full((64, 64), float(action.number)), action.stage)
        sent += 1
transport.flush()
json.dump({"held": held, "sent": sent}, open(sys.argv[1] + f"/rank{rank}.json", "w"))
dist.destroy_process_group()
"""


def test_on_real_gloo_the_sends_held_stay_within_a_step_over_many_steps(tmp_path):
    """The same on two real gloo processes, the transport alone under 1f1b: every message
    arrives with its own micro-batch's contents, and the sends held after each of 8 steps
    stay within one step's (4), where polling alone held all of them (4 more per step)."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT, str(tmp_path)],
            env=rank_env(rank, 2, port),
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["sent"] == 32
        assert len(result["held"]) == 8 and max(result["held"]) <= 4, result
