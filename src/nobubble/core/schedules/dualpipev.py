"""DualPipeV (DeepSeek-AI, "DeepSeek-V3 Technical Report", arXiv 2412.19437, sec. 3.2.1, DualPipe;
its V-shaped half, DualPipeV, from deepseek-ai/DualPipe), with a flush between batches.

The model is cut into 2P stages placed in a V as in ``zbv``: rank r holds stage r (chunk 0, on
the way down) and stage 2P-1-r (chunk 1, on the way back). In the steady phase a rank runs the
forward of one micro-batch on one chunk together with the backward of another on its other chunk
(DualPipe overlaps the pair so one hides the other's communication); here the pair is two
consecutive actions, the forward first, since a rank runs one action at a time. Backwards are
fused (B: I then W right after it) except near the end, where W is held back into the cool-down
(zero bubble). Rank r of P, over n = M micro-batches:

1. 2(P-1-r) forwards on chunk 0;
2. r+1 pairs (F chunk 0, F chunk 1);
3. P-1-r triples (I chunk 1, W chunk 1, F chunk 1);
4. n-2P+r+1 rounds (F chunk 0 + B chunk 1), (F chunk 1 + B chunk 0);
5. P-1-r rounds B chunk 1, (F chunk 1 + B chunk 0);
6. r+1 pairs (backward chunk 1, backward chunk 0): fused in the first half, input gradient I
   only from the middle pair on (from its chunk-0 backward when r is even), each W queued;
7. P-1-r pairs (the oldest queued W, I chunk 0);
8. the r+1 queued W left.

A split backward is every backward split: B is written as I and W back to back. The order is
torch 2.13's ScheduleDualPipeV, rank by rank, with those two rewrites (tests/test_dualpipev.py).

Preconditions, as torch states them: exactly 2 stages per rank, M >= 2P (the number of stages).
Guarantees: batch j runs at version j on every stage (plain gradient accumulation); every step
is a drain point. Bubble and memory against DualPipe's own table: docs/semantics.md.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Collection

from nobubble.core.ir import Action, F, I, Schedule, ScheduleError, W
from nobubble.core.placement import Placement
from nobubble.core.schedules._order import flushed_schedule

NAME = "dualpipev"
SUMMARY = (
    "synchronous: DeepSeek's DualPipeV, 2 stages per rank in a V, forward and backward of two "
    "micro-batches paired, zero-bubble cool-down, flush"
)


def check(num_ranks: int, num_microbatches: int, virtual: int) -> None:
    if virtual != 2:
        raise ScheduleError(
            f"{NAME} places exactly 2 stages per rank in a V, got v={virtual!r}; drop "
            "--virtual-stages or set it to 2"
        )
    if num_microbatches < 2 * num_ranks:
        raise ScheduleError(
            f"{NAME} needs at least as many micro-batches as stages: M={num_microbatches} < "
            f"2P={2 * num_ranks} stages; set --microbatches {2 * num_ranks} or more"
        )


class _Rank:
    """One rank's order under construction: the next micro-batch per (chunk, kind) and the
    queue of held-back weight gradients."""

    def __init__(self, num_ranks: int, rank: int, first: int) -> None:
        self.stages = (rank, 2 * num_ranks - 1 - rank)
        self.first = first
        self.next: Counter[tuple[int, str]] = Counter()
        self.held: deque[Action] = deque()
        self.order: list[Action] = []

    def forward(self, chunk: int) -> None:
        self._add(chunk, F)

    def backward(self, chunk: int, hold_w: bool = False) -> None:
        """I then W (a fused B); with ``hold_w`` the W waits in the queue."""
        m = self._add(chunk, I)
        weight = Action(self.stages[chunk], W, m)
        if hold_w:
            self.held.append(weight)
        else:
            self.order.append(weight)

    def release_w(self) -> None:
        if self.held:
            self.order.append(self.held.popleft())

    def _add(self, chunk: int, kind: str) -> int:
        m = self.first + self.next[chunk, kind]
        self.next[chunk, kind] += 1
        self.order.append(Action(self.stages[chunk], kind, m))
        return m


def batch_order(num_ranks: int, num_microbatches: int, rank: int, first: int) -> list[Action]:
    """Rank ``rank``'s order for the micro-batches ``first .. first+M-1`` (no STEP)."""
    P, r = num_ranks, rank
    o = _Rank(P, r, first)
    for _ in range(2 * (P - 1 - r)):
        o.forward(0)
    for _ in range(r + 1):
        o.forward(0)
        o.forward(1)
    for _ in range(P - 1 - r):
        o.backward(1)
        o.forward(1)
    for _ in range(num_microbatches - 2 * P + r + 1):
        o.forward(0)
        o.backward(1)
        o.forward(1)
        o.backward(0)
    for _ in range(P - 1 - r):
        o.backward(1)
        o.forward(1)
        o.backward(0)
    middle = (r + 1) // 2
    for k in range(r + 1):  # the last pairs hold their W back, from the middle one on
        o.backward(1, hold_w=k > middle or (k == middle and r % 2 == 1))
        o.backward(0, hold_w=k >= middle)
    for _ in range(P - 1 - r):
        o.release_w()
        o.backward(0, hold_w=True)
    while o.held:
        o.release_w()
    assert all(o.next[c, k] == num_microbatches for c in (0, 1) for k in (F, I)), o.next
    return o.order


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
    return flushed_schedule(
        NAME, placement, M, num_steps, lambda r, first: batch_order(P, M, r, first)
    )
