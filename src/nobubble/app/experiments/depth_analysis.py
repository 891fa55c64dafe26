"""Paper A, section 6 in miniature: the gap to sync of PipeDream (delay growing with P) and 2BW
(delay 1 at every P), paired by seed.

With no clipping the synchronous baseline and 2bw are the same run at every P (grids.depth), so
each PipeDream depth is paired with that one baseline, and 2bw's gap is one interval shown at
every P: constant by construction, not a finding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nobubble.app.experiments import stats
from nobubble.app.experiments.analysis import COLOURS, FORMAT, _ms, by_seed, mean_std, select
from nobubble.app.experiments.runner import RunOutcome

DEPTH_SERIES = (("pipedream", "none"), ("pipedream", "ef"))
# The depth design a summary was made with; the report reads no other (an older one clipped per
# stage, gave PipeDream the whole batch per update and Muon momentum 0.95).
DESIGN = "clip0-one-baseline-pipedream-B/P-muon0.99"


def analyze_depth(
    outcomes: dict[str, RunOutcome], out: Path, optimizers: tuple[str, ...]
) -> dict[str, Any]:
    """Per optimizer: PipeDream's gap to the one synchronous baseline at each P, 2bw's gap (the
    same at every P), both paired by seed; and how PipeDream's gap grows from the smallest P to
    the largest (gap(P_max) - gap(P_min) per seed)."""
    gaps: dict[str, dict[str, dict[str, Any]]] = {}
    growth: dict[str, dict[str, Any]] = {}
    sync_val: dict[str, dict[str, float]] = {}
    depths: list[int] = []
    for opt in [o for o in ("adamw", "muon") if o in optimizers]:
        runs = select(outcomes, optimizer=opt)
        depths = sorted({o.spec.labels["stages"] for o in select(runs, schedule="pipedream")})
        sync = by_seed(select(runs, schedule="1f1b"))
        sync_val[opt] = mean_std(list(sync.values()))
        gaps[opt], growth[opt] = {}, {}
        for schedule, corr in DEPTH_SERIES:
            name = schedule + ("+EF" if corr == "ef" else "")
            at = {
                p: stats.paired(
                    by_seed(select(runs, schedule=schedule, stages=p, correction=corr)), sync
                )
                for p in depths
            }
            gaps[opt][name] = {str(p): iv for p, iv in at.items()}
            if len(depths) > 1:
                first, last = stats.per_seed(at[depths[0]]), stats.per_seed(at[depths[-1]])
                growth[opt][name] = stats.paired(last, first)
        two_bw = stats.paired(by_seed(select(runs, schedule="2bw", correction="none")), sync)
        gaps[opt]["2bw"] = {str(p): two_bw for p in depths}
    _depth_figure(out / "depth_gap.png", gaps)
    return {
        "format": FORMAT,
        "design": DESIGN,
        "gaps": gaps,
        "growth": growth,
        "growth_depths": [depths[0], depths[-1]] if len(depths) > 1 else None,
        "sync_val": sync_val,
        "figures": ["depth_gap.png"],
    }


def _depth_figure(path: Path, gaps: dict[str, dict[str, dict[str, Any]]]) -> None:
    """Mean gap to sync against P, one line per optimizer and schedule."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    depths: set[int] = set()
    for opt, series in gaps.items():
        for name, by_p in series.items():
            ps = sorted(int(p) for p in by_p)
            depths.update(ps)
            style = ("-" if "pipedream" in name else "--") + ("o" if "EF" in name else "s")
            means = [by_p[str(p)]["mean"] for p in ps]
            ax.plot(ps, means, style, color=COLOURS[opt], label=f"{opt} {name}")
    ax.axhline(0, color="grey", linewidth=0.8)
    ax.set_xlabel("pipeline stages P")
    ax.set_ylabel("val loss gap to sync (mean over seeds)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(depths), [str(p) for p in sorted(depths)])
    ax.minorticks_off()
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def depth_table(summary: dict[str, Any]) -> str:
    lines = [
        f"Gap to the one synchronous baseline (P=1, no clipping: the same at every P), paired by "
        f"seed: mean [{stats.CONFIDENCE:.0%} CI] (n seeds). PipeDream: B/P sequences per update, "
        "P times the updates; 2bw: one run, the same at every P.",
        "",
        "| optimizer | schedule | by P |",
        "|---|---|---|",
    ]
    for opt, val in summary["sync_val"].items():
        lines.append(f"| {opt} | sync (1f1b, P=1) val loss, the baseline of every P | {_ms(val)} |")
    for opt, series in summary["gaps"].items():
        for name, by_p in series.items():
            text = ", ".join(f"P={p}: {stats.fmt_interval(iv)}" for p, iv in by_p.items())
            if name == "2bw" and by_p:  # one run for every P
                text = f"every P (one run): {stats.fmt_interval(next(iter(by_p.values())))}"
            lines.append(f"| {opt} | {name} | {text} |")
    return "\n".join(lines)
