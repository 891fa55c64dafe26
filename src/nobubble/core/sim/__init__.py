"""Discrete-event simulation of a schedule under a cost model: timeline and metrics."""

from __future__ import annotations

from dataclasses import dataclass

from nobubble.core.ir import Schedule
from nobubble.core.ledger import Ledger, build_ledger
from nobubble.core.sim.cost import CostModel
from nobubble.core.sim.engine import Deadlock, Timeline, run_timeline
from nobubble.core.sim.metrics import Metrics, compute_metrics
from nobubble.core.util import paused_gc

__all__ = ["CostModel", "Deadlock", "Metrics", "SimResult", "Timeline", "simulate"]


@dataclass(frozen=True)
class SimResult:
    timeline: Timeline
    ledger: Ledger
    metrics: Metrics


def simulate(schedule: Schedule, cost: CostModel, check: bool = True) -> SimResult:
    """Validate (unless ``check`` is False), place every action in time, compute the metrics.

    The engine run doubles as the deadlock check, so validation costs one pass over the orders.
    """
    from nobubble.core.validate import check_orders, deadlock_error  # validate imports the engine

    with paused_gc():
        if check:
            check_orders(schedule)
        try:
            timeline = run_timeline(schedule, cost)
        except Deadlock as err:
            raise deadlock_error(schedule, err) from None
        ledger = build_ledger(schedule)
        metrics = compute_metrics(schedule, timeline.starts, timeline.ends, ledger)
    return SimResult(timeline, ledger, metrics)
