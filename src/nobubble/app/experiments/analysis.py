"""Turn finished runs into the numbers each experiment reports, and their figures.

Shared helpers, and the delay-vs-optimizer and error-feedback analyses; depth and paci have
their own modules. Every comparison pairs runs by seed (stats.py).
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from nobubble.app.experiments import stats, targets
from nobubble.app.experiments.runner import RunOutcome

# Summaries written before seed-paired statistics have no "format"; the report reads only these.
FORMAT = 2

COLOURS = {
    "adamw": "#C44E52",
    "muon": "#4C72B0",
    "nadam": "#55A868",
    "lion": "#8172B3",
    "soap": "#937860",
    "adan": "#DA8BC3",
    "mars": "#8C8C8C",
    "normuon": "#64B5CD",
    "adamuon": "#CCB974",
    "nadam-delay": "#2F8F5B",
    "rotation": "#B8860B",
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


def by_seed(runs: list[RunOutcome]) -> dict[int, float]:
    """Final validation loss of each run of one configuration, by its seed."""
    out: dict[int, float] = {}
    for o in runs:
        seed = o.spec.labels["seed"]
        assert seed not in out, f"two runs of seed {seed} in one configuration: {o.spec.name}"
        out[seed] = final_val(o)
    return out


def select(outcomes: dict[str, RunOutcome] | list[RunOutcome], **labels: Any) -> list[RunOutcome]:
    """Runs whose labels match; runs of a side study (label ``study``) only when asked for."""
    labels.setdefault("study", None)
    runs = outcomes.values() if isinstance(outcomes, dict) else outcomes
    return [o for o in runs if all(o.spec.labels.get(k) == v for k, v in labels.items())]


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
    """Per optimizer: sync and 2bw losses, and the gap 2bw - sync paired by seed."""
    rows: dict[str, dict[str, Any]] = {}
    for opt in optimizers:
        sync = by_seed(select(outcomes, optimizer=opt, schedule="1f1b"))
        delayed = by_seed(select(outcomes, optimizer=opt, schedule="2bw", correction=None))
        rows[opt] = {
            "lr": lrs[opt],
            "sync": mean_std(list(sync.values())),
            "delayed": mean_std(list(delayed.values())),
            "gap": stats.paired(delayed, sync),
        }
    contrast = None
    if "adamw" in rows and "muon" in rows:  # the claim: the delay costs AdamW more than Muon
        gaps = {opt: stats.per_seed(rows[opt]["gap"]) for opt in ("adamw", "muon")}
        contrast = stats.paired(gaps["adamw"], gaps["muon"])
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
    return {
        "format": FORMAT,
        "optimizers": rows,
        "adamw_gap_minus_muon_gap": contrast,
        "figures": ["loss_curves.png"],
    }


def delay_table(summary: dict[str, Any]) -> str:
    lines = [
        "| optimizer | lr | sync val loss | 2bw val loss | gap 2bw - sync, paired by seed "
        f"[{stats.CONFIDENCE:.0%} CI] |",
        "|---|---|---|---|---|",
    ]
    for opt, r in summary["optimizers"].items():
        lines.append(
            f"| {opt} | {r['lr']:g} | {_ms(r['sync'])} | {_ms(r['delayed'])} | "
            f"{stats.fmt_interval(r['gap'])} |"
        )
    return "\n".join(lines)


def _ms(x: dict[str, float]) -> str:
    return f"{x['mean']:.4f} ± {x['std']:.4f} (n={x['n']})"


# ----- error-feedback --------------------------------------------------------------------------
CORRECTIONS = ("ef", "sync-warmup")


def analyze_ef(
    outcomes: dict[str, RunOutcome],
    out: Path,
    optimizers: tuple[str, ...],
    lrs: dict[str, float],
    corrections: tuple[str, ...] = CORRECTIONS,
) -> dict[str, Any]:
    """Per optimizer and correction (ef, sync-warmup: those that ran), paired by seed: the gap
    left to sync, the change against plain 2bw, and the share of the gap recovered."""
    base = analyze_delay(outcomes, out, optimizers, lrs)
    rows = {}
    for opt in optimizers:
        sync = by_seed(select(outcomes, optimizer=opt, schedule="1f1b"))
        delayed = by_seed(select(outcomes, optimizer=opt, schedule="2bw", correction=None))
        row: dict[str, Any] = {"gap_none": base["optimizers"][opt]["gap"]}
        for corr in corrections:
            corrected = by_seed(select(outcomes, optimizer=opt, correction=corr, lam=1.0))
            row[corr] = {
                "val": mean_std(list(corrected.values())),
                "gap": stats.paired(corrected, sync),
                "change": stats.paired(corrected, delayed),
                "recovered": stats.interval(recovered_per_seed(sync, delayed, corrected)),
            }
        lam_rows = {}
        for o in select(outcomes, optimizer=opt, correction="ef", seed=0):
            if 0 in sync:  # the lam sweep runs seed 0: its gap is to sync's seed 0
                lam_rows[str(o.spec.labels["lam"])] = final_val(o) - sync[0]
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
    return {
        "format": FORMAT,
        "delay": base,
        "optimizers": rows,
        "figures": ["loss_curves.png", "ef_curves.png"],
    }


def recovered_per_seed(
    sync: dict[int, float], delayed: dict[int, float], corrected: dict[int, float]
) -> dict[int, float]:
    """(2bw - corrected) / (2bw - sync) for each seed all three ran (and 2bw != sync)."""
    seeds = sorted(set(sync) & set(delayed) & set(corrected))
    return {
        s: (delayed[s] - corrected[s]) / (delayed[s] - sync[s])
        for s in seeds
        if delayed[s] != sync[s]
    }


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
        f"Paired by seed, mean [{stats.CONFIDENCE:.0%} CI] (n seeds). Recovered: "
        "(2bw - corrected) / (2bw - sync) per seed; paper: from Table 2's losses.",
        "",
        "| optimizer | gap 2bw | gap 2bw+EF | EF recovers | paper | gap 2bw+sync start "
        "| sync start recovers | paper | lam sweep, seed 0 (gap) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for opt, r in summary["optimizers"].items():
        # one lam (the main runs' 1.0) is no sweep: the longer regime runs none
        sweep = r["lam_sweep_gap"] if len(r["lam_sweep_gap"]) > 1 else {}
        lam = ", ".join(f"{k}: {v:+.4f}" for k, v in sweep.items()) or "not run"
        cells = [stats.fmt_interval(r["gap_none"])]
        for corr in CORRECTIONS:
            if corr not in r:  # not run in this regime
                cells += ["not run"] * 3
                continue
            paper = f"{targets.recovered(opt, corr):.1%}" if opt in targets.TABLE2 else "n/a"
            cells += [
                stats.fmt_interval(r[corr]["gap"]),
                stats.fmt_interval(r[corr]["recovered"], pct=True),
                paper,
            ]
        lines.append(f"| {opt} | {' | '.join(cells)} | {lam} |")
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


def write_summary(out: Path, name: str, summary: dict[str, Any], table: str) -> None:
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "table.md").write_text(f"# {name}\n\n{table}\n")
