"""``nobubble demo``: PACI with Muon against 1F1B-flush on two real processes, side by side.

Two short runs of the multi-process runtime on the default corpus with the same model, data,
micro-batches and seed; then one table (loss, validation loss, tokens/s, measured utilization)
and one figure with both measured timelines on a shared time axis.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from nobubble.core.errors import NobubbleError
from nobubble.core.ir import Action
from nobubble.core.viz import save_gantt

SCHEDULES = ("1f1b", "paci")


def demo_flags(steps: int) -> list[str]:
    # `mini` with a 1024-token vocabulary: the blocks, not the head, carry the cost, so the two
    # stages are balanced and the bubble is the schedule's, not the partition's.
    flags = "--runtime dist --stages 2 --microbatches 4 --optimizer muon --lr 1e-2 --model mini"
    flags += " --vocab-size 1024 --sample-tokens 0"
    return [*flags.split(), "--steps", str(steps), "--eval-every", str(max(1, steps // 4))]


def _compute_lanes(trace: Path, window_s: float) -> list[list[tuple[Action, float, float]]]:
    """The first ``window_s`` seconds of a run's measured compute spans, one lane per stage."""
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X" and e["pid"] == 0]
    t0 = min(e["ts"] for e in spans)
    lanes: dict[int, list[tuple[Action, float, float]]] = {}
    for e in spans:
        start = (e["ts"] - t0) / 1e6
        if start <= window_s:
            lanes.setdefault(e["tid"], []).append(
                (Action.parse(e["name"]), start, start + e["dur"] / 1e6)
            )
    return [lanes[k] for k in sorted(lanes)]


def run_demo(out: Path, steps: int, progress: bool = True) -> dict[str, Any]:
    summaries = {}
    for schedule in SCHEDULES:
        run_dir = out / schedule
        if not (run_dir / "summary.json").exists():
            command = [
                sys.executable,
                "-m",
                "nobubble",
                "train",
                *demo_flags(steps),
                "--schedule",
                schedule,
                "--out",
                str(run_dir),
            ]
            if not progress:
                command.append("--no-progress")
            # the runs report on stderr: stdout carries only the demo's own table or JSON
            if subprocess.run(command, stdout=sys.stderr).returncode != 0:
                raise NobubbleError(f"the {schedule} demo run failed; see the messages above")
        summaries[schedule] = json.loads((run_dir / "summary.json").read_text())
    window = 1.5  # seconds of each timeline: a few batches, readable
    panels = [
        (
            f"{s}: measured, 2 processes, first {window} s (bubble over the whole run "
            f"{summaries[s]['bubble_share']:.0%})",
            _compute_lanes(out / s / "trace.json", window),
        )
        for s in SCHEDULES
    ]
    figure = save_gantt(out / "timelines.png", panels, time_unit="seconds", max_labels=400)
    return {"runs": summaries, "figure": str(figure)}


def format_demo(result: dict[str, Any]) -> str:
    runs = result["runs"]
    rows = [
        ("", *SCHEDULES),
        ("final train loss", *(f"{runs[s]['last_loss']:.3f}" for s in SCHEDULES)),
        ("final val loss", *(f"{runs[s]['val_loss']:.3f}" for s in SCHEDULES)),
        ("tokens/s (steady)", *(f"{runs[s]['tokens_per_s']:,.0f}" for s in SCHEDULES)),
        (
            "utilization per stage",
            *(", ".join(f"{u:.2f}" for u in runs[s]["utilization"]) for s in SCHEDULES),
        ),
        ("bubble share", *(f"{runs[s]['bubble_share']:.1%}" for s in SCHEDULES)),
        ("wall time (s)", *(f"{runs[s]['elapsed_s']:.1f}" for s in SCHEDULES)),
    ]
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, width, strict=True)) for r in rows]
    speed = runs["paci"]["tokens_per_s"] / runs["1f1b"]["tokens_per_s"]
    lines.append(f"paci / 1f1b tokens/s: {speed:.2f}x (ideal (M+P-1)/M = 1.25 at M=4, P=2)")
    lines.append(f"timelines: {result['figure']}")
    return "\n".join(lines)
