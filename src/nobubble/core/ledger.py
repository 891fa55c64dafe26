"""The version ledger: which weight version every forward, backward and step used.

For each (stage, micro-batch): the version its forward read, the version its backward read, the
step that applied its gradient, and how many updates the stage applied between the two (crossed).
Everything is derived from each rank's order and the schedule's two weight rules, here and only
here; the validator, simulator, emulator and plots read it from this module.

With a split backward the weights are read by I (the input gradient multiplies by them), so I
counts as the backward here; W only finishes the micro-batch, which stays in flight (its saved
input and output gradient held) until W has run, and W's gradient is what the next step applies.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from nobubble.core.ir import STEP, Action, B, F, I, Schedule


def forward_version(rule: str, batch: int, current: int, sync_warmup: int = 0) -> int:
    """Version a forward of batch ``batch`` reads when the stage has applied ``current`` steps.

    Batches before ``sync_warmup`` run synchronously and read the current version.
    """
    if rule == "previous_batch" and batch >= sync_warmup:  # 2BW: batch j at version j-1
        return max(batch - 1, 0)
    return current


def backward_version(rule: str, fwd_version: int, current: int) -> int:
    """Version a backward reads: the forward's stashed copy, or the live weights."""
    return fwd_version if rule == "stashed" else current


@dataclass(frozen=True)
class StageLedger:
    """Per-micro-batch arrays (indexed by global micro-batch) for one stage."""

    stage: int
    fwd_version: list[int]
    bwd_version: list[int]
    fwd_current: list[int]  # steps the stage had applied when the forward ran
    bwd_current: list[int]  # ... and when the backward ran
    applied_step: list[int]
    peak_inflight: int  # most micro-batches whose forward ran and whose gradient is not done
    peak_versions: int

    @cached_property
    def crossed(self) -> list[int]:
        """Updates the stage applied between each micro-batch's forward and backward."""
        return [b - f for b, f in zip(self.bwd_current, self.fwd_current, strict=True)]

    @cached_property
    def delay(self) -> list[int]:
        """Version each gradient was applied to minus the version its forward read."""
        return [a - 1 - f for a, f in zip(self.applied_step, self.fwd_version, strict=True)]


def _live_versions(intervals: dict[int, list[int]]) -> int:
    """Most versions alive at once; each version is alive on the half-open [created, end)."""
    events = []
    for start, end in intervals.values():
        events += [(start, 1), (end, -1)]
    events.sort()  # at equal positions the -1 (freed) sorts first: out-of-place handover
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


def _stage_ledger(schedule: Schedule, stage: int) -> StageLedger:
    total = schedule.total_microbatches
    m_per_step = schedule.num_microbatches
    fwd_version, bwd_version = [-1] * total, [-1] * total
    fwd_current, bwd_current = [-1] * total, [-1] * total
    applied = [-1] * total
    intervals: dict[int, list[int]] = {0: [-1, -1]}  # version -> [created, end)
    current = inflight = peak_inflight = 0
    unapplied: list[int] = []
    order = stage_order(schedule, stage)
    stashed = schedule.backward_rule == "stashed"
    warmup = schedule.sync_warmup
    done = schedule.gradient_kind  # B, or W when backwards are split
    for pos, (_, kind, m) in enumerate(order):
        if kind == F:
            v = forward_version(schedule.forward_rule, m // m_per_step, current, warmup)
            fwd_version[m], fwd_current[m] = v, current
            interval = intervals[v]
            interval[1] = max(interval[1], pos + 1)
            inflight += 1
            peak_inflight = max(peak_inflight, inflight)
        elif kind in (B, I):
            v = backward_version(schedule.backward_rule, fwd_version[m], current)
            bwd_version[m], bwd_current[m] = v, current
            if stashed:
                interval = intervals[v]
                interval[1] = max(interval[1], pos + 1)
        if kind == done:
            inflight -= 1
            unapplied.append(m)
        if kind == STEP:
            intervals[current][1] = max(intervals[current][1], pos)  # superseded here
            current += 1
            intervals[current] = [pos, pos]
            for u in unapplied:
                applied[u] = current
            unapplied.clear()
    intervals[current][1] = len(order)
    return StageLedger(
        stage,
        fwd_version,
        bwd_version,
        fwd_current,
        bwd_current,
        applied,
        peak_inflight,
        _live_versions(intervals),
    )


@dataclass(frozen=True)
class Ledger:
    schedule: Schedule
    stages: tuple[StageLedger, ...]

    def records(self) -> Iterator[dict[str, int]]:
        """One record per (stage, micro-batch), keys as in the CLI's JSON."""
        for st in self.stages:
            for m in range(self.schedule.total_microbatches):
                yield {
                    "stage": st.stage,
                    "microbatch": m,
                    "fwd_version": st.fwd_version[m],
                    "bwd_version": st.bwd_version[m],
                    "applied_step": st.applied_step[m],
                    "crossed": st.crossed[m],
                    "delay": st.delay[m],
                }

    def summary(self) -> list[dict[str, Any]]:
        rows = []
        total = self.schedule.total_microbatches
        for st in self.stages:
            rows.append(
                {
                    "stage": st.stage,
                    "max_crossed": max(st.crossed),
                    "share_crossed": (total - st.crossed.count(0)) / total,
                    "max_delay": max(st.delay),
                    "peak_inflight": st.peak_inflight,
                    "peak_versions": st.peak_versions,
                }
            )
        return rows

    def crossed_histogram(self, stage: int | None = None) -> dict[int, int]:
        """Drift: how many (stage, micro-batch) pairs crossed 0, 1, 2, ... updates."""
        counts: Counter[int] = Counter()
        for st in self.stages:
            if stage is None or st.stage == stage:
                counts.update(st.crossed)
        return dict(sorted(counts.items()))


def stage_order(schedule: Schedule, stage: int) -> Sequence[Action]:
    """The actions of ``stage`` in the order its rank runs them."""
    order = schedule.ranks[schedule.placement.rank_of(stage)]
    if schedule.placement.stages_per_rank == 1:
        return order
    return [a for a in order if a.stage == stage]


def rank_peak_inflight(schedule: Schedule) -> list[int]:
    """Per rank: most (stage, micro-batch) pairs whose forward ran and whose gradient is not done,
    over all the rank's stages (a stage of a rank holding v stages is 1/v of the model slice)."""
    done = schedule.gradient_kind
    peaks = []
    for order in schedule.ranks:
        inflight = peak = 0
        for _, kind, _ in order:
            if kind == F:
                inflight += 1
                peak = max(peak, inflight)
            elif kind == done:
                inflight -= 1
        peaks.append(peak)
    return peaks


def build_ledger(schedule: Schedule) -> Ledger:
    """Derive the ledger of a schedule that passed ``validate``."""
    return Ledger(schedule, tuple(_stage_ledger(schedule, s) for s in range(schedule.num_stages)))
