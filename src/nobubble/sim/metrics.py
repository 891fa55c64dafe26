"""Metrics of a timeline (design.md section 6), the same definitions for simulated and real runs.

- utilization of a stage = busy time / makespan; bubble share = 1 - mean utilization
  (= idle time / (P x makespan));
- steady window = from the start of stage 0's first backward to the end of stage 0's last forward
  (the pipeline is full in between); steady utilization and throughput are measured inside it;
- throughput = micro-batches completed (stage 0 backward ends) per time unit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from nobubble.ir import B, F, Schedule
from nobubble.ledger import Ledger


@dataclass(frozen=True)
class Metrics:
    makespan: float
    bubble_share: float
    utilization: list[float]
    steady_window: tuple[float, float]
    steady_utilization: list[float]
    steady_bubble_share: float
    throughput: float  # micro-batches per time unit over the steady window
    throughput_overall: float  # ... over the whole run
    peak_inflight: list[int]
    peak_versions: list[int]
    max_crossed: list[int]
    crossed_histogram: dict[int, int]

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["steady_window"] = list(self.steady_window)
        out["crossed_histogram"] = {str(k): v for k, v in self.crossed_histogram.items()}
        return out


def steady_window(
    schedule: Schedule, starts: Sequence[Sequence[float]], ends: Sequence[Sequence[float]]
) -> tuple[float, float]:
    """[first backward start, last forward end] on stage 0; the whole run if that is empty."""
    order = schedule.ranks[0]
    first_b = next((starts[0][i] for i, a in enumerate(order) if a.kind == B), 0.0)
    last_f = next((ends[0][i] for i in range(len(order) - 1, -1, -1) if order[i].kind == F), 0.0)
    if last_f <= first_b:
        makespan = max((e[-1] for e in ends if e), default=0.0)
        return (0.0, makespan)
    return (first_b, last_f)


def compute_metrics(
    schedule: Schedule,
    starts: Sequence[Sequence[float]],
    ends: Sequence[Sequence[float]],
    ledger: Ledger,
) -> Metrics:
    """Metrics from per-rank start/end times aligned with the orders (simulated or measured)."""
    t0 = min((s[0] for s in starts if s), default=0.0)
    makespan = max((e[-1] for e in ends if e), default=0.0) - t0
    lo, hi = steady_window(schedule, starts, ends)
    busy, steady_busy = [], []
    for rank in range(schedule.num_ranks):
        s, e = np.asarray(starts[rank], dtype=float), np.asarray(ends[rank], dtype=float)
        busy.append(float((e - s).sum()))
        steady_busy.append(float(np.clip(np.minimum(e, hi) - np.maximum(s, lo), 0.0, None).sum()))
    utilization = [b / makespan if makespan > 0 else 0.0 for b in busy]
    width = hi - lo
    steady_util = [b / width if width > 0 else 0.0 for b in steady_busy]
    completed = sum(
        1 for i, a in enumerate(schedule.ranks[0]) if a.kind == B and lo < ends[0][i] <= hi
    )
    summary = ledger.summary()
    return Metrics(
        makespan=makespan,
        bubble_share=1.0 - sum(utilization) / len(utilization),
        utilization=utilization,
        steady_window=(lo - t0, hi - t0),
        steady_utilization=steady_util,
        steady_bubble_share=1.0 - sum(steady_util) / len(steady_util),
        throughput=completed / width if width > 0 else 0.0,
        throughput_overall=schedule.total_microbatches / makespan if makespan > 0 else 0.0,
        peak_inflight=[row["peak_inflight"] for row in summary],
        peak_versions=[row["peak_versions"] for row in summary],
        max_crossed=[row["max_crossed"] for row in summary],
        crossed_histogram=ledger.crossed_histogram(),
    )
