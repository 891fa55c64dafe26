"""Validate a schedule before anything executes it (design.md section 2).

Checks, per rank: actions belong to the rank's stages (as the placement says) and are executable
kinds; every micro-batch has exactly one forward and one backward per stage (B, or I then W, never
mixed in one schedule), forward first; step j+1 comes after every gradient of batch j and before
any backward of batch j+1; the weight version a forward needs exists; and, across ranks, that the
orders cannot deadlock. A failure names rank, position and reason and
shows the schedule grid with the failing cell marked.
"""

from __future__ import annotations

from nobubble.core.deps import local_prerequisites
from nobubble.core.ir import (
    COMPUTE_KINDS,
    STEP,
    Action,
    B,
    F,
    I,
    Schedule,
    ScheduleError,
    W,
    format_grid,
)
from nobubble.core.ledger import forward_version
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


class _StageState:
    """What one stage has run so far, while its rank's order is walked."""

    __slots__ = ("current", "grads_in_batch", "seen_b", "seen_f", "seen_w")

    def __init__(self, total: int, num_steps: int) -> None:
        self.seen_f, self.seen_b, self.seen_w = bytearray(total), bytearray(total), bytearray(total)
        self.grads_in_batch = [0] * num_steps  # completed gradients (B, or W) per batch
        self.current = 0  # steps applied


def _check_rank(schedule: Schedule, rank: int) -> None:
    total, per_step = schedule.total_microbatches, schedule.num_microbatches
    placement, split = schedule.placement, schedule.split_backward
    states = {s: _StageState(total, schedule.num_steps) for s in placement.stages_of(rank)}
    st: _StageState | None = None
    last = -1

    def fail(pos: int, reason: str) -> None:
        raise ScheduleValidationError(schedule, rank, pos, reason)

    for pos, (stage, kind, m) in enumerate(schedule.ranks[rank]):
        if kind not in COMPUTE_KINDS:
            fail(
                pos,
                f"{kind} is not executable in this version; use F, B (or I and W) and STEP "
                "(transfers are implied by the dependency rule)",
            )
        if stage != last:  # look the stage's state up only when the stage changes
            st, last = states.get(stage), stage
        if st is None:
            where = (
                f"rank {placement.rank_of(stage)}"
                if 0 <= stage < schedule.num_stages
                else f"no rank: the schedule has stages 0..{schedule.num_stages - 1}"
            )
            fail(pos, f"stage {stage} runs on {where}, not rank {rank}")
            return
        if kind == STEP:
            if m != st.current + 1:
                fail(pos, f"expected STEP{st.current + 1} (steps are numbered 1, 2, ... in order)")
            if m > schedule.num_steps:
                fail(pos, f"step {m} is past the schedule's {schedule.num_steps} steps")
            if st.grads_in_batch[m - 1] != per_step:  # the dependency rule names which
                prerequisites = local_prerequisites(Action(stage, kind, m), per_step, split)
                done = st.seen_w if split else st.seen_b
                missing = next(a for a in prerequisites if not done[a.number])
                fail(
                    pos,
                    f"step {m} applies batch {m - 1}, but {missing} (the gradient of "
                    f"micro-batch {missing.number}) has not run yet on this stage",
                )
            st.current = m
            continue
        if not 0 <= m < total:
            fail(
                pos,
                f"micro-batch {m} is outside 0..{total - 1} "
                f"({schedule.num_steps} steps x {per_step} micro-batches)",
            )
        batch = m // per_step
        if kind == F:
            if st.seen_f[m]:
                fail(pos, f"second forward of micro-batch {m}")
            st.seen_f[m] = 1
            needed = forward_version(schedule.forward_rule, batch, st.current, schedule.sync_warmup)
            if needed > st.current:
                fail(
                    pos,
                    f"forward of batch {batch} needs weight version {needed}, but the stage "
                    f"has applied only {st.current} steps (for 2bw: M >= P-1)",
                )
            continue
        if (kind == B) == split:
            fail(
                pos,
                f"{kind} in a schedule that "
                + ("splits backwards into I and W" if split else "fuses backwards into B")
                + " (rank 0's order decides): split every backward or none",
            )
        if kind == W:
            if not st.seen_b[m]:
                fail(pos, f"weight gradient W of micro-batch {m} before its input gradient I")
            if st.seen_w[m]:
                fail(pos, f"second weight gradient W of micro-batch {m}")
            st.seen_w[m] = 1
        else:  # B or I
            if not st.seen_f[m]:
                fail(pos, f"backward of micro-batch {m} before its forward")
            if st.seen_b[m]:
                fail(pos, f"second backward of micro-batch {m}")
            st.seen_b[m] = 1
        if batch != st.current:
            fail(
                pos,
                f"{kind} of micro-batch {m} (batch {batch}) must run after step "
                f"{batch} and before step {batch + 1}; the stage has applied {st.current}",
            )
        if kind != I:
            st.grads_in_batch[batch] += 1
    end = len(schedule.ranks[rank])
    for stage, st in states.items():
        kinds = (
            ((F, st.seen_f), (I, st.seen_b), (W, st.seen_w))
            if split
            else ((F, st.seen_f), (B, st.seen_b))
        )
        for kind, seen in kinds:
            if not all(seen):
                fail(
                    end,
                    f"missing {Action(stage, kind, seen.index(0))} (every micro-batch needs one "
                    + ("forward, one I and one W" if split else "forward and one backward")
                    + " per stage)",
                )
        if st.current != schedule.num_steps:
            fail(
                end,
                f"missing STEP{st.current + 1} of stage {stage}: "
                f"{schedule.num_steps} steps expected",
            )


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
