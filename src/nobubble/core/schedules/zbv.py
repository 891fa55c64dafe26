"""ZB-V (Qi et al., ICLR 2024, "Zero Bubble Pipeline Parallelism", arXiv 2401.10241, sec. 6), with
a flush between batches.

The model is cut into 2P stages placed in a V: rank r holds stage r (its first chunk, on the way
down) and stage 2P-1-r (its second chunk, on the way back), so the last rank turns the V locally
and rank 0 holds both the first and the last stage. Backwards are split into I and W. Rank r:

1. warm-up: 2(P-r)-1 forwards of chunk 0, then r pairs (F chunk 1, F chunk 0), then P-r
   triples (F, I, W) on chunk 1, whose gradient is already coming back;
2. steady: (F, I, W) on chunk 0, then (F, I, W) on chunk 1, until the forwards run out;
3. cool-down: r pairs (I chunk 0, I chunk 1), P-r pairs (I chunk 0, W chunk 0), then every W
   still pending, chunk 1's first.

For M < 2P-1 the order is built for 2P-1 micro-batches and the missing ones are left out.

Preconditions: P >= 1 ranks, exactly 2 stages per rank, M >= 1. Guarantees: batch j runs at
version j on every stage (plain gradient accumulation); with F = I = W per stage, balanced
stages and free transfers the bubble is 1/(M+...) small, close to zero for M >= 2P; rank r holds
at most 2P stage-micro-batches between F and W (2P halves of its layers: 1F1B's peak of P whole
micro-batches on stage 0). Every step is a drain point.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection

from nobubble.core.ir import Action, F, I, Schedule, ScheduleError, W
from nobubble.core.placement import Placement
from nobubble.core.schedules._order import flushed_schedule

NAME = "zbv"
SUMMARY = "synchronous: zero-bubble V, 2 stages per rank in a V, B split into I and W, flush"


def check(num_ranks: int, num_microbatches: int, virtual: int) -> None:
    if virtual != 2:
        raise ScheduleError(
            f"{NAME} places exactly 2 stages per rank in a V, got v={virtual!r}; drop "
            "--virtual-stages or set it to 2"
        )


def _batch(num_ranks: int, num_microbatches: int, rank: int, first: int) -> list[Action]:
    P, n = num_ranks, max(num_microbatches, 2 * num_ranks - 1)
    stages = (rank, 2 * P - 1 - rank)
    ran: Counter[tuple[int, str]] = Counter()  # (chunk, kind) -> actions run so far
    order: list[Action] = []

    def run(chunk: int, *kinds: str) -> None:
        for kind in kinds:
            m = ran[chunk, kind]
            ran[chunk, kind] += 1
            if m < num_microbatches:  # the padding up to 2P-1 micro-batches is left out
                order.append(Action(stages[chunk], kind, first + m))

    for _ in range(2 * (P - rank) - 1):  # warm-up
        run(0, F)
    for _ in range(rank):
        run(1, F)
        run(0, F)
    for _ in range(P - rank):
        run(1, F, I, W)
    while ran[0, F] < n or ran[1, F] < ran[0, F]:  # steady
        if ran[0, F] < n:
            run(0, F)
        run(0, I, W)
        run(1, F, I, W)
    for _ in range(rank):  # cool-down
        run(0, I)
        run(1, I)
    for _ in range(P - rank):
        run(0, I, W)
    for chunk in (1, 0):
        while ran[chunk, W] < n:
            run(chunk, W)
    assert all(ran[c, k] == n for c in (0, 1) for k in (F, I, W)), ran
    return order


def generate(
    num_stages: int,
    num_microbatches: int,
    num_steps: int,
    drain_every: int | None = None,
    drain_at: Collection[int] = (),
    virtual_stages: int = 2,
) -> Schedule:
    """``num_stages`` is P, the ranks; the schedule has 2P stages. Drains after every step
    anyway: ``drain_every`` and ``drain_at`` change nothing."""
    P, M = num_stages, num_microbatches
    check(P, M, virtual_stages)
    placement = Placement("v", P, 2)
    return flushed_schedule(NAME, placement, M, num_steps, lambda r, first: _batch(P, M, r, first))
