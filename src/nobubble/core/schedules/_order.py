"""Shared building blocks for generators: the 1F1B order of one stage and step insertion."""

from __future__ import annotations

from collections.abc import Callable, Collection

from nobubble.core.ir import STEP, Action, B, F, Schedule
from nobubble.core.placement import Placement


def one_f_one_b(stage: int, num_stages: int, first: int, count: int) -> list[Action]:
    """1F1B over micro-batches ``first .. first+count-1`` on ``stage``: warm-up, steady, cool-down.

    Warm-up runs ``P - s - 1`` forwards; then each forward is followed by the oldest pending
    backward, so at most ``min(P - s, count)`` micro-batches are in flight on stage s.
    """
    warmup = min(num_stages - stage - 1, count)
    order = [Action(stage, F, first + i) for i in range(warmup)]  # warm-up
    for i in range(count):  # steady state, then cool-down once forwards run out
        if warmup + i < count:
            order.append(Action(stage, F, first + warmup + i))
        order.append(Action(stage, B, first + i))
    return order


def all_f_then_all_b(stage: int, first: int, count: int) -> list[Action]:
    """GPipe order: every forward of the batch, then every backward (FIFO)."""
    forwards = [Action(stage, F, first + i) for i in range(count)]
    return forwards + [Action(stage, B, first + i) for i in range(count)]


def insert_steps(order: list[Action], stage: int, num_microbatches: int) -> list[Action]:
    """Put STEP j+1 right after the backward of batch j's last micro-batch (backwards are FIFO)."""
    out: list[Action] = []
    append = out.append
    for action in order:
        append(action)
        if action.kind == B and (action.number + 1) % num_microbatches == 0:
            append(Action(stage, STEP, (action.number + 1) // num_microbatches))
    return out


def flushed(
    batch_order: Callable[[int, int], list[Action]],
    placement: Placement,
    num_microbatches: int,
    num_steps: int,
) -> tuple[tuple[Action, ...], ...]:
    """Synchronous schedules: per rank, ``batch_order(rank, first)`` for each batch in turn (a
    flush between batches), then the STEP of each of the rank's stages.

    Stepping at the end of the rank's batch rather than after each stage's own last gradient
    changes no number (the stage's next forward is in the next batch either way) and gives a rank
    that holds several stages one point where all its gradients are done: where a global gradient
    norm is gathered and the ranks meet at a drain point. It can cost time only when a step is
    expensive and could have hidden in an idle gap of the cool-down.
    """
    ranks = []
    for rank in range(placement.num_ranks):
        order: list[Action] = []
        for step in range(1, num_steps + 1):
            order += batch_order(rank, (step - 1) * num_microbatches)
            order += [Action(stage, STEP, step) for stage in placement.stages_of(rank)]
        ranks.append(tuple(order))
    return tuple(ranks)


def flushed_schedule(
    name: str,
    placement: Placement,
    num_microbatches: int,
    num_steps: int,
    batch_order: Callable[[int, int], list[Action]],
) -> Schedule:
    """A synchronous schedule of several stages per rank from its per-batch order (``flushed``):
    both weight rules "current", a drain after every step."""
    ranks = flushed(batch_order, placement, num_microbatches, num_steps)
    return Schedule(
        name,
        placement.num_stages,
        num_microbatches,
        num_steps,
        "current",
        "current",
        ranks,
        drain_every=1,
        placement=placement,
    )


def segments(
    num_steps: int,
    drain_every: int | None,
    sync_warmup: int = 0,
    drain_at: Collection[int] = (),
) -> list[tuple[int, int]]:
    """Split the run into (first_step, num_steps) segments that drain at their end.

    The first ``sync_warmup`` steps are one-step segments (flushed, i.e. synchronous); the rest
    drains every ``drain_every`` steps, counted from step 0 so drain points stay where they are,
    and after every step of ``drain_at`` (where the Python API's ``drain()`` was called).
    """
    warm = min(sync_warmup, num_steps)
    out = [(k, 1) for k in range(warm)]
    every = drain_every or num_steps
    extra = sorted(d for d in set(drain_at) if warm < d < num_steps)
    k = warm
    while k < num_steps:
        end = min(num_steps, (k // every + 1) * every, *(d for d in extra if d > k))
        out.append((k, end - k))
        k = end
    return out


def continuous_1f1b(
    num_stages: int,
    num_microbatches: int,
    num_steps: int,
    drain_every: int | None,
    sync_warmup: int = 0,
    drain_at: Collection[int] = (),
) -> tuple[tuple[Action, ...], ...]:
    """1F1B without flushes, draining only every ``drain_every`` steps (checkpoint points)
    and after the steps of ``drain_at``."""
    ranks = []
    for stage in range(num_stages):
        order: list[Action] = []
        for first_step, steps in segments(num_steps, drain_every, sync_warmup, drain_at):
            order += one_f_one_b(
                stage, num_stages, first_step * num_microbatches, steps * num_microbatches
            )
        ranks.append(tuple(insert_steps(order, stage, num_microbatches)))
    return tuple(ranks)
