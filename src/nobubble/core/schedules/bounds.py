"""What a schedule will hold, known from its integers before it is generated.

Closed forms of the generators in this package (each generator's docstring states them): the
number of actions, so ``build_schedule`` can refuse a size it could not build in reasonable time,
and the micro-batches in flight and weight versions alive per stage, so a training config can
estimate its memory without building the schedule. tests/test_memory.py checks them against
the ledger.
"""

from __future__ import annotations

# The generators by their full paths: the package's __init__ imports this module, so reaching them
# through the package (``from nobubble.core.schedules import gpipe``) would be an import circle
# that works only by the order of __init__'s imports (tests/test_layers.py refuses it).
import nobubble.core.schedules.dualpipev as dualpipev
import nobubble.core.schedules.gpipe as gpipe
import nobubble.core.schedules.interleaved_1f1b as interleaved_1f1b
import nobubble.core.schedules.looped_bfs as looped_bfs
import nobubble.core.schedules.one_f_one_b as one_f_one_b
import nobubble.core.schedules.pipedream as pipedream
import nobubble.core.schedules.two_bw as two_bw
import nobubble.core.schedules.zb_h1 as zb_h1
import nobubble.core.schedules.zbv as zbv
from nobubble.core.ir import Action, B, F, ScheduleError, W

# Largest schedule build_schedule generates. Measured on the 2-core development machine, under a
# load of about 5 from other jobs, with paci at P=64, M=256: at 3.48M actions (106 steps)
# `nobubble ledger` printed its 1.7M-row table in 22 s (8.6 s with --summary-only), `simulate`
# took 9.7 s and `show --format json` 7.6 s; at 4.0M actions (122 steps) the ledger table took
# 27-29 s. Time and memory (about 0.6 kB per action for the table) grow linearly, so this limit
# keeps each command under ~25 s while admitting `nobubble bench sim`'s default, 3.28M actions.
MAX_ACTIONS = 3_500_000


def num_actions(
    num_stages: int,
    num_microbatches: int,
    num_steps: int,
    stages_per_rank: int = 1,
    split_backward: bool = False,
) -> int:
    """Every stage runs a forward and a backward (B, or I and W) per micro-batch and one STEP per
    step; ``num_stages`` is P, the ranks, each holding ``stages_per_rank`` stages."""
    per_microbatch = 3 if split_backward else 2
    return num_stages * stages_per_rank * num_steps * (per_microbatch * num_microbatches + 1)


def check_size(
    name: str,
    num_stages: int,
    num_microbatches: int,
    num_steps: int,
    max_actions: int = MAX_ACTIONS,
    stages_per_rank: int = 1,
    split_backward: bool = False,
) -> None:
    """ScheduleError when schedule ``name`` would hold more than ``max_actions`` actions."""
    count = num_actions(num_stages, num_microbatches, num_steps, stages_per_rank, split_backward)
    if count > max_actions:
        v = f" x v={stages_per_rank}" if stages_per_rank > 1 else ""
        backward = "3M" if split_backward else "2M"
        raise ScheduleError(
            f"{name} with P={num_stages} stages{v}, M={num_microbatches} micro-batches per step "
            f"and {num_steps} steps would hold {count:,} actions (P{' x v' if v else ''} x "
            f"steps x ({backward} + 1)), more than the {max_actions:,} that build, validate and "
            "print in under ~25 s: lower --stages, --microbatches (--accum for pipedream and "
            "paci) or --steps"
        )


def peak_inflight(
    name: str, num_stages: int, num_microbatches: int, num_steps: int, stage: int
) -> int:
    """Most micro-batches ``stage`` holds for backward (forwards whose gradient, B or W, has not
    run).

    ``num_microbatches`` is the resolved M (``a`` for pipedream and paci); ``num_stages`` is P, the
    ranks, and ``stage`` counts the v·P stages of interleaved-1f1b (v = 2 here) and the 2P of zbv.
    Drain points and sync warm-up steps only lower the count of the schedules without flush.
    """
    P, M = num_stages, num_microbatches
    if name == gpipe.NAME:
        return M
    if name == one_f_one_b.NAME:
        return min(P - stage, M)
    if name == zb_h1.NAME:  # W held back: P on every stage, stage 0's 1F1B peak
        return min(P, M)
    if name == zbv.NAME:  # 1F1B's count over the 2P stages of the V
        return min(2 * P - stage, M)
    if name == interleaved_1f1b.NAME:  # no closed form per stage: walk one batch of its rank
        return _walk_peak(interleaved_1f1b.batch_order(P, M, 2, stage % P, 0), B, stage)
    if name == dualpipev.NAME:  # walk one batch of the stage's rank (its V: r and 2P-1-r)
        return _walk_peak(dualpipev.batch_order(P, M, min(stage, 2 * P - 1 - stage), 0), W, stage)
    if name == looped_bfs.NAME:  # every forward of the batch before any backward, as GPipe
        return M
    return min(P - stage, num_steps * M)  # 1F1B across batches


def rank_peak_inflight(
    name: str,
    num_stages: int,
    num_microbatches: int,
    num_steps: int,
    rank: int,
    virtual_stages: int = 2,
) -> int:
    """Most (stage, micro-batch) pairs ``rank`` holds for backward over all its stages; a stage of
    a rank holding v stages is 1/v of the rank's layers. ``virtual_stages`` is interleaved-1f1b's
    v; the rank's stage count for every other schedule is fixed by its placement."""
    P, M = num_stages, num_microbatches
    if name == interleaved_1f1b.NAME:  # warm-up forwards, then one more before the first B
        return min(
            interleaved_1f1b.warmup_forwards(P, M, virtual_stages, rank) + 1, virtual_stages * M
        )
    if name == zbv.NAME:  # 2P halves once M >= 2P-1: P whole micro-batches, 1F1B's stage 0
        return min(2 * P, 2 * M, M + rank + 1)
    if name == dualpipev.NAME:  # DualPipe's PP+1 stage-micro-batches, PP = 2P stages
        return 2 * P + 1
    if name == looped_bfs.NAME:  # the whole batch on each of its v stages
        return virtual_stages * M
    return peak_inflight(name, P, M, num_steps, rank)


def _walk_peak(order: list[Action], done: str, stage: int) -> int:
    inflight = peak = 0
    for a in order:
        if a.stage == stage:
            inflight += {F: 1, done: -1}.get(a.kind, 0)
            peak = max(peak, inflight)
    return peak


def peak_versions(name: str, num_stages: int, num_microbatches: int, stage: int) -> int:
    """An upper bound on the weight versions alive at once on ``stage`` (1: no stash)."""
    if name == pipedream.NAME:
        return -(-(num_stages - stage) // num_microbatches) + 1  # ceil((P-s)/a) + 1
    if name == two_bw.NAME:
        return 2
    return 1
