"""Gantt PNG: one lane per rank, a colour per action kind, micro-batch numbers in the bars.

A rank that holds several stages draws its later stages paler, so the loops of an interleaved
schedule and the two arms of a V can be told apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from nobubble.core.ir import Action

COLOURS = {
    "F": "#4C72B0",
    "B": "#DD8452",
    "I": "#C44E52",
    "W": "#CCB974",
    "STEP": "#55A868",
    "SEND": "#8172B3",
    "RECV": "#937860",
}


def _colour(kind: str) -> str:
    return COLOURS.get(kind, COLOURS.get(kind.split("_")[0], "#999999"))


def save_gantt(
    path: str | Path,
    panels: Sequence[tuple[str, Sequence[Sequence[tuple[Action, float, float]]]]],
    time_unit: str = "time",
    max_labels: int = 400,
    lane_names: Sequence[Sequence[str]] | None = None,
) -> Path:
    """One subplot per (title, lanes) panel, sharing the time axis so panels compare directly.

    ``lane_names`` gives each panel's lane labels (default ``stage 0``, ``stage 1``, ...).
    """
    import matplotlib

    matplotlib.use("Agg")  # headless: no display on servers or CI
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    height = sum(1.0 + 0.45 * len(lanes) for _, lanes in panels)
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(13, max(2.5, height)), sharex=True, squeeze=False
    )
    kinds: set[str] = set()
    for index, (ax, (title, lanes)) in enumerate(zip(axes[:, 0], panels, strict=True)):
        spans = sum(len(s) for s in lanes)
        horizon = max((end for lane in lanes for _, _, end in lane), default=1.0) or 1.0
        for lane, lane_spans in enumerate(lanes):
            stages = sorted({action.stage for action, _, _ in lane_spans})
            shade = {s: 1.0 - 0.45 * k / max(1, len(stages) - 1) for k, s in enumerate(stages)}
            bars: dict[tuple[str, int], list[tuple[float, float]]] = {}
            ticks: list[float] = []
            for action, start, end in lane_spans:
                kinds.add(action.kind)
                if action.kind == "STEP" and end - start < 0.002 * horizon:
                    ticks.append(start)  # zero-cost steps still matter for reading versions
                    continue
                bars.setdefault((action.kind, action.stage), []).append((start, end - start))
                label = str(action.number)
                wide = (end - start) / horizon > 0.0045 * len(label)  # label fits in the bar
                if spans <= max_labels and wide and action.kind in ("F", "B", "I", "W"):
                    ax.text(
                        (start + end) / 2,
                        lane,
                        label,
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="white",
                    )
            # one collection per kind and stage: a patch per action made long runs slow to draw
            for (kind, stage), ranges in bars.items():
                bar = ax.broken_barh(
                    ranges,
                    (lane - 0.4, 0.8),
                    facecolors=_colour(kind),
                    alpha=shade[stage],
                    edgecolor="white",
                    linewidth=0.4,
                )
                bar.sticky_edges.x.append(min(start for start, _ in ranges))  # as barh: no margin
            if ticks:
                ax.vlines(ticks, lane - 0.45, lane + 0.45, color=_colour("STEP"), linewidth=1.5)
        names = lane_names[index] if lane_names else [f"stage {s}" for s in range(len(lanes))]
        ax.set_yticks(range(len(lanes)), list(names))
        ax.invert_yaxis()
        ax.set_title(title, fontsize=10, loc="left")
    axes[-1, 0].set_xlabel(time_unit)
    shown = [k for k in ("F", "B", "I", "W") if k in kinds] + ["STEP"]
    handles = [Patch(color=COLOURS[k], label=k) for k in shown]
    fig.legend(handles=handles, loc="upper right", ncol=len(handles), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
