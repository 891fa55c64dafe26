"""A time-to-target race as text and as a figure: the table per variant (every row says its clock
and, projected, what the projection leaves out and its error bar), the tuning, the projection's
check, and the loss against the training clock (one picture per P)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def _table(header: Sequence[str], lines: Sequence[Sequence[str]]) -> list[str]:
    width = [max(len(str(x)) for x in column) for column in zip(header, *lines, strict=True)]
    return [
        "  ".join(c.ljust(w) for c, w in zip(row, width, strict=True)) for row in [header, *lines]
    ]


def _spread(iv: Mapping[str, Any] | None, sign: str = "") -> str:
    if iv is None or iv["lo"] is None:
        return "-"
    return f"{iv['mean']:{sign}.3f} [{iv['lo']:{sign}.3f}, {iv['hi']:{sign}.3f}]"


def _median(row: Mapping[str, Any], name: str, bar: float | None) -> str:
    """``0.848 ±0.031 (3/3)``: the median over the seeds that reached, its error bar, k/n."""
    k, n = row[f"{name}_reached"]
    median = row[f"{name}_median"]
    if median is None:
        return f"not reached (0/{n})"
    plus = "" if bar is None else f" ±{bar * median:.3f}"
    return f"{median:.3f}{plus} ({k}/{n})"


def _line(label: str, row: Mapping[str, Any], seeds: Sequence[int], best: str) -> list[str]:
    per = [row["seeds"][s] for s in seeds]
    bar = row.get("error_bar")
    time_bar = None if bar is None else bar["time"]

    def seconds(value: float | None) -> str:
        if value is None:
            return "not reached"
        return f"{value:.1f}" + ("" if time_bar is None else f"±{time_bar * value:.1f}")

    return [
        label,
        row["clock"],
        "/".join(sorted({str(r["steps"]) for r in per})),
        f"{row['final_val_mean']:.4f}",
        "-" if label == best else _spread(row["final_vs_best"], "+"),
        f"{row['tokens_per_s_median']:,.0f}" + ("" if time_bar is None else f" ±{time_bar:.0%}"),
        " / ".join(seconds(r["time_to_target_s"]) for r in per),
        _median(row, "vs_best", None if bar is None else bar["vs_best"]),
        _spread(row["vs_best_interval"]),
        _median(row, "vs_1f1b", None if bar is None else bar["vs_1f1b"]),
        " / ".join("-" if r["vs_best"] is None else f"{r['vs_best']:.3f}" for r in per),
        row["leaves_out"] or "-",
    ]


def format_race(result: Mapping[str, Any]) -> str:
    """The race as a table: one row per variant, per-seed values after the medians."""
    seeds, best = result["seeds"], result["baseline"]
    header = ["variant", "clock", "steps", "final val (mean)", f"- {best} [95%]", "tokens/s"]
    header += [f"time to {best}'s final (s)", f"vs {best}: median (k/n)", "mean [95%]"]
    header += ["vs 1f1b: median (k/n)", f"vs {best} per seed", "projection leaves out"]
    lines = [_line(label, row, seeds, best) for label, row in result["variants"].items()]
    text = _table(header, lines)
    own = result["best_synchronous"]["own_final_s"]
    fastest = result["best_synchronous"]["best"]
    text.append(
        f"best synchronous: {fastest} (median time to its own final loss "
        + ", ".join(f"{k} {v:.1f} s" for k, v in own.items())
        + f"); target: each seed's {best} final validation loss"
        + ("" if best == fastest else " (--against)")
        + "; training clock, seeds "
        + ", ".join(map(str, seeds))
    )
    for name, reason in result.get("skipped", {}).items():
        text.append(f"not raced: {name}: {reason}")
    if any(r.get("error_bar") for r in result["variants"].values()):
        text.append("±: the projection's error measured at P=2 (--projection-from)")
    return "\n".join(text)


def format_tuning(tuning: Mapping[str, Mapping[str, Any]]) -> str:
    """Every variant's learning-rate grid, its mean final losses and the choice."""
    lines = []
    for label, t in tuning.items():
        cells = [
            f"{lr:g}: {loss:.4f}" + ("*" if lr == t["chosen"] else "")
            for lr, loss in zip(t["grid"], t["losses"], strict=True)
        ]
        where = "" if t["interior"] else "  (best at an edge: not interior)"
        shared = "" if t["tuned_as"] == label else f" (tuned as {t['tuned_as']})"
        lines.append(f"{label}{shared}, {t['steps']} steps: " + ", ".join(cells) + where)
    seeds = ", ".join(map(str, next(iter(tuning.values()))["seeds"]))
    return "\n".join([f"lr tuning (mean final val loss, seeds {seeds}; * chosen):", *lines])


def format_projection_check(check: Mapping[str, Any]) -> str:
    """The projected clock's error per variant, transfers free and at the measured cost."""
    header = ["variant", "time err (free)", "vs best err", "vs 1f1b err"]
    header += ["time err (+transfers)", "vs best err", "vs 1f1b err"]
    lines = []
    for label, free in check["free"].items():
        paid = check["with_transfers"][label]
        lines.append(
            [label]
            + [f"{free[k]:+.1%}" for k in ("time", "vs_best", "vs_1f1b")]
            + [f"{paid[k]:+.1%}" for k in ("time", "vs_best", "vs_1f1b")]
        )
    text = ["projection check: projected / measured - 1, the same runs (median over seeds)"]
    text += _table(header, lines)
    text.append(
        f"measured send per hop {check['transfer_s'] * 1e3:.3f} ms; largest final-loss "
        f"difference emulated vs measured: {check['loss_difference']:.2e}"
    )
    return "\n".join(text)


def plot_curves(races: Mapping[str, Mapping[str, Any]], title: str, path: Path) -> Path:
    """Validation loss against the training clock, one panel per race (equal steps, equal
    budget), one colour per variant, one line per seed; dashed: the best synchronous
    schedule's mean final loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(races), figsize=(5.5 * len(races), 4), squeeze=False)
    for ax, (name, result) in zip(axes[0], races.items(), strict=True):
        for i, (label, row) in enumerate(result["variants"].items()):
            for j, seed in enumerate(result["seeds"]):
                curve = row["seeds"][seed]["curve"]
                style = "--" if row["clock"] == "projected" else "-"
                ax.plot(
                    *zip(*curve, strict=True),
                    style,
                    color=f"C{i}",
                    alpha=0.8,
                    lw=1.2,
                    label=f"{label} ({row['clock']})" if j == 0 else None,
                )
        best = result["variants"][result["baseline"]]
        ax.axhline(best["final_val_mean"], color="grey", ls=":", lw=1)
        ax.set_xlabel("training clock (s)")
        ax.set_ylabel("validation loss")
        ax.set_title(name, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def format_verdicts(rows: Sequence[Mapping[str, Any]]) -> str:
    """``verdict_rows`` as one table: per race and variant, the time to the best synchronous
    schedule's final loss over that schedule's own time, at equal steps and equal budget."""

    def ratio(row: Mapping[str, Any], title: str) -> str:
        return _median(row, title, row[f"{title}_bar"]) if f"{title}_median" in row else "-"

    against = {r["baseline"] for r in rows} != {r["best_sync"] for r in rows}
    base = "against" if against else "best sync"  # --against: the schedule every ratio is to
    header = ["race", "P", "M", "optimizer", base, "variant", "clock"]
    header += ["final val (equal steps)", f"vs {base}: equal steps", f"vs {base}: equal budget"]
    lines = [
        [
            str(r["race"]),
            str(r["stages"]),
            str(r["microbatches"]),
            str(r["optimizer"]),
            str(r["baseline"]),
            str(r["variant"]),
            str(r["clock"]),
            f"{r['steps_final']:.4f}",
            ratio(r, "steps"),
            ratio(r, "budget"),
        ]
        for r in rows
    ]
    return "\n".join(_table(header, lines))
