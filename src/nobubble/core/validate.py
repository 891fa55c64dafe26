"""Validate a schedule before anything executes it (the rules: docs/semantics.md, "Validator").

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

# Positions of the grid an error shows around the failing cell: every rank's row stays one line
# of a terminal (about 9 characters a column).
ERROR_COLUMNS = 16


class ScheduleValidationError(ScheduleError):
    """A broken rule at ``position`` of ``rank``'s order (``len(order)``: something is missing at
    its end); the message names both and the rule, then shows every rank's order around that
    position with the failing cell in brackets."""

    def __init__(self, schedule: Schedule, rank: int, position: int, reason: str) -> None:
        order = schedule.ranks[rank]
        where = str(order[position]) if position < len(order) else "end of order"
        grid = format_grid(schedule.ranks, mark=(rank, position), max_columns=ERROR_COLUMNS)
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
    """Walk one rank's order, each action checked against what its stage has run so far; the
    first broken rule raises, then every stage must have run everything."""
    total, placement = schedule.total_microbatches, schedule.placement
    states = {s: _StageState(total, schedule.num_steps) for s in placement.stages_of(rank)}
    st: _StageState | None = None
    last = -1
    for pos, action in enumerate(schedule.ranks[rank]):
        stage, kind, m = action
        if kind not in COMPUTE_KINDS:
            reason: str | None = (
                f"{kind} is not executable in this version; use F, B (or I and W) and STEP "
                "(transfers are implied by the dependency rule)"
            )
        else:
            if stage != last:  # look the stage's state up only when the stage changes
                st, last = states.get(stage), stage
            if st is None:
                reason = _foreign_stage(schedule, rank, stage)
            elif kind == STEP:
                reason = _apply_step(schedule, st, action)
            elif not 0 <= m < total:
                reason = (
                    f"micro-batch {m} is outside 0..{total - 1} "
                    f"({schedule.num_steps} steps x {schedule.num_microbatches} micro-batches)"
                )
            elif kind == F:
                reason = _run_forward(schedule, st, m)
            else:
                reason = _run_backward(schedule, st, action)
        if reason is not None:
            raise ScheduleValidationError(schedule, rank, pos, reason)
    _check_complete(schedule, rank, states)


def _foreign_stage(schedule: Schedule, rank: int, stage: int) -> str:
    where = (
        f"rank {schedule.placement.rank_of(stage)}"
        if 0 <= stage < schedule.num_stages
        else f"no rank: the schedule has stages 0..{schedule.num_stages - 1}"
    )
    return f"stage {stage} runs on {where}, not rank {rank}"


def _apply_step(schedule: Schedule, st: _StageState, action: Action) -> str | None:
    """STEP m: the next step in order, within the schedule, after all of batch m-1's gradients."""
    m, per_step, split = action.number, schedule.num_microbatches, schedule.split_backward
    if m != st.current + 1:
        return f"expected STEP{st.current + 1} (steps are numbered 1, 2, ... in order)"
    if m > schedule.num_steps:
        return f"step {m} is past the schedule's {schedule.num_steps} steps"
    if st.grads_in_batch[m - 1] != per_step:  # the dependency rule names which
        done = st.seen_w if split else st.seen_b
        prerequisites = local_prerequisites(action, per_step, split)
        missing = next(a for a in prerequisites if not done[a.number])
        return (
            f"step {m} applies batch {m - 1}, but {missing} (the gradient of "
            f"micro-batch {missing.number}) has not run yet on this stage"
        )
    st.current = m
    return None


def _run_forward(schedule: Schedule, st: _StageState, m: int) -> str | None:
    """The first forward of micro-batch m, with the weight version its batch needs applied."""
    if st.seen_f[m]:
        return f"second forward of micro-batch {m}"
    st.seen_f[m] = 1
    batch = m // schedule.num_microbatches
    needed = forward_version(schedule.forward_rule, batch, st.current, schedule.sync_warmup)
    if needed > st.current:
        return (
            f"forward of batch {batch} needs weight version {needed}, but the stage "
            f"has applied only {st.current} steps (for 2bw: M >= P-1)"
        )
    return None


def _run_backward(schedule: Schedule, st: _StageState, action: Action) -> str | None:
    """B, I or W of micro-batch m: the schedule's kind of backward, once each, after the forward
    (W after I), between the step before its batch and the step after."""
    kind, m, split = action.kind, action.number, schedule.split_backward
    if (kind == B) == split:
        return (
            f"{kind} in a schedule that "
            + ("splits backwards into I and W" if split else "fuses backwards into B")
            + " (rank 0's order decides): split every backward or none"
        )
    if kind == W:
        if not st.seen_b[m]:
            return f"weight gradient W of micro-batch {m} before its input gradient I"
        if st.seen_w[m]:
            return f"second weight gradient W of micro-batch {m}"
        st.seen_w[m] = 1
    else:  # B or I
        if not st.seen_f[m]:
            return f"backward of micro-batch {m} before its forward"
        if st.seen_b[m]:
            return f"second backward of micro-batch {m}"
        st.seen_b[m] = 1
    batch = m // schedule.num_microbatches
    if batch != st.current:
        return (
            f"{kind} of micro-batch {m} (batch {batch}) must run after step "
            f"{batch} and before step {batch + 1}; the stage has applied {st.current}"
        )
    if kind != I:
        st.grads_in_batch[batch] += 1
    return None


def _check_complete(schedule: Schedule, rank: int, states: dict[int, _StageState]) -> None:
    """At the end of the rank's order every stage has run every action and every step."""
    split, end = schedule.split_backward, len(schedule.ranks[rank])
    for stage, st in states.items():
        kinds = (
            ((F, st.seen_f), (I, st.seen_b), (W, st.seen_w))
            if split
            else ((F, st.seen_f), (B, st.seen_b))
        )
        for kind, seen in kinds:
            if not all(seen):
                raise ScheduleValidationError(
                    schedule,
                    rank,
                    end,
                    f"missing {Action(stage, kind, seen.index(0))} (every micro-batch needs one "
                    + ("forward, one I and one W" if split else "forward and one backward")
                    + " per stage)",
                )
        if st.current != schedule.num_steps:
            raise ScheduleValidationError(
                schedule,
                rank,
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
