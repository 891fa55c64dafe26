"""Chrome/Perfetto trace JSON (open in https://ui.perfetto.dev or chrome://tracing)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nobubble.core.ir import Action


def trace_events(
    lanes: Sequence[Sequence[tuple[Action, float, float]]],
    time_scale_us: float = 1000.0,
    process_name: str = "nobubble",
    pid: int = 0,
    lane_names: Sequence[str] | None = None,
) -> list[dict[str, Any]]:
    """Complete ('X') events, one thread per lane (a stage, or a rank holding several stages:
    each event's args name its stage); times are multiplied by ``time_scale_us``."""
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": process_name}}
    ]
    for lane, spans in enumerate(lanes):
        events.append(
            {
                "name": "thread_name",
                "ph": "M",
                "pid": pid,
                "tid": lane,
                "args": {"name": lane_names[lane] if lane_names else f"stage {lane}"},
            }
        )
        for action, start, end in spans:
            events.append(
                {
                    "name": str(action),
                    "cat": action.kind,
                    "ph": "X",
                    "pid": pid,
                    "tid": lane,
                    "ts": start * time_scale_us,
                    "dur": (end - start) * time_scale_us,
                    "args": {"stage": action.stage, "kind": action.kind, "number": action.number},
                }
            )
    return events


def save_trace(path: str | Path, events: list[dict[str, Any]]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return path
