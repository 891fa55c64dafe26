"""Metrics of a timeline, one definition for simulated and real runs (docs/semantics.md,
"Simulator").

- utilization of a stage = busy time / makespan; bubble share = 1 - mean utilization
  (= idle time / (P x makespan));
- steady window = from the start of rank 0's first backward (B or I) to the end of rank 0's last
  forward (the pipeline is full in between); steady utilization and throughput are measured
  inside it;
- throughput = micro-batches completed on rank 0 (B, or W when backwards are split; each of a
  rank's v stages counts 1/v) per time unit.

Utilization is per rank; the ledger's peaks (in flight, versions, crossed) are per stage, and
``rank_peak_inflight`` sums a rank's stages (the same numbers when a rank holds one stage).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from nobubble.core.ir import Action, B, F, I, Schedule
from nobubble.core.ledger import Ledger, rank_peak_inflight


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
    rank_peak_inflight: list[int]  # per rank, over its stages (stage-micro-batches)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["steady_window"] = list(self.steady_window)
        out["crossed_histogram"] = {str(k): v for k, v in self.crossed_histogram.items()}
        return out


def steady_window(
    rank0: Sequence[Action], starts: Sequence[float], ends: Sequence[float], run_end: float
) -> tuple[float, float]:
    """[first backward start, last forward end] on rank 0; the whole run if that is empty."""
    first_b = next((starts[i] for i, a in enumerate(rank0) if a.kind in (B, I)), 0.0)
    last_f = next((ends[i] for i in range(len(rank0) - 1, -1, -1) if rank0[i].kind == F), 0.0)
    if last_f <= first_b:
        return (min(starts, default=0.0), run_end)
    return (first_b, last_f)


def busy_in(starts: Sequence[float], ends: Sequence[float], lo: float, hi: float) -> float:
    """Busy time of one rank inside the window [lo, hi]."""
    s, e = np.asarray(starts, dtype=float), np.asarray(ends, dtype=float)
    return float(np.clip(np.minimum(e, hi) - np.maximum(s, lo), 0.0, None).sum())


def measured_utilization(
    spans: Sequence[Sequence[tuple[Action, float, float]]],
) -> dict[str, Any]:
    """Utilization and bubble share of measured compute spans (one list per rank).

    Same definitions as the simulator's, over whatever part of the run the spans cover.
    """
    starts = [[s for _, s, _ in lane] for lane in spans]
    ends = [[e for _, _, e in lane] for lane in spans]
    t0 = min(lane[0] for lane in starts if lane)
    t1 = max(lane[-1] for lane in ends if lane)
    lo, hi = steady_window([a for a, _, _ in spans[0]], starts[0], ends[0], t1)
    util = [busy_in(s, e, t0, t1) / (t1 - t0) for s, e in zip(starts, ends, strict=True)]
    steady = [busy_in(s, e, lo, hi) / (hi - lo) for s, e in zip(starts, ends, strict=True)]
    return {
        "wall_s": t1 - t0,
        "utilization": util,
        "bubble_share": 1 - sum(util) / len(util),
        "steady_window_s": [lo - t0, hi - t0],
        "steady_utilization": steady,
        "steady_bubble_share": 1 - sum(steady) / len(steady),
    }


def compute_metrics(
    schedule: Schedule,
    starts: Sequence[Sequence[float]],
    ends: Sequence[Sequence[float]],
    ledger: Ledger,
) -> Metrics:
    """Metrics from per-rank start/end times aligned with the orders (simulated or measured)."""
    t0 = min((s[0] for s in starts if s), default=0.0)
    makespan = max((e[-1] for e in ends if e), default=0.0) - t0
    end = makespan + t0
    lo, hi = steady_window(schedule.ranks[0], starts[0], ends[0], end)
    busy = [busy_in(starts[r], ends[r], t0, end) for r in range(schedule.num_ranks)]
    steady_busy = [busy_in(starts[r], ends[r], lo, hi) for r in range(schedule.num_ranks)]
    utilization = [b / makespan if makespan > 0 else 0.0 for b in busy]
    width = hi - lo
    steady_util = [b / width if width > 0 else 0.0 for b in steady_busy]
    done = schedule.gradient_kind  # a stage of a rank holding v stages finishes 1/v of one
    completed = sum(
        1 for i, a in enumerate(schedule.ranks[0]) if a.kind == done and lo < ends[0][i] <= hi
    ) / len(schedule.placement.stages_of(0))
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
        rank_peak_inflight=rank_peak_inflight(schedule),
    )
