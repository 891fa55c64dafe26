"""Looped BFS, breadth-first pipeline parallelism (Lamy-Poirier, "Breadth-First Pipeline
Parallelism", arXiv 2211.05953), with a flush between batches.

The model is cut into v·P stages placed in a loop as in ``interleaved-1f1b``: rank r holds
stages r, r+P, ..., r+(v-1)P. Where interleaved 1F1B moves to a rank's next stage after a round
of P micro-batches, Looped BFS runs a stage's whole batch before the next: rank r runs the
forwards of all M micro-batches on its first stage, then on its second, ..., then the backwards
of all M on its last stage, newest micro-batch first, then on the one before. Every backward
waits for every forward of the batch, as in GPipe. The order is torch 2.13's
ScheduleLoopedBFS rank by rank (tests/test_dualpipev.py).

Preconditions: P >= 1 ranks, v >= 2 stages per rank (v = 1 is GPipe with backwards newest
first), M >= 1. Guarantees: batch j runs at version j on every stage (plain gradient
accumulation, with a stage's gradients summed newest first); rank r holds all vM
stage-micro-batches of the batch at the turn (GPipe's M whole micro-batches); with F and B
balanced over the stages, free transfers and M >= P, bubble share (P-1)/(vM+P-1), interleaved
1F1B's. Every step is a drain point.
"""

from __future__ import annotations

from collections.abc import Collection

from nobubble.core.ir import Action, B, F, Schedule, ScheduleError
from nobubble.core.placement import Placement
from nobubble.core.schedules._order import flushed_schedule

NAME = "looped-bfs"
SUMMARY = "synchronous: breadth-first looped pipeline, v stages per rank in a loop, all F then B"


def check(num_ranks: int, num_microbatches: int, virtual: int) -> None:
    if not isinstance(virtual, int) or virtual < 2:
        raise ScheduleError(
            f"{NAME} needs v >= 2 stages per rank, got v={virtual!r}; set --virtual-stages 2 or "
            "more (with one stage per rank use gpipe)"
        )


def batch_order(
    num_ranks: int, num_microbatches: int, virtual: int, rank: int, first: int
) -> list[Action]:
    """Rank ``rank``'s order for the micro-batches ``first .. first+M-1`` (no STEP)."""
    stages = [rank + k * num_ranks for k in range(virtual)]
    batch = range(first, first + num_microbatches)
    forwards = [Action(s, F, m) for s in stages for m in batch]
    return forwards + [Action(s, B, m) for s in reversed(stages) for m in reversed(batch)]


def generate(
    num_stages: int,
    num_microbatches: int,
    num_steps: int,
    drain_every: int | None = None,
    drain_at: Collection[int] = (),
    virtual_stages: int = 2,
) -> Schedule:
    """``num_stages`` is P, the ranks; the schedule has v·P stages. Drains after every step
    anyway: ``drain_every`` and ``drain_at`` change nothing."""
    P, M, v = num_stages, num_microbatches, virtual_stages
    check(P, M, v)
    placement = Placement("loop", P, v)
    return flushed_schedule(
        NAME, placement, M, num_steps, lambda r, first: batch_order(P, M, v, r, first)
    )
