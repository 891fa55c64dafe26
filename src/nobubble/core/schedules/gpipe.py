"""GPipe (Huang et al., arXiv 1811.06965): all forwards of a batch, then all backwards, then flush.

Preconditions: P >= 1, M >= 1. Guarantees: every forward and backward of batch j runs at version
j (no update is crossed), so the run equals plain gradient accumulation over M micro-batches for
every P; stage s holds M micro-batches for backward; bubble share (P-1)/(M+P-1) per batch with
equal forward and backward costs. Every step is a drain point.
"""

from __future__ import annotations

from collections.abc import Collection

from nobubble.core.ir import Schedule
from nobubble.core.schedules._order import all_f_then_all_b, insert_steps

NAME = "gpipe"
SUMMARY = "synchronous: all F then all B per batch, flush; M micro-batches held per stage"


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
            order += all_f_then_all_b(stage, step * num_microbatches, num_microbatches)
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
