"""A schedule given as an order instead of a name: a synchronous ``Schedule`` whose batches repeat
(read from torch's CSV format, from nobubble's JSON, or built in code), trained for any number of
steps by repeating its first batch.

Only synchronous orders qualify: both weight rules "current" and every micro-batch of batch j run
between its stage's steps j and j+1 (one flushed batch per step). An asynchronous order's
numerics depend on more than its rows (which weight version each action reads), which is what
its registered generator and correction rules fix: train it by its name.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter

from nobubble.core.ir import STEP, Action, Schedule, ScheduleError
from nobubble.core.validate import validate


def one_batch(schedule: Schedule) -> tuple[tuple[Action, ...], ...]:
    """Each rank's batch 0 without its STEPs, after checking that each stage runs batch j
    between its steps j and j+1 and every batch repeats batch 0 shifted (``schedule`` valid)."""
    M = schedule.num_microbatches
    rows = []
    for rank, order in enumerate(schedule.ranks):
        batches: list[list[Action]] = [[] for _ in range(schedule.num_steps)]
        steps_done: Counter[int] = Counter()  # per stage
        for pos, action in enumerate(order):
            if action.kind == STEP:
                steps_done[action.stage] = action.number
                continue
            batch = action.number // M
            if batch != steps_done[action.stage]:
                raise ScheduleError(
                    f"rank {rank}, position {pos} ({action}) runs micro-batch {action.number} "
                    f"of batch {batch} after {steps_done[action.stage]} step(s) of its stage: "
                    "not one flushed batch per step"
                )
            batches[batch].append(action)
        first = batches[0]
        for j, actions in enumerate(batches[1:], start=1):
            if actions != [Action(a.stage, a.kind, a.number + j * M) for a in first]:
                raise ScheduleError(f"rank {rank} runs batch {j} in another order than batch 0")
        rows.append(tuple(first))
    return tuple(rows)


def repeat(program: Schedule, num_steps: int, name: str | None = None) -> Schedule:
    """``program``'s first batch run ``num_steps`` times, each rank's batch followed by one
    STEP per stage it holds."""
    M, where = program.num_microbatches, program.placement
    ranks = []
    for r, row in enumerate(one_batch(program)):
        order: list[Action] = []
        for j in range(num_steps):
            order += [Action(a.stage, a.kind, a.number + j * M) for a in row]
            order += [Action(s, STEP, j + 1) for s in where.stages_of(r)]
        ranks.append(tuple(order))
    return Schedule(
        name or program.name,
        program.num_stages,
        M,
        num_steps,
        "current",
        "current",
        tuple(ranks),
        1,
        placement=where,
    )


def as_program(schedule: Schedule, source: str) -> Schedule:
    """``schedule`` validated and cut to its first batch (one step); ScheduleError naming
    ``source`` (where the order came from) when it is asynchronous or its batches differ."""
    if not isinstance(schedule, Schedule):
        raise TypeError(
            f"{source} must be a schedule name or a nobubble Schedule, got "
            f"{type(schedule).__name__}"
        )
    rules = (schedule.forward_rule, schedule.backward_rule)
    if rules != ("current", "current") or schedule.sync_warmup:
        raise ScheduleError(
            f"{source} is asynchronous (forward={rules[0]}, backward={rules[1]}): an order "
            "given as a file or a Schedule trains only synchronous orders (one flushed batch "
            "per step); train an asynchronous schedule by its name, e.g. schedule='2bw'"
        )
    validate(schedule)
    try:
        return repeat(schedule, 1)
    except ScheduleError as err:
        raise ScheduleError(
            f"{source} cannot be trained as an order: {err}; only synchronous orders whose "
            "batches repeat (one flushed batch per step) can: train an asynchronous schedule "
            "by its name"
        ) from None


def order_digest(program: Schedule) -> str:
    """A short hash of what fixes the numbers of ``program`` (its rows, M and placement; not
    its name): a checkpoint and every rank compare it."""
    where = program.placement
    text = json.dumps(
        [program.num_microbatches, where.kind, where.num_ranks, where.stages_per_rank]
        + [[str(a) for a in order] for order in program.ranks]
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def peak_inflight(program: Schedule, stage: int) -> int:
    """Most micro-batches ``stage`` holds for backward (forwards whose B or W has not run)."""
    done = program.gradient_kind
    inflight = peak = 0
    for a in program.ranks[program.placement.rank_of(stage)]:
        if a.stage == stage:
            inflight += {"F": 1, done: -1}.get(a.kind, 0)
            peak = max(peak, inflight)
    return peak


__all__ = ["as_program", "one_batch", "order_digest", "peak_inflight", "repeat"]
