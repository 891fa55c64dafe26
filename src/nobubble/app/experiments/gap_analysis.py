"""Issue 34: the delay's loss gap as a function of the learning rate, and what each correction
recovers of it (``nobubble experiment lr-gap | corrections --regime long``).

Two gaps per optimizer and lr (x0.25, x0.5, x1 of the best synchronous lr), each the seed-paired
difference of final validation losses with its Student-t interval: 2bw - sync (paper A) and
paci - flush (paper B, P = a = 4, no clipping). A correction is read against its own schedule
at the same lr: corrected - plain (negative: it helps), the share of the gap it recovers, and
corrected - synchronous baseline (what is left).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nobubble.app.experiments import stats
from nobubble.app.experiments.analysis import COLOURS, FORMAT, by_seed, select
from nobubble.app.experiments.grids_gap import GAP_CORRECTIONS, LR_FACTORS
from nobubble.app.experiments.runner import RunOutcome

# (asynchronous schedule, its synchronous baseline, the baseline's label in the grid)
PAIRS = {"2bw": "1f1b", "paci": "1f1b"}
GAP_NAMES = {"2bw": "2bw - sync", "paci": "paci - flush"}


def _baseline(outcomes: dict[str, RunOutcome], opt: str, factor: float, schedule: str) -> list:
    """The synchronous runs a schedule's gap is taken against: sync at P=1 for 2bw, the flush
    baseline at P=4 (no clipping) for paci."""
    runs = select(outcomes, optimizer=opt, lr_factor=factor, schedule="1f1b")
    if schedule == "2bw":
        return [o for o in runs if "correction" not in o.spec.labels]
    return [o for o in runs if o.spec.labels.get("correction") == "none"]


def _runs(outcomes: dict[str, RunOutcome], opt: str, factor: float, schedule: str, corr: str):
    return select(outcomes, optimizer=opt, lr_factor=factor, schedule=schedule, correction=corr)


def analyze_gap(
    outcomes: dict[str, RunOutcome],
    out: Path,
    optimizers: tuple[str, ...],
    lrs: dict[str, float],
    corrections: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Gaps per (optimizer, lr factor) and, with ``corrections``, every correction's effect."""
    summary: dict[str, Any] = {"format": FORMAT, "factors": list(LR_FACTORS), "gaps": {}}
    summary["corrections"] = {}
    for opt in [o for o in ("adamw", "muon") if o in optimizers]:
        gaps: dict[str, Any] = {}
        fixes: dict[str, Any] = {}
        for factor in LR_FACTORS:
            row: dict[str, Any] = {"lr": lrs[opt] * factor}
            for schedule in ("2bw", "paci"):
                base = by_seed(_baseline(outcomes, opt, factor, schedule))
                plain = by_seed(_runs(outcomes, opt, factor, schedule, "none"))
                row[f"{schedule}_baseline"] = stats.interval(base)
                row[schedule] = stats.interval(plain)
                gap = stats.paired(plain, base)
                row[GAP_NAMES[schedule]] = gap
                for corr in corrections:
                    fixed = by_seed(_runs(outcomes, opt, factor, schedule, corr))
                    if not fixed:
                        continue
                    cell = {
                        "loss": stats.interval(fixed),
                        "vs_plain": stats.paired(fixed, plain),
                        "vs_sync": stats.paired(fixed, base),
                        "recovered": stats.interval(_recovered(fixed, plain, base)),
                    }
                    fixes.setdefault(schedule, {}).setdefault(corr, {})[str(factor)] = cell
            gaps[str(factor)] = row
        summary["gaps"][opt] = gaps
        if fixes:
            summary["corrections"][opt] = fixes
    _figure(summary, out / "lr_gap.png")
    summary["figures"] = ["lr_gap.png"]
    return summary


# ----- verdicts (rules R1-R4 of stats.py, stated in docs/results.md before the numbers) ---------
def verdict_gap(s: dict[str, Any]) -> list[str]:
    """Per optimizer: each gap at x1 against the paper's class; whether the gap grows with the
    lr (gap at x1 - gap at x0.25, paired); each correction at x1 and where it helps most."""
    from nobubble.app.experiments import targets

    parts = []
    papers = {"2bw": lambda opt: targets.delay_gap(opt), "paci": lambda opt: 0.009}
    for opt, gaps in s["gaps"].items():
        top, low = gaps[str(1.0)], gaps[str(min(LR_FACTORS))]
        for schedule, name in GAP_NAMES.items():
            iv = top[name]
            paper = papers[schedule](opt) if (schedule, opt) != ("paci", "muon") else None
            text = stats.describe(iv, stats.LOSS_MARGIN, f"{opt} {name} at the best sync lr")
            if paper is not None:
                expected = stats.classify_point(paper, stats.LOSS_MARGIN)
                judged = stats.judge(iv, stats.LOSS_MARGIN, expected)
                text = f"{judged}: {text}; paper {paper:+.3f}: {expected}"
            parts.append(text)
            growth = stats.paired(stats.per_seed(iv), stats.per_seed(low[name]))
            parts.append(
                stats.describe(
                    growth,
                    stats.LOSS_MARGIN,
                    f"{opt} {name}: gap at x1 - gap at x{min(LR_FACTORS):g}",
                )
            )
    for opt, by_schedule in s.get("corrections", {}).items():
        for schedule, by_corr in by_schedule.items():
            for corr, cells in by_corr.items():
                best = min(cells, key=lambda f: cells[f]["vs_plain"]["mean"])
                for factor in dict.fromkeys([str(1.0), best]):
                    cell = cells[factor]
                    where = f"x{float(factor):g}" + (" (helps most)" if factor == best else "")
                    what = f"{opt} {schedule} + {corr} - {schedule} at {where}"
                    line = stats.describe(cell["vs_plain"], stats.LOSS_MARGIN, what)
                    left = stats.describe(cell["vs_sync"], stats.LOSS_MARGIN, "left to sync")
                    parts.append(f"{line}; {left}")
    return parts


def _recovered(
    fixed: dict[int, float], plain: dict[int, float], base: dict[int, float]
) -> dict[int, float]:
    """Per seed: the share of that seed's gap (plain - sync) the correction closes."""
    return {
        s: (plain[s] - fixed[s]) / (plain[s] - base[s])
        for s in sorted(set(fixed) & set(plain) & set(base))
        if plain[s] != base[s]
    }


def _ci(iv: dict[str, Any], digits: int = 3) -> str:
    if iv.get("n", 0) == 0:
        return "-"
    text = f"{iv['mean']:+.{digits}f}"
    if iv.get("lo") is not None:
        text += f" [{iv['lo']:+.{digits}f}, {iv['hi']:+.{digits}f}]"
    return text


def gap_table(summary: dict[str, Any]) -> str:
    """Markdown: the gaps by lr, then each correction's effect by lr."""
    lines = [
        "| optimizer | lr (x best) | sync | 2bw - sync | flush | paci - flush |",
        "|---|---|---|---|---|---|",
    ]
    for opt, gaps in summary["gaps"].items():
        for factor, row in gaps.items():
            lines.append(
                f"| {opt} | {row['lr']:.3g} (x{float(factor):g}) | "
                f"{row['2bw_baseline']['mean']:.3f} | {_ci(row['2bw - sync'])} | "
                f"{row['paci_baseline']['mean']:.3f} | {_ci(row['paci - flush'])} |"
            )
    for opt, by_schedule in summary.get("corrections", {}).items():
        lines += ["", f"**{opt}**: corrected - plain [95%], share of the gap recovered", ""]
        factors = list(summary["gaps"][opt])
        head = " | ".join(f"x{float(f):g}" for f in factors)
        lines += [f"| schedule + correction | {head} |", "|---" * (len(factors) + 1) + "|"]
        for schedule, by_corr in by_schedule.items():
            for corr in GAP_CORRECTIONS:
                if corr not in by_corr:
                    continue
                cells = []
                for f in factors:
                    cell = by_corr[corr].get(f)
                    if cell is None:
                        cells.append("-")
                        continue
                    share = cell["recovered"]
                    pct = "" if share["n"] == 0 else f"; {100 * share['mean']:.0f}%"
                    cells.append(f"{_ci(cell['vs_plain'])}{pct}")
                lines.append(f"| {schedule} + {corr} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _figure(summary: dict[str, Any], path: Path) -> None:
    """Gap against lr, one panel per optimizer: 2bw - sync and paci - flush with their 95%
    intervals, and each correction's corrected - sync (dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    opts = list(summary["gaps"])
    if not opts:
        return
    fig, axes = plt.subplots(1, len(opts), figsize=(5.5 * len(opts), 4), squeeze=False)
    markers = {"ef": "s", "predict": "^", "delay-lr": "v"}
    for ax, opt in zip(axes[0], opts, strict=True):
        gaps = summary["gaps"][opt]
        lrs = [gaps[f]["lr"] for f in gaps]
        for schedule, name in GAP_NAMES.items():
            ivs = [gaps[f][name] for f in gaps]
            _errorbar(ax, lrs, ivs, COLOURS[schedule], "o-", name)
            for corr, cells in (
                summary.get("corrections", {}).get(opt, {}).get(schedule, {}).items()
            ):
                ivs = [cells[f]["vs_sync"] if f in cells else None for f in gaps]
                _errorbar(
                    ax, lrs, ivs, COLOURS[schedule], markers.get(corr, "x") + "--",
                    f"{schedule} + {corr}", alpha=0.6,
                )  # fmt: skip
        ax.axhline(0.0, color="black", linewidth=0.8)
        ax.axhspan(-stats.LOSS_MARGIN, stats.LOSS_MARGIN, color="grey", alpha=0.15)
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        ax.set_ylabel("final validation loss minus synchronous")
        ax.set_title(f"{opt}: the delay's gap by learning rate")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _errorbar(ax: Any, xs: list[float], ivs: list, colour: str, fmt: str, label: str, **kw: Any):
    points = [(x, iv) for x, iv in zip(xs, ivs, strict=True) if iv is not None and iv["n"] > 0]
    if not points:
        return
    x = [p[0] for p in points]
    y = [p[1]["mean"] for p in points]
    err = [
        [p[1]["mean"] - (p[1]["lo"] if p[1]["lo"] is not None else p[1]["mean"]) for p in points],
        [(p[1]["hi"] if p[1]["hi"] is not None else p[1]["mean"]) - p[1]["mean"] for p in points],
    ]
    ax.errorbar(x, y, yerr=err, fmt=fmt, color=colour, label=label, capsize=3, **kw)
