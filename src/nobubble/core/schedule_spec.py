"""``ScheduleSpec``: which schedule a run trains and how a step is cut, resolved and checked once.

The schedule is a registered name (its generator builds the order) or an order given whole: a
``Schedule`` built in code, or a file in torch's CSV format (``from_torch_csv``) or nobubble's
JSON (``from_json``), the files ``nobubble show --format torch-csv|json`` writes and
``show``/``ledger``/``simulate`` read with the same flags. A given order must be synchronous
(core/program.py); its M, ranks and stages per rank must be the run's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nobubble.core.ir import Schedule, ScheduleError
from nobubble.core.placement import Placement
from nobubble.core.program import as_program, order_digest, repeat
from nobubble.core.schedules import (
    SCHEDULES,
    ScheduleInfo,
    _check_positive,
    generate_resolved,
    resolve_microbatches,
    resolve_virtual_stages,
    schedule_info,
)
from nobubble.core.torch_csv import load_torch_csv

FILE_KEYS = ("from_torch_csv", "from_json")  # the keys that give the order as a file


@dataclass(frozen=True, kw_only=True)
class ScheduleSpec:
    """Which schedule runs and how a step is cut: the schedule's part of a run's configuration.

    schedule: a name of ``SCHEDULES`` (``nobubble schedules`` lists them with their summaries),
        or a synchronous ``Schedule`` to train as it is (its first batch repeated every step).
    from_torch_csv, from_json: a schedule file whose order runs instead of a named schedule:
        torch's CSV format or nobubble's JSON (``schedule`` then becomes the file's name).
    microbatches: micro-batches per optimizer step, M (a given order's M must be this). accum:
        the accumulation factor ``a`` of pipedream (default 1) and paci (default
        ``microbatches``); refused elsewhere.
    virtual_stages: interleaved-1f1b's stages per rank v (default 2; zbv's is 2); refused by
        the schedules that place one stage per rank (a given order's, when set, must be its).

    Resolved once, here: ``num_microbatches`` (the M the schedule runs), ``stages_per_rank``
    and ``program`` (a given order's first batch, validated; None for a named schedule).
    """

    schedule: str | Schedule = field(default="1f1b", metadata={"help": "the pipeline schedule"})
    microbatches: int = field(default=4, metadata={"help": "micro-batches per optimizer step M"})
    accum: int | None = field(
        default=None,
        metadata={"help": "accumulation factor a of pipedream (default 1) and paci (default M)"},
    )
    virtual_stages: int | None = field(
        default=None, metadata={"help": "stages per rank v of interleaved-1f1b (default 2; zbv: 2)"}
    )
    from_torch_csv: str | None = field(
        default=None,
        metadata={
            "help": "train the order of this torch CSV schedule file (a synchronous one, as "
            "`nobubble show --format torch-csv` writes) instead of --schedule"
        },
    )
    from_json: str | None = field(
        default=None,
        metadata={
            "help": "train the order of this nobubble JSON schedule file (a synchronous one, as "
            "`nobubble show --format json` writes) instead of --schedule"
        },
    )
    num_microbatches: int = field(init=False)
    stages_per_rank: int = field(init=False)
    program: Schedule | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        _check_positive("the number of micro-batches M", "--microbatches", self.microbatches)
        program = self._given_order()
        object.__setattr__(self, "program", program)
        if program is not None:
            self._check_order(program)
            object.__setattr__(self, "num_microbatches", program.num_microbatches)
            object.__setattr__(self, "stages_per_rank", program.placement.stages_per_rank)
            return
        info = schedule_info(self.name)
        if self.accum is not None and not info.uses_accum:
            accum_users = ", ".join(n for n, i in SCHEDULES.items() if i.uses_accum)
            raise ScheduleError(
                f"accum={self.accum} applies to {accum_users}, not {self.name}: use microbatches"
            )
        m = resolve_microbatches(self.name, self.microbatches, self.accum)
        object.__setattr__(self, "num_microbatches", m)
        v = resolve_virtual_stages(self.name, self.virtual_stages)
        object.__setattr__(self, "stages_per_rank", v)

    # ----- an order given whole ----------------------------------------------------------------
    @property
    def source(self) -> str:
        """Where the order comes from, as the user gave it (for messages)."""
        for key in FILE_KEYS:
            if getattr(self, key) is not None:
                return f"{key}={str(getattr(self, key))!r}"
        return f"schedule={self.name!r}"

    def _given_order(self) -> Schedule | None:
        """The order given as a file or a Schedule, loaded and cut to one batch; None for a
        name."""
        given = [k for k in FILE_KEYS if getattr(self, k) is not None]
        if isinstance(self.schedule, Schedule):
            given.insert(0, "schedule")
        if len(given) > 1:
            raise ScheduleError(f"{' and '.join(given)} each give the schedule's order: give one")
        if not given:
            if not isinstance(self.schedule, str):
                raise TypeError(
                    f"schedule must be a name or a nobubble Schedule, got {self.schedule!r}"
                )
            return None
        if given[0] == "schedule":
            assert isinstance(self.schedule, Schedule)
            return as_program(self.schedule, f"schedule={self.schedule.name!r}")
        path = str(getattr(self, given[0]))
        # validated as read: a torch CSV's errors name torch's rank, step and cell
        loaded = load_torch_csv(path) if given[0] == "from_torch_csv" else Schedule.load_json(path)
        object.__setattr__(self, "schedule", Path(path).name)  # the run's name for the order
        return as_program(loaded, self.source)

    def _check_order(self, program: Schedule) -> None:
        """The run's M, a, v agree with the order's, each named with the fix."""
        if self.accum is not None:
            raise ScheduleError(
                f"accum={self.accum} applies to pipedream and paci; {self.source} runs "
                f"{program.num_microbatches} micro-batches per step: drop accum"
            )
        if self.microbatches != program.num_microbatches:
            raise ScheduleError(
                f"{self.source} runs M={program.num_microbatches} micro-batches per step, but "
                f"microbatches={self.microbatches}: set microbatches={program.num_microbatches} "
                f"(--microbatches {program.num_microbatches}), or write the file for M="
                f"{self.microbatches}"
            )
        v = program.placement.stages_per_rank
        if self.virtual_stages is not None and self.virtual_stages != v:
            raise ScheduleError(
                f"{self.source} places {v} stage(s) per rank, but virtual_stages="
                f"{self.virtual_stages}: drop virtual_stages (--virtual-stages), or set it to {v}"
            )

    # ----- what follows --------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """The schedule's name: the registered one, a file's name, or a Schedule's own."""
        return self.schedule.name if isinstance(self.schedule, Schedule) else self.schedule

    @property
    def info(self) -> ScheduleInfo:
        if self.program is None:
            return SCHEDULES[self.name]
        where = self.program.placement
        return ScheduleInfo(
            self.name,
            f"the order of {self.source}",
            _no_generator,
            True,
            False,
            None,
            split_backward=self.program.split_backward,
            placement=where.kind,
            default_virtual=where.stages_per_rank,
        )

    @property
    def digest(self) -> str | None:
        """A given order's hash (what a checkpoint and every rank compare); None for a name."""
        return None if self.program is None else order_digest(self.program)

    def check(self, num_ranks: int) -> None:
        """The schedule's own preconditions on (P, M, v), before any is generated; a given
        order's ranks must be P."""
        _check_positive("the number of stages P", "--stages", num_ranks)
        if self.program is not None and self.program.num_ranks != num_ranks:
            P = self.program.num_ranks
            raise ScheduleError(
                f"{self.source} holds {P} ranks (one row each), but the run has {num_ranks} "
                f"(--stages, num_ranks): set --stages {P}, or write the file for {num_ranks} ranks"
            )
        if self.program is None and self.info.check is not None:
            self.info.check(num_ranks, self.num_microbatches, self.stages_per_rank)

    def check_stages(self, num_stages: int) -> None:
        """A given order's stages are the pipeline's ``num_stages`` stage modules."""
        if self.program is not None and self.program.num_stages != num_stages:
            S, where = self.program.num_stages, self.program.placement
            raise ValueError(
                f"{self.source} runs {S} stages ({where.num_ranks} ranks x "
                f"{where.stages_per_rank}), but {num_stages} stage modules were given: split "
                f"the model into {S} stages, or write the file for {num_stages}"
            )

    def placement(self, num_ranks: int) -> Placement:
        return Placement(self.info.placement, num_ranks, self.stages_per_rank)

    def generate(self, num_ranks: int, num_steps: int, **options: Any) -> Schedule:
        """The schedule for P = ``num_ranks`` and ``num_steps`` steps (``options``: those of
        ``generate_resolved``: drain_every, sync_warmup, max_actions, drain_at; a given order
        is flushed after every step, so it needs none)."""
        if self.program is not None:
            self.check(num_ranks)
            return repeat(self.program, num_steps, self.name)
        return generate_resolved(
            self.name, num_ranks, self.num_microbatches, self.stages_per_rank, num_steps, **options
        )


def _no_generator(*args: Any, **kwargs: Any) -> Schedule:
    raise AssertionError("a given order is repeated (ScheduleSpec.generate), not generated")


def check_one_schedule(keys: Mapping[str, Any]) -> None:
    """Keys a user gave (flags, a config file, ``Pipeline``'s keywords) name one schedule: a
    registered name and a file are two."""
    files = [k for k in FILE_KEYS if keys.get(k) is not None]
    name = keys.get("schedule")
    # a saved run's config names the file's order after the file (``schedule`` after load)
    named = isinstance(name, str) and name in SCHEDULES
    if files and named and name != Path(str(keys[files[0]])).name:
        raise ScheduleError(
            f"schedule={name!r} and {files[0]}={str(keys[files[0]])!r} name two schedules: "
            f"give one (the file's order runs under the file's name)"
        )


__all__ = ["FILE_KEYS", "ScheduleSpec", "check_one_schedule"]
