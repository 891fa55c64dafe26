"""Validate a schedule before anything executes it (design.md section 2).

Checks, per rank: actions belong to the rank's stage and are executable kinds; every micro-batch
has exactly one forward and one backward, forward first; step j+1 comes after every backward of
batch j and before any backward of batch j+1; the weight version a forward needs exists; and,
across ranks, that the orders cannot deadlock. A failure names rank, position and reason and
shows the schedule grid with the failing cell marked.
"""

from __future__ import annotations

from nobubble.core.deps import local_prerequisites
from nobubble.core.ir import COMPUTE_KINDS, STEP, Action, B, F, Schedule, ScheduleError, format_grid
from nobubble.core.ledger import forward_version
from nobubble.core.placement import rank_of
from nobubble.core.sim.cost import CostModel
from nobubble.core.sim.engine import Deadlock, blocked_on, run_timeline
from nobubble.core.util import paused_gc


class ScheduleValidationError(ScheduleError):
    def __init__(self, schedule: Schedule, rank: int, position: int, reason: str) -> None:
        order = schedule.ranks[rank]
        where = str(order[position]) if position < len(order) else "end of order"
        grid = format_grid(schedule.ranks, mark=(rank, position))
        super().__init__(
            f"invalid schedule {schedule.name!r}: rank {rank}, position {position} ({where}): "
            f"{reason}\n{grid}"
        )
        self.rank, self.position, self.reason = rank, position, reason


def _check_rank(schedule: Schedule, rank: int) -> None:
    total, per_step = schedule.total_microbatches, schedule.num_microbatches
    seen_f, seen_b = bytearray(total), bytearray(total)
    backwards_in_batch = [0] * schedule.num_steps
    current = 0

    def fail(pos: int, reason: str) -> None:
        raise ScheduleValidationError(schedule, rank, pos, reason)

    for pos, (stage, kind, m) in enumerate(schedule.ranks[rank]):
        if kind not in COMPUTE_KINDS:
            fail(
                pos,
                f"{kind} is not executable in this version; use F, B and STEP "
                "(transfers are implied by the dependency rule)",
            )
        if rank_of(stage) != rank:
            fail(pos, f"stage {stage} runs on rank {rank_of(stage)}, not rank {rank}")
        if kind == STEP:
            if m != current + 1:
                fail(pos, f"expected STEP{current + 1} (steps are numbered 1, 2, ... in order)")
            if m > schedule.num_steps:
                fail(pos, f"step {m} is past the schedule's {schedule.num_steps} steps")
            if backwards_in_batch[m - 1] != per_step:  # the dependency rule names which
                prerequisites = local_prerequisites(Action(stage, kind, m), per_step)
                missing = next(a.number for a in prerequisites if not seen_b[a.number])
                fail(
                    pos,
                    f"step {m} applies batch {m - 1}, but the backward of micro-batch "
                    f"{missing} has not run yet on this stage",
                )
            current = m
            continue
        if not 0 <= m < total:
            fail(
                pos,
                f"micro-batch {m} is outside 0..{total - 1} "
                f"({schedule.num_steps} steps x {per_step} micro-batches)",
            )
        batch = m // per_step
        if kind == F:
            if seen_f[m]:
                fail(pos, f"second forward of micro-batch {m}")
            seen_f[m] = 1
            needed = forward_version(schedule.forward_rule, batch, current, schedule.sync_warmup)
            if needed > current:
                fail(
                    pos,
                    f"forward of batch {batch} needs weight version {needed}, but the stage "
                    f"has applied only {current} steps (for 2bw: M >= P-1)",
                )
        else:  # B
            if not seen_f[m]:
                fail(pos, f"backward of micro-batch {m} before its forward")
            if seen_b[m]:
                fail(pos, f"second backward of micro-batch {m}")
            if batch != current:
                fail(
                    pos,
                    f"backward of micro-batch {m} (batch {batch}) must run after step "
                    f"{batch} and before step {batch + 1}; the stage has applied {current}",
                )
            seen_b[m] = 1
            backwards_in_batch[batch] += 1
    end = len(schedule.ranks[rank])
    for kind, seen in ((F, seen_f), (B, seen_b)):
        if not all(seen):
            fail(
                end,
                f"missing {Action(rank, kind, seen.index(0))} (every micro-batch needs one "
                "forward and one backward per stage)",
            )
    if current != schedule.num_steps:
        fail(end, f"missing STEP{current + 1}: {schedule.num_steps} steps expected")


def check_orders(schedule: Schedule) -> None:
    """Every per-rank rule; deadlock freedom is checked separately (it needs the engine)."""
    for rank in range(schedule.num_ranks):
        _check_rank(schedule, rank)


def deadlock_error(schedule: Schedule, err: Deadlock) -> ScheduleValidationError:
    stuck = blocked_on(schedule, err.positions)
    waits = "; ".join(f"rank {r} at {a} waits for {d}" for r, _, a, d in stuck)
    rank, pos, _, _ = stuck[0]
    return ScheduleValidationError(schedule, rank, pos, f"deadlock: {waits}")


def check_deadlock(schedule: Schedule) -> None:
    """Deadlock freedom depends on the orders only, so any cost model decides it."""
    try:
        run_timeline(schedule, CostModel(fwd=1.0, bwd=1.0))
    except Deadlock as err:
        raise deadlock_error(schedule, err) from None


def validate(schedule: Schedule) -> None:
    """Raise ``ScheduleValidationError`` unless ``schedule`` can run and means what it says."""
    with paused_gc():
        check_orders(schedule)
        check_deadlock(schedule)
