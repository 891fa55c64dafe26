"""Turn finished runs into the numbers each experiment reports, and their figures."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nobubble.experiments.runner import RunOutcome

COLOURS = {
    "adamw": "#C44E52",
    "muon": "#4C72B0",
    "nadam": "#55A868",
    "lion": "#8172B3",
    "1f1b": "#4C72B0",
    "paci": "#DD8452",
    "2bw": "#C44E52",
    "pipedream": "#8172B3",
}


def final_val(o: RunOutcome) -> float:
    return float(o.summary["val_loss"])


def mean_std(values: list[float]) -> dict[str, float]:
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "n": len(values),
    }


def select(outcomes: dict[str, RunOutcome], **labels: Any) -> list[RunOutcome]:
    """Runs whose labels match; runs of a side study (label ``study``) only when asked for."""
    labels.setdefault("study", None)
    return [
        o for o in outcomes.values() if all(o.spec.labels.get(k) == v for k, v in labels.items())
    ]


def _curves(
    path: Path,
    title: str,
    series: list[tuple[str, str, str, list[RunOutcome]]],
    x_key: str = "step",
) -> None:
    """Validation-loss curves: (label, colour, line style, runs averaged over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for label, colour, style, runs in series:
        points: dict[int, list[float]] = defaultdict(list)
        for run in runs:
            for r in run.metrics:
                if r.get("val_loss") is not None:
                    points[r[x_key]].append(r["val_loss"])
        xs = sorted(points)
        ax.plot(
            xs,
            [statistics.fmean(points[x]) for x in xs],
            style,
            color=colour,
            label=label,
            linewidth=1.6,
        )
    ax.set_xlabel("tokens" if x_key == "tokens" else "optimizer step")
    ax.set_ylabel("validation loss")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----- delay-vs-optimizer ----------------------------------------------------------------------
def analyze_delay(
    outcomes: dict[str, RunOutcome], out: Path, optimizers: tuple[str, ...], lrs: dict[str, float]
) -> dict[str, Any]:
    rows = {}
    for opt in optimizers:
        sync = [final_val(o) for o in select(outcomes, optimizer=opt, schedule="1f1b")]
        delayed = [
            final_val(o) for o in select(outcomes, optimizer=opt, schedule="2bw", correction=None)
        ]
        gaps = [d - s for s, d in zip(sorted(sync), sorted(delayed), strict=False)]
        rows[opt] = {
            "lr": lrs[opt],
            "sync": mean_std(sync),
            "delayed": mean_std(delayed),
            "gap": statistics.fmean(delayed) - statistics.fmean(sync),
            "gap_per_seed": gaps,
        }
    series = []
    for opt in optimizers:
        series.append(
            (f"{opt} sync", COLOURS[opt], "-", select(outcomes, optimizer=opt, schedule="1f1b"))
        )
        series.append(
            (
                f"{opt} 2bw (delay 1)",
                COLOURS[opt],
                "--",
                select(outcomes, optimizer=opt, schedule="2bw", correction=None),
            )
        )
    _curves(out / "loss_curves.png", "sync (solid) vs one-step delay 2bw (dashed)", series)
    return {"optimizers": rows, "figures": ["loss_curves.png"]}


def delay_table(summary: dict[str, Any]) -> str:
    lines = [
        "| optimizer | lr | sync val loss | 2bw val loss | gap (2bw - sync) |",
        "|---|---|---|---|---|",
    ]
    for opt, r in summary["optimizers"].items():
        lines.append(
            f"| {opt} | {r['lr']:g} | {_ms(r['sync'])} | {_ms(r['delayed'])} | {r['gap']:+.4f} |"
        )
    return "\n".join(lines)


def _ms(x: dict[str, float]) -> str:
    return f"{x['mean']:.4f} ± {x['std']:.4f} (n={x['n']})"


# ----- error-feedback --------------------------------------------------------------------------
def analyze_ef(
    outcomes: dict[str, RunOutcome], out: Path, optimizers: tuple[str, ...], lrs: dict[str, float]
) -> dict[str, Any]:
    base = analyze_delay(outcomes, out, optimizers, lrs)
    rows = {}
    for opt in optimizers:
        sync = base["optimizers"][opt]["sync"]["mean"]
        gap = base["optimizers"][opt]["gap"]
        row: dict[str, Any] = {"gap_none": gap}
        for corr in ("ef", "sync-warmup"):
            vals = [final_val(o) for o in select(outcomes, optimizer=opt, correction=corr, lam=1.0)]
            corr_gap = statistics.fmean(vals) - sync
            row[corr] = {
                "val": mean_std(vals),
                "gap": corr_gap,
                "recovered": (gap - corr_gap) / gap if gap > 0 else None,
            }
        lam_rows = {}
        for o in select(outcomes, optimizer=opt, correction="ef", seed=0):
            lam_rows[str(o.spec.labels["lam"])] = final_val(o) - sync
        row["lam_sweep_gap"] = dict(sorted(lam_rows.items(), key=lambda kv: float(kv[0])))
        row["lower_lr"] = _lower_lr_study(outcomes, opt)
        rows[opt] = row
    series = []
    for opt in optimizers:
        series.append(
            (
                f"{opt} 2bw",
                COLOURS[opt],
                "--",
                select(outcomes, optimizer=opt, schedule="2bw", correction=None),
            )
        )
        series.append(
            (
                f"{opt} 2bw+EF",
                COLOURS[opt],
                ":",
                select(outcomes, optimizer=opt, correction="ef", lam=1.0),
            )
        )
        series.append(
            (f"{opt} sync", COLOURS[opt], "-", select(outcomes, optimizer=opt, schedule="1f1b"))
        )
    _curves(out / "ef_curves.png", "sync (solid), 2bw (dashed), 2bw + EF lam=1 (dotted)", series)
    return {"delay": base, "optimizers": rows, "figures": ["loss_curves.png", "ef_curves.png"]}


def _lower_lr_study(outcomes: dict[str, RunOutcome], opt: str) -> dict[str, Any] | None:
    """Gap and EF recovery one lr step below the tuned one (seed 0), if that study ran."""
    runs = {
        o.spec.labels["correction"]: o for o in select(outcomes, optimizer=opt, study="lower-lr")
    }
    if set(runs) != {"sync", "none", "ef"}:
        return None
    sync = final_val(runs["sync"])
    gap, ef_gap = final_val(runs["none"]) - sync, final_val(runs["ef"]) - sync
    return {
        "lr": runs["sync"].spec.overrides["lr"],
        "sync": sync,
        "gap": gap,
        "ef_gap": ef_gap,
        "recovered": (gap - ef_gap) / gap if gap > 0 else None,
    }


def ef_table(summary: dict[str, Any]) -> str:
    lines = [
        "| optimizer | gap 2bw | gap 2bw+EF | recovered | gap 2bw+sync-warmup | recovered |"
        " lam sweep (gap) |",
        "|---|---|---|---|---|---|---|",
    ]
    for opt, r in summary["optimizers"].items():
        lam = ", ".join(f"{k}: {v:+.4f}" for k, v in r["lam_sweep_gap"].items())
        lines.append(
            f"| {opt} | {r['gap_none']:+.4f} | {r['ef']['gap']:+.4f} | "
            f"{_pct(r['ef']['recovered'])} | {r['sync-warmup']['gap']:+.4f} | "
            f"{_pct(r['sync-warmup']['recovered'])} | {lam} |"
        )
    lower = {opt: r["lower_lr"] for opt, r in summary["optimizers"].items() if r.get("lower_lr")}
    if lower:
        lines += [
            "",
            "One lr step below the tuned one (seed 0): does the gap, and EF's share of it, "
            "depend on the step size?",
            "",
            "| optimizer | lr | sync val loss | gap 2bw | gap 2bw+EF | recovered |",
            "|---|---|---|---|---|---|",
        ]
        for opt, r in lower.items():
            lines.append(
                f"| {opt} | {r['lr']:g} | {r['sync']:.4f} | {r['gap']:+.4f} | "
                f"{r['ef_gap']:+.4f} | {_pct(r['recovered'])} |"
            )
    return "\n".join(lines)


def _pct(x: float | None) -> str:
    return "n/a (no gap)" if x is None else f"{x:.0%}"


# ----- depth -----------------------------------------------------------------------------------
def analyze_depth(
    outcomes: dict[str, RunOutcome], out: Path, optimizers: tuple[str, ...], lrs: dict[str, float]
) -> dict[str, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows: dict[str, Any] = {}
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for opt in [o for o in ("adamw", "muon") if o in optimizers]:
        by_p: dict[str, dict[int, float]] = defaultdict(dict)
        for o in select(outcomes, optimizer=opt):
            p, schedule = o.spec.labels["stages"], o.spec.labels["schedule"]
            if schedule == "1f1b":
                continue
            sync = select(outcomes, optimizer=opt, schedule="1f1b", stages=p)[0]
            name = f"{schedule}{'+EF' if o.spec.labels['correction'] == 'ef' else ''}"
            by_p[name][p] = final_val(o) - final_val(sync)
        rows[opt] = {k: dict(sorted(v.items())) for k, v in sorted(by_p.items())}
        for name, gaps in rows[opt].items():
            style = ("-" if "pipedream" in name else "--") + ("o" if "EF" in name else "s")
            ax.plot(
                list(gaps), list(gaps.values()), style, color=COLOURS[opt], label=f"{opt} {name}"
            )
    ax.axhline(0, color="grey", linewidth=0.8)
    ax.set_xlabel("pipeline stages P")
    ax.set_ylabel("val loss gap to sync")
    ax.set_xscale("log", base=2)
    depths = sorted({p for gaps_by in rows.values() for g in gaps_by.values() for p in g})
    ax.set_xticks(depths, [str(p) for p in depths])
    ax.minorticks_off()
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "depth_gap.png", dpi=110)
    plt.close(fig)
    sync_val = {
        opt: {
            o.spec.labels["stages"]: final_val(o)
            for o in sorted(
                select(outcomes, optimizer=opt, schedule="1f1b"),
                key=lambda o: o.spec.labels["stages"],
            )
        }
        for opt in rows
    }
    return {"gaps": rows, "sync_val": sync_val, "figures": ["depth_gap.png"]}


def depth_table(summary: dict[str, Any]) -> str:
    lines = ["| optimizer | schedule | gap to sync by P |", "|---|---|---|"]
    for opt, by_p in summary.get("sync_val", {}).items():
        text = ", ".join(f"P={p}: {v:.4f}" for p, v in by_p.items())
        lines.append(f"| {opt} | sync (1f1b) val loss, the baseline | {text} |")
    for opt, schedules in summary["gaps"].items():
        for name, gaps in schedules.items():
            text = ", ".join(f"P={p}: {g:+.4f}" for p, g in gaps.items())
            lines.append(f"| {opt} | {name} | {text} |")
    return "\n".join(lines)


ANALYSES: dict[str, Callable[..., dict[str, Any]]] = {
    "delay-vs-optimizer": analyze_delay,
    "error-feedback": analyze_ef,
    "depth": analyze_depth,
}
TABLES: dict[str, Callable[[dict[str, Any]], str]] = {
    "delay-vs-optimizer": delay_table,
    "error-feedback": ef_table,
    "depth": depth_table,
}


def write_summary(out: Path, name: str, summary: dict[str, Any], table: str) -> None:
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "table.md").write_text(f"# {name}\n\n{table}\n")
