"""1F1B with a flush between batches (PipeDream-Flush, Narayanan et al., arXiv 2006.09503).

Preconditions: P >= 1, M >= 1. Guarantees: each batch is a complete 1F1B (warm-up, steady,
cool-down) and no forward of batch j+1 starts before step j+1, so every forward and backward of
batch j runs at version j: numerically plain gradient accumulation for every P. Stage s holds at
most min(P-s, M) micro-batches for backward. Bubble share (P-1)/(M+P-1) per batch with equal
forward and backward costs. Every step is a drain point.
"""

from __future__ import annotations

from collections.abc import Collection

from nobubble.core.ir import Schedule
from nobubble.core.schedules._order import insert_steps, one_f_one_b

NAME = "1f1b"
SUMMARY = "synchronous: 1F1B per batch with a flush; min(P-s, M) micro-batches held per stage"


def generate(
    num_stages: int,
    num_microbatches: int,
    num_steps: int,
    drain_every: int | None = None,
    drain_at: Collection[int] = (),
) -> Schedule:
    """Drains after every step anyway: ``drain_every`` and ``drain_at`` change nothing."""
    ranks = []
    for stage in range(num_stages):
        order = []
        for step in range(num_steps):
            order += one_f_one_b(stage, num_stages, step * num_microbatches, num_microbatches)
        ranks.append(tuple(insert_steps(order, stage, num_microbatches)))
    return Schedule(
        NAME,
        num_stages,
        num_microbatches,
        num_steps,
        "current",
        "current",
        tuple(ranks),
        drain_every=1,
    )
