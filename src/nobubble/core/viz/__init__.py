"""Timelines people can look at: Perfetto/Chrome trace JSON and Gantt PNG (one lane per stage)."""

from nobubble.core.viz.gantt import save_gantt
from nobubble.core.viz.trace import save_trace, trace_events

__all__ = ["save_gantt", "save_trace", "trace_events"]
