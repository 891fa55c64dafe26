"""Schedule generators, one per file, built from integers only.

``build_schedule`` is the single entry point: it checks the integers, resolves what M means for
each schedule (the accumulation factor ``a`` for ``pipedream`` and ``paci``) and how many stages
each of the P ranks holds (v for ``interleaved-1f1b``, 2 for ``zbv``, else 1), checks the
schedule's preconditions and calls the generator.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

from nobubble.core.ir import Schedule, ScheduleError
from nobubble.core.schedules import (
    dualpipev,
    gpipe,
    interleaved_1f1b,
    looped_bfs,
    one_f_one_b,
    paci,
    pipedream,
    two_bw,
    zb_h1,
    zbv,
)
from nobubble.core.schedules.bounds import MAX_ACTIONS, check_size
from nobubble.core.util import paused_gc

Generator = Callable[..., Schedule]


@dataclass(frozen=True)
class ScheduleInfo:
    name: str
    summary: str
    generate: Generator
    synchronous: bool
    uses_accum: bool  # M is the accumulation factor ``a`` (steps every ``a`` backwards)
    default_accum: int | None  # None: defaults to --microbatches
    split_backward: bool = False  # backwards run as I then W
    placement: str = "one"  # "one" stage per rank, "loop" (v per rank, interleaved) or "v" (2)
    default_virtual: int = 1  # stages per rank when --virtual-stages is not given
    check: Callable[[int, int, int], None] | None = None  # preconditions on (P, M, v)


SCHEDULES: dict[str, ScheduleInfo] = {
    info.name: info
    for info in (
        ScheduleInfo(gpipe.NAME, gpipe.SUMMARY, gpipe.generate, True, False, None),
        ScheduleInfo(
            one_f_one_b.NAME, one_f_one_b.SUMMARY, one_f_one_b.generate, True, False, None
        ),
        ScheduleInfo(pipedream.NAME, pipedream.SUMMARY, pipedream.generate, False, True, 1),
        ScheduleInfo(
            two_bw.NAME, two_bw.SUMMARY, two_bw.generate, False, False, None, check=two_bw.check
        ),
        ScheduleInfo(paci.NAME, paci.SUMMARY, paci.generate, False, True, None),
        ScheduleInfo(
            interleaved_1f1b.NAME,
            interleaved_1f1b.SUMMARY,
            interleaved_1f1b.generate,
            True,
            False,
            None,
            placement="loop",
            default_virtual=2,
            check=interleaved_1f1b.check,
        ),
        ScheduleInfo(
            zb_h1.NAME, zb_h1.SUMMARY, zb_h1.generate, True, False, None, split_backward=True
        ),
        ScheduleInfo(
            zbv.NAME,
            zbv.SUMMARY,
            zbv.generate,
            True,
            False,
            None,
            split_backward=True,
            placement="v",
            default_virtual=2,
            check=zbv.check,
        ),
        ScheduleInfo(
            dualpipev.NAME,
            dualpipev.SUMMARY,
            dualpipev.generate,
            True,
            False,
            None,
            split_backward=True,
            placement="v",
            default_virtual=2,
            check=dualpipev.check,
        ),
        ScheduleInfo(
            looped_bfs.NAME,
            looped_bfs.SUMMARY,
            looped_bfs.generate,
            True,
            False,
            None,
            placement="loop",
            default_virtual=2,
            check=looped_bfs.check,
        ),
    )
}
SCHEDULE_NAMES = tuple(SCHEDULES)


def schedule_info(name: str) -> ScheduleInfo:
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}; valid names: {', '.join(SCHEDULE_NAMES)}")
    return SCHEDULES[name]


def _check_positive(label: str, flag: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ScheduleError(
            f"{label} must be an integer >= 1, got {value!r}; set {flag} to 1 or more"
        )


def resolve_microbatches(name: str, num_microbatches: int, accum: int | None) -> int:
    """Micro-batches per optimizer step for schedule ``name``.

    ``pipedream`` and ``paci`` step every ``a`` backwards, so their M is ``a``: ``--accum`` when
    given, else 1 for ``pipedream`` (the original PipeDream) and ``--microbatches`` for ``paci``
    (PACI at equal M, the paper's comparison). Other schedules use ``--microbatches``.
    """
    info = schedule_info(name)
    if accum is not None:
        _check_positive("the accumulation factor a", "--accum", accum)
    if not info.uses_accum:
        return num_microbatches
    if accum is not None:
        return accum
    return info.default_accum if info.default_accum is not None else num_microbatches


def resolve_virtual_stages(name: str, virtual_stages: int | None) -> int:
    """Stages per rank for schedule ``name``: ``virtual_stages`` when given, else its default.

    Only ``interleaved-1f1b`` (any v >= 2) and ``zbv`` (v = 2) place several stages per rank.
    """
    info = schedule_info(name)
    if virtual_stages is None:
        return info.default_virtual
    _check_positive("the stages per rank v", "--virtual-stages", virtual_stages)
    if info.placement == "one" and virtual_stages != 1:
        multi = ", ".join(n for n, i in SCHEDULES.items() if i.placement != "one")
        raise ScheduleError(
            f"{name} runs one stage per rank, so --virtual-stages {virtual_stages} does not "
            f"apply; it applies to {multi}"
        )
    return virtual_stages


def build_schedule(
    name: str,
    num_stages: int,
    num_microbatches: int,
    num_steps: int,
    accum: int | None = None,
    drain_every: int | None = None,
    sync_warmup: int = 0,
    max_actions: int | None = MAX_ACTIONS,
    drain_at: Collection[int] = (),
    virtual_stages: int | None = None,
) -> Schedule:
    """Generate schedule ``name`` for P ranks, M micro-batches per step and N steps.

    ``num_stages`` is P, the pipeline's ranks: the stages too for the schedules that place one
    stage per rank; ``interleaved-1f1b`` cuts the model into v·P stages (``virtual_stages`` v,
    default 2) and ``zbv`` into 2P.

    ``sync_warmup`` (asynchronous schedules only) runs the first steps flushed, as 1f1b does,
    before switching to the schedule's own order and weight rules (arXiv 2606.30634, sec. 5).
    Sizes above ``max_actions`` actions are refused before any is generated (the schedule
    commands keep the default, which they print in seconds; training passes None: a long run
    builds its whole schedule up front, which costs time and memory but is not refused).
    ``drain_at``: steps after which the pipeline drains too (the API's ``drain()`` calls).
    """
    _check_positive("the number of stages P", "--stages", num_stages)
    _check_positive("the number of micro-batches M", "--microbatches", num_microbatches)
    m = resolve_microbatches(name, num_microbatches, accum)
    virtual = resolve_virtual_stages(name, virtual_stages)
    return generate_resolved(
        name, num_stages, m, virtual, num_steps, drain_every, sync_warmup, max_actions, drain_at
    )


def generate_resolved(
    name: str,
    num_stages: int,
    m: int,
    virtual: int,
    num_steps: int,
    drain_every: int | None = None,
    sync_warmup: int = 0,
    max_actions: int | None = MAX_ACTIONS,
    drain_at: Collection[int] = (),
) -> Schedule:
    """``build_schedule`` once M and v are resolved (``ScheduleSpec`` resolves them once)."""
    info = schedule_info(name)
    _check_positive("the number of steps", "--steps", num_steps)
    if drain_every is not None:
        _check_positive("the drain interval", "--drain-every", drain_every)
    if not isinstance(sync_warmup, int) or sync_warmup < 0:
        raise ScheduleError(f"sync warm-up must be an integer >= 0 steps, got {sync_warmup!r}")
    if info.check is not None:
        info.check(num_stages, m, virtual)
    if max_actions is not None:
        check_size(name, num_stages, m, num_steps, max_actions, virtual, info.split_backward)
    placed = {} if info.placement == "one" else {"virtual_stages": virtual}
    with paused_gc():
        if sync_warmup:
            if info.synchronous:
                raise ScheduleError(
                    f"sync warm-up {sync_warmup} applies to asynchronous schedules only; "
                    f"{name} is synchronous throughout: drop the sync-warmup correction"
                )
            return info.generate(
                num_stages, m, num_steps, drain_every, sync_warmup=sync_warmup, drain_at=drain_at
            )
        return info.generate(num_stages, m, num_steps, drain_every, drain_at=drain_at, **placed)


__all__ = [
    "SCHEDULES",
    "SCHEDULE_NAMES",
    "ScheduleInfo",
    "build_schedule",
    "generate_resolved",
    "resolve_microbatches",
    "resolve_virtual_stages",
    "schedule_info",
]
