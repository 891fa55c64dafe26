"""Interleaved 1F1B (Narayanan et al., SC 2021, "Efficient Large-Scale Language Model Training on
GPU Clusters Using Megatron-LM", arXiv 2104.04473, sec. 2.2), with a flush between batches.

The model is cut into v·P stages; rank r holds stages r, r+P, ..., r+(v-1)P (loop placement), so
each micro-batch passes every rank v times. Micro-batches go through a rank's stages in rounds
of g: forwards of g micro-batches on the rank's first stage, the same g on its second, ..., then
the next g; backwards mirror this from the last stage. Rank r warms up with (v-1)·g + 2·(P-1-r)
forwards, then alternates one forward and one backward, then cools down.

Preconditions: P >= 1 ranks, v >= 2 stages per rank (v = 1 is ``1f1b``), and M splits into equal
rounds of at least P micro-batches: g = M / max(1, M // P) must be whole (any M that is a
multiple of P, as the paper requires, or any M < P; torch 2.13's ScheduleInterleaved1F1B relaxes
the paper the same way). Guarantees: batch j runs at version j on every stage (plain gradient
accumulation); with F and B balanced over the stages and free transfers, bubble share
(P-1)/(vM+P-1) when M is a multiple of P (1/v of 1F1B's bubble time); rank r holds at most
min((v-1)·g + 2·(P-1-r) + 1, vM) stage-micro-batches for backward, each 1/v of the rank's
layers. Every step is a drain point.
"""

from __future__ import annotations

from collections.abc import Collection

from nobubble.core.ir import Action, B, F, Schedule, ScheduleError
from nobubble.core.placement import Placement
from nobubble.core.schedules._order import flushed_schedule

NAME = "interleaved-1f1b"
SUMMARY = "synchronous: Megatron interleaved 1F1B, v stages per rank in a loop, flush"


def round_size(num_ranks: int, num_microbatches: int) -> int:
    """g, the micro-batches a rank runs on one stage before it moves to its next stage."""
    return num_microbatches // max(1, num_microbatches // num_ranks)


def warmup_forwards(num_ranks: int, num_microbatches: int, virtual: int, rank: int) -> int:
    g = round_size(num_ranks, num_microbatches)
    return min((virtual - 1) * g + 2 * (num_ranks - 1 - rank), virtual * num_microbatches)


def check(num_ranks: int, num_microbatches: int, virtual: int) -> None:
    if not isinstance(virtual, int) or virtual < 2:
        raise ScheduleError(
            f"{NAME} needs v >= 2 stages per rank, got v={virtual!r}; set --virtual-stages 2 or "
            "more (with one stage per rank use 1f1b)"
        )
    rounds = max(1, num_microbatches // num_ranks)
    if num_microbatches % rounds:
        fit = (num_microbatches // num_ranks) * num_ranks
        raise ScheduleError(
            f"{NAME} runs micro-batches in equal rounds of at least P={num_ranks}: "
            f"M={num_microbatches} does not split into {rounds} equal rounds; use a multiple "
            f"of P such as --microbatches {fit}"
        )


def batch_order(
    num_ranks: int, num_microbatches: int, virtual: int, rank: int, first: int
) -> list[Action]:
    """Rank ``rank``'s order for the micro-batches ``first .. first+M-1`` (no STEP)."""
    g, total = round_size(num_ranks, num_microbatches), virtual * num_microbatches

    def action(kind: str, k: int) -> Action:
        """The rank's k-th forward or backward: its loop (local stage) and micro-batch."""
        loop = (k // g) % virtual
        if kind == B:
            loop = virtual - 1 - loop
        microbatch = (k // (g * virtual)) * g + k % g
        return Action(loop * num_ranks + rank, kind, first + microbatch)

    warmup = warmup_forwards(num_ranks, num_microbatches, virtual, rank)
    order = [action(F, k) for k in range(warmup)]
    for k in range(total):  # steady 1F1B, then cool-down once forwards run out
        if warmup + k < total:
            order.append(action(F, warmup + k))
        order.append(action(B, k))
    return order


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
