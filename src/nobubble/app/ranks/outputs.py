"""What a finished distributed run writes besides its metrics: the measured timeline (a Chrome trace
and the figures of every rank) and the summary."""

from __future__ import annotations

import json
from typing import Any

import torch.distributed as dist

from nobubble.app.train.trainer import RunResult, run_summary
from nobubble.core.ir import STEP, Action
from nobubble.core.sim.metrics import measured_utilization
from nobubble.core.viz import save_gantt, save_trace, trace_events


def by_stage(gathered: list[dict[str, Any]], values: list[list[Any]]) -> list[Any]:
    """Each rank's ``values`` (one per local stage, as in its gathered ``stages``), in stage
    order."""
    found: dict[int, Any] = {}
    for g, per_stage in zip(gathered, values, strict=True):
        found.update(zip(g["stages"], per_stage, strict=True))
    return [found[s] for s in sorted(found)]


def lane(spans: list[tuple[str, float, float]]) -> list[tuple[Action, float, float]]:
    return [(Action.parse(a), s, e) for a, s, e in spans]


def write_outputs(run: Any, gathered: list[dict[str, Any]], sample: str | None) -> RunResult:
    """The last rank writes the timeline, ledger, sample and summary of the whole run. ``run`` is
    the ``RankRun`` (rank_run.py, which calls this; typed Any so that the two do not import
    each other)."""
    lanes = [
        [(Action.parse(a), s - run.t0, e - run.t0) for a, s, e in g["spans"]] for g in gathered
    ]
    comm = []
    for g in gathered:
        lane = []
        for kind, text, s, e in g["comm"]:
            a = Action.parse(text)  # e.g. recv of 1F3 -> RECV_F; STEP's recv is the all-reduce
            label = "ALLREDUCE" if a.kind == STEP else f"{kind.upper()}_{a.kind}"
            lane.append((Action(a.stage, label, a.number), s - run.t0, e - run.t0))
        comm.append(lane)
    util = measured_utilization(lanes)
    events = trace_events(lanes, time_scale_us=1e6, process_name="compute")
    events += trace_events(comm, time_scale_us=1e6, process_name="communication", pid=1)
    save_trace(run.run_dir / "trace.json", events)
    title = (
        f"{run.cfg.schedule.name}  measured, {run.env.world_size} processes  "
        f"bubble {util['bubble_share']:.1%}"
    )
    save_gantt(run.run_dir / "timeline.png", [(title, lanes)], time_unit="seconds")
    ledger = run.pipe.ledger  # the schedule that ran
    (run.run_dir / "ledger.json").write_text(
        json.dumps(
            {
                "summary": ledger.summary(),
                "crossed_histogram": {str(k): v for k, v in ledger.crossed_histogram().items()},
            },
            indent=1,
        )
        + "\n"
    )
    if sample is not None:
        (run.run_dir / "sample.txt").write_text(sample + "\n")
    replica0 = gathered[: run.num_ranks]  # replica 0's ranks hold every stage once
    peaks = by_stage(replica0, [g["peaks"] for g in replica0])
    summary = run_summary(run.cfg, run.records, peaks, sample)
    summary.update({"runtime": "dist", "backend": dist.get_backend(), **util})
    summary["memory"] = [g["memory"] for g in gathered]  # per rank, in bytes
    # seconds per all-reduce, and the share hidden behind work
    if run.cfg.runtime.data_parallel > 1:
        figures = [g["allreduce"] for g in gathered]
        summary.update(
            data_parallel=run.cfg.runtime.data_parallel,
            allreduce_s=sum(f["allreduce_s"] for f in figures) / len(figures),
            allreduce_overlap=sum(f["allreduce_overlap"] for f in figures) / len(figures),
        )
    (run.run_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return RunResult(run.run_dir, run.records, summary)


__all__ = [
    "by_stage",
    "lane",
    "write_outputs",
]
