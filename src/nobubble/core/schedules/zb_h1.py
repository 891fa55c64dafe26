"""ZB-H1 (Qi et al., ICLR 2024, "Zero Bubble Pipeline Parallelism", arXiv 2401.10241, sec. 3.1),
with a flush between batches.

The backward is split into I (input gradient, which the previous stage waits for) and W (weight
gradient, which only the step waits for). The order is 1F1B's with B replaced by I, and stage s
holds back its first s weight gradients: from its (s+1)-th I on, each I is followed by the
oldest pending W, and the W still pending at the end close the batch. The held-back W fill the
cool-down bubbles that 1F1B leaves on the later stages.

Preconditions: P >= 1, M >= 1. Guarantees: batch j runs at version j on every stage (plain
gradient accumulation); with F = I = W and free transfers the idle time is (P-1)·F per stage
against 1F1B's (P-1)·(F+B), a third of it; stage s holds at most min(P, M) micro-batches between
F and W, and min(P-s, M) between F and I as 1F1B does, so the most loaded stage (stage 0) holds
what it holds under 1F1B: the paper's "same peak memory". Every step is a drain point.
"""

from __future__ import annotations

from collections.abc import Collection

from nobubble.core.ir import Action, F, I, Schedule, W
from nobubble.core.placement import one_per_rank
from nobubble.core.schedules._order import flushed

NAME = "zb-h1"
SUMMARY = "synchronous: zero-bubble H1, 1F1B with B split into I and W, W held back, flush"


def _batch(num_stages: int, num_microbatches: int, stage: int, first: int) -> list[Action]:
    warmup = min(num_stages - 1 - stage, num_microbatches)
    order = [Action(stage, F, first + k) for k in range(warmup)]
    weights = 0
    for k in range(num_microbatches):  # steady state, then cool-down once forwards run out
        if warmup + k < num_microbatches:
            order.append(Action(stage, F, first + warmup + k))
        order.append(Action(stage, I, first + k))
        if k >= stage:  # stage s holds back its first s weight gradients
            order.append(Action(stage, W, first + weights))
            weights += 1
    order += [Action(stage, W, first + k) for k in range(weights, num_microbatches)]
    return order


def generate(
    num_stages: int,
    num_microbatches: int,
    num_steps: int,
    drain_every: int | None = None,
    drain_at: Collection[int] = (),
) -> Schedule:
    """Drains after every step anyway: ``drain_every`` and ``drain_at`` change nothing."""
    P, M = num_stages, num_microbatches
    ranks = flushed(lambda s, first: _batch(P, M, s, first), one_per_rank(P), M, num_steps)
    return Schedule(NAME, P, M, num_steps, "current", "current", ranks, drain_every=1)
