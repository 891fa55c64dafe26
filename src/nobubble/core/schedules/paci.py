"""PACI (arXiv 2606.07881): 1F1B without flush, no stash, local gradient accumulation.

Stage s steps after every ``a``-th local backward (``num_microbatches`` is ``a``). A forward reads
the weights current at that moment; the backward runs through the graph saved at forward time
with the weights current at backward time (one weight copy, updated in place).

Preconditions: P >= 1, a >= 1. Guarantees: a micro-batch crosses at most ceil((P-1-s)/a) updates
on stage s (none on the last stage); when a >= P-1-s the share of micro-batches that cross one is
(P-1-s)/a; the backward always reads the synchronous version floor(m/a); at most P-s micro-batches
in flight and one weight version. Optional drain points every ``drain_every`` steps.
"""

from __future__ import annotations

from collections.abc import Collection

from nobubble.core.ir import Schedule
from nobubble.core.schedules._order import continuous_1f1b

NAME = "paci"
SUMMARY = "async: 1F1B no flush, no stash, step every a backwards; bounded crossed updates"


def generate(
    num_stages: int,
    num_microbatches: int,
    num_steps: int,
    drain_every: int | None = None,
    sync_warmup: int = 0,
    drain_at: Collection[int] = (),
) -> Schedule:
    ranks = continuous_1f1b(
        num_stages, num_microbatches, num_steps, drain_every, sync_warmup, drain_at
    )
    return Schedule(
        NAME,
        num_stages,
        num_microbatches,
        num_steps,
        "current",
        "current",
        ranks,
        drain_every=drain_every,
        sync_warmup=sync_warmup,
        meta={"drain_at": tuple(sorted(drain_at))} if drain_at else {},
    )
