"""PipeDream (Narayanan et al., SOSP 2019, arXiv 1806.03377): 1F1B without flush, weight stashing.

Stage s steps after every ``a``-th local backward (``num_microbatches`` is ``a``; a=1 is the
original per-micro-batch PipeDream). A forward reads the weights current at that moment and the
backward reads the same, stashed, version.

Preconditions: P >= 1, a >= 1. Guarantees: the gradient applied by a step on stage s was computed
at most ceil((P-1-s)/a) versions earlier (zero on the last stage); at most P-s micro-batches in
flight on stage s, and at most ceil((P-s)/a)+1 weight versions alive. Optional drain points every
``drain_every`` steps (for checkpoints); otherwise the pipeline never drains.
"""

from __future__ import annotations

from collections.abc import Collection

from nobubble.core.ir import Schedule
from nobubble.core.schedules._order import continuous_1f1b

NAME = "pipedream"
SUMMARY = "async: 1F1B no flush, stash the forward's weights, step every a backwards (a=1 default)"


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
        "stashed",
        ranks,
        drain_every=drain_every,
        sync_warmup=sync_warmup,
        meta={"drain_at": tuple(sorted(drain_at))} if drain_at else {},
    )
