"""What a schedule will hold, known from its integers before it is generated.

Closed forms of the generators in this package (each generator's docstring states them): the
number of actions, so ``build_schedule`` can refuse a size it could not build in reasonable time,
and the micro-batches in flight and weight versions alive per stage, so a training config can
estimate its memory without building the schedule. tests/test_memory.py checks them against
the ledger.
"""

from __future__ import annotations

from nobubble.core.ir import ScheduleError
from nobubble.core.schedules import gpipe, one_f_one_b, pipedream, two_bw

# Largest schedule build_schedule generates. Measured on the 2-core development machine, under a
# load of about 5 from other jobs, with paci at P=64, M=256: at 3.48M actions (106 steps)
# `nobubble ledger` printed its 1.7M-row table in 22 s (8.6 s with --summary-only), `simulate`
# took 9.7 s and `show --format json` 7.6 s; at 4.0M actions (122 steps) the ledger table took
# 27-29 s. Time and memory (about 0.6 kB per action for the table) grow linearly, so this limit
# keeps each command under ~25 s while admitting `nobubble bench sim`'s default, 3.28M actions.
MAX_ACTIONS = 3_500_000


def num_actions(num_stages: int, num_microbatches: int, num_steps: int) -> int:
    """Every stage runs a forward and a backward per micro-batch and one STEP per step."""
    return num_stages * num_steps * (2 * num_microbatches + 1)


def check_size(
    name: str,
    num_stages: int,
    num_microbatches: int,
    num_steps: int,
    max_actions: int = MAX_ACTIONS,
) -> None:
    """ScheduleError when schedule ``name`` would hold more than ``max_actions`` actions."""
    count = num_actions(num_stages, num_microbatches, num_steps)
    if count > max_actions:
        raise ScheduleError(
            f"{name} with P={num_stages} stages, M={num_microbatches} micro-batches per step "
            f"and {num_steps} steps would hold {count:,} actions (P x steps x (2M + 1)), more "
            f"than the {max_actions:,} that build, validate and print in under ~25 s: lower "
            "--stages, --microbatches (--accum for pipedream and paci) or --steps"
        )


def peak_inflight(
    name: str, num_stages: int, num_microbatches: int, num_steps: int, stage: int
) -> int:
    """Most micro-batches ``stage`` holds for backward (forwards whose backward has not run).

    ``num_microbatches`` is the resolved M (``a`` for pipedream and paci). Drain points and sync
    warm-up steps only lower the count of the schedules without flush.
    """
    if name == gpipe.NAME:
        return num_microbatches
    if name == one_f_one_b.NAME:
        return min(num_stages - stage, num_microbatches)
    return min(num_stages - stage, num_steps * num_microbatches)  # 1F1B across batches


def peak_versions(name: str, num_stages: int, num_microbatches: int, stage: int) -> int:
    """An upper bound on the weight versions alive at once on ``stage`` (1: no stash)."""
    if name == pipedream.NAME:
        return -(-(num_stages - stage) // num_microbatches) + 1  # ceil((P-s)/a) + 1
    if name == two_bw.NAME:
        return 2
    return 1
