"""PipeDream-2BW (Narayanan et al., ICML 2021, arXiv 2006.09503), as studied in arXiv 2606.30634.

1F1B without flush, double-buffered weights: every micro-batch of batch j runs forward and
backward at version max(j-1, 0), and step j+1 applies that gradient to version j. This is
delayed-gradient training x[j+1] = x[j] - u(g(x[j-1])), with the same numbers for every P.

Preconditions: P >= 1, M >= P-1 (otherwise batch j's forwards on stage 0 start before step j-1
exists). Guarantees: delay exactly 1 from batch 1 on (0 for batch 0) on every stage; at most two
weight versions alive per stage; at most P-s micro-batches in flight on stage s.
"""

from __future__ import annotations

from collections.abc import Collection

from nobubble.core.ir import Schedule, ScheduleError
from nobubble.core.schedules._order import continuous_1f1b

NAME = "2bw"
SUMMARY = "async: 1F1B no flush, batch j at version j-1 (one-step delay), 2 weight copies; M >= P-1"


def check(num_stages: int, num_microbatches: int, virtual: int) -> None:
    """2BW's one-step delay holds only while a step's M micro-batches cover the P-1 forwards
    in flight ahead of the last stage."""
    if num_microbatches < num_stages - 1:
        raise ScheduleError(
            f"2bw needs micro-batches per step M >= P-1, got M={num_microbatches} with "
            f"P={num_stages}; use --microbatches {num_stages - 1} or more, or fewer stages"
        )


def generate(
    num_stages: int,
    num_microbatches: int,
    num_steps: int,
    drain_every: int | None = None,
    sync_warmup: int = 0,
    drain_at: Collection[int] = (),
) -> Schedule:
    check(num_stages, num_microbatches, 1)
    ranks = continuous_1f1b(
        num_stages, num_microbatches, num_steps, drain_every, sync_warmup, drain_at
    )
    return Schedule(
        NAME,
        num_stages,
        num_microbatches,
        num_steps,
        "previous_batch",
        "stashed",
        ranks,
        drain_every=drain_every,
        sync_warmup=sync_warmup,
        meta={"drain_at": tuple(sorted(drain_at))} if drain_at else {},
    )
