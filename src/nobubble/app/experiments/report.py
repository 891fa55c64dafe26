"""``nobubble experiment report``: docs/results.md from the latest experiment summaries.

The page states the verdict rules (stats.py) and the papers' targets (targets.py) before any
number. Then, for each claim: the command that made the runs, the paper's numbers, verdicts and
the tables. Every verdict names its interval, its number of seeds and its rule. A claim is
*reproduced* when our interval falls in the class that the same rule gives the paper's own
number (taken as exact), *not reproduced* when it falls in another of R1-R3, and *inconclusive*
otherwise. Figures are copied next to the page.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nobubble.app.experiments import (
    analysis,
    depth_analysis,
    gap_analysis,
    grids,
    paci_analysis,
)
from nobubble.app.experiments.verdicts import (
    paper_delay,
    paper_depth,
    paper_ef,
    paper_gap,
    paper_paci,
    rules,
    verdict_delay,
    verdict_depth,
    verdict_ef,
    verdict_paci,
)
from nobubble.model import model_config

# Sections read from another experiment's summary: the longer regime has no delay-vs-optimizer
# experiment of its own, its error-feedback runs hold the same sync and 2bw seed pairs
DERIVED = {"delay-long": ("error-feedback-long", "delay")}
# what a derived section keeps of its parent summary besides the part it reads
RUN_FIELDS = ("format", "seeds", "profile", "runs", "params", "lrs", "folder")


def _load(root: Path, name: str) -> dict[str, Any] | None:
    folder, part = DERIVED.get(name, (name, None))
    path = root / folder / "summary.json"
    if not path.exists():
        return None
    summary = json.loads(path.read_text())
    if part is None or part not in summary:
        return summary
    return {**summary[part], **{k: summary[k] for k in RUN_FIELDS if k in summary}}


def _folder(name: str) -> str:
    return DERIVED.get(name, (name, None))[0]


def _regime(profile: grids.Profile) -> str:
    b = profile.base
    tokens = b["steps"] * b["microbatches"] * b["micro_batch_size"] * b["seq_len"]
    params = model_config(b["model"], b["vocab_size"], b["seq_len"]).num_params()
    return (
        f"`{b['model']}` at vocab {b['vocab_size']} ({params:,} parameters), "
        f"{b['microbatches']} x {b['micro_batch_size']} sequences of {b['seq_len']} tokens per "
        f"step, {b['steps']:,} steps: {tokens / 1e6:.2f}M tokens, {tokens / params:.1f} tokens "
        f"per parameter; optimizers {', '.join(profile.optimizers)}; lr grids {profile.lr_grid}"
    )


def _sweeps(root: Path) -> list[str]:
    """The synchronous lr sweep of each regime that ran: final validation loss per lr, the
    chosen one in bold, and a warning where the best sits on the grid's edge."""
    lines = []
    for folder, regime in (("lr-sweep", "short"), ("lr-sweep-long", "longer")):
        path = root / folder / "lr.json"
        if not path.exists():
            continue
        sweep = json.loads(path.read_text())
        lines += [
            f"Learning-rate sweep of the {regime} regime (synchronous, P=1, seed 0; final "
            "validation loss, the chosen lr in bold):",
            "",
            "| optimizer | val loss by lr | chosen |",
            "|---|---|---|",
        ]
        for opt, by_lr in sweep["val_loss"].items():
            best = sweep["best"][opt]
            cells = ", ".join(
                f"**{lr}: {v:.4f}**" if float(lr) == best else f"{lr}: {v:.4f}"
                for lr, v in sorted(by_lr.items(), key=lambda kv: float(kv[0]))
            )
            grid = [float(lr) for lr in by_lr]
            edge = " (on the grid's edge: extend it)" if grids.on_grid_edge(best, grid) else ""
            lines.append(f"| {opt} | {cells} | {best:g}{edge} |")
        lines.append("")
    return lines


def _method(root: Path) -> list[str]:
    """The two regimes and the longer one's budget, from the grids themselves."""
    cost = grids.grid_seconds(grids.LONG, grids.LONG_SECONDS_PER_STEP)
    total = sum(cost.values())
    per = ", ".join(f"{k} {v / 3600:.1f} h" for k, v in cost.items())
    return [
        "## Method and budget",
        "",
        f"- Short regime (`nobubble experiment NAME`): {_regime(grids.FULL)}. Depth runs "
        f"`{grids.FULL.extra['depth_model']}` with no clipping (one synchronous baseline for "
        "every P), PipeDream at B/P sequences per update for P times the updates, Muon "
        f"momentum {grids.DEPTH_MUON_MOMENTUM}.",
        f"- Longer regime (`--regime long`, issue 12 item 7; error-feedback and paci only): "
        f"{_regime(grids.LONG)}; {grids.LONG.seeds} seeds for every verdict pair, no side "
        "studies; paci at P=4, a=M=4, AdamW, clip 0, with its three arms.",
        "- Learning rates: the best final validation loss of a synchronous (P=1) sweep per "
        "optimizer, reused unchanged by every asynchronous run (the papers' protocol).",
        f"- Budget of the longer regime on this 2-core machine: {total / 3600:.1f} h of training "
        f"one run at a time ({per}), so about {total / 7200:.1f} h with `--jobs 2` if nothing "
        "else runs; plus about 5 s of start-up per run. Seconds per step (`grids.py`: P=1 from "
        "the grid's own 1,270-step runs two at a time on 2026-12-02, the P=4 ones from one timed "
        "40-step run each on a loaded machine, likely high): "
        + ", ".join(
            f"{sched} {opt} {dt} P={p} {sec:.3f}"
            for (sched, opt, dt, p), sec in grids.LONG_SECONDS_PER_STEP.items()
        )
        + ".",
        "",
        *_sweeps(root),
    ]


SECTIONS: list[tuple[str, str, Callable[[], str], Callable[..., list[str]], Callable[..., str]]] = [
    (
        "delay-vs-optimizer",
        "One-step delay vs optimizer (paper A)",
        paper_delay,
        verdict_delay,
        analysis.delay_table,
    ),
    (
        "error-feedback",
        "Error feedback and synchronous start (paper A, Table 2)",
        paper_ef,
        verdict_ef,
        analysis.ef_table,
    ),
    (
        "depth",
        "Delay growing with depth: PipeDream vs 2BW (paper A, sec. 6)",
        paper_depth,
        verdict_depth,
        depth_analysis.depth_table,
    ),
    ("paci", "PACI vs 1F1B-flush (paper B)", paper_paci, verdict_paci, paci_analysis.paci_table),
    (
        "delay-long",
        "Longer regime, ~20 tokens per parameter: one-step delay vs optimizer (paper A)",
        paper_delay,
        verdict_delay,
        analysis.delay_table,
    ),
    (
        "error-feedback-long",
        "Longer regime, ~20 tokens per parameter: error feedback (paper A, Table 2)",
        paper_ef,
        verdict_ef,
        analysis.ef_table,
    ),
    (
        "paci-long",
        "Longer regime, ~20 tokens per parameter: PACI vs 1F1B-flush (paper B)",
        paper_paci,
        verdict_paci,
        paci_analysis.paci_table,
    ),
    (
        "corrections-long",
        "Longer regime: the delay's gap by learning rate, and the corrections (issue 34)",
        paper_gap,
        gap_analysis.verdict_gap,
        gap_analysis.gap_table,
    ),
]
# The command of each section, where it is not `nobubble experiment FOLDER`
COMMANDS = {
    "delay-long": "error-feedback --regime long",
    "error-feedback-long": "error-feedback --regime long",
    "paci-long": "paci --regime long",
    "corrections-long": "corrections --regime long",
}
PROFILE_FLAGS = {"full": "", "quick": " --quick", "long": "", "quick-long": " --quick"}


def _depths_flag(summary: dict[str, Any]) -> str:
    depths = summary.get("depths")
    default = [2, 4] if summary["profile"].startswith("quick") else [2, 4, 8]
    return f" --depths {','.join(map(str, depths))}" if depths and depths != default else ""


def _optimizers_flag(summary: dict[str, Any]) -> str:
    left_out = summary.get("left_out") or []
    return f" --optimizers {','.join(summary['optimizers_run'])}" if left_out else ""


def _left_out(summary: dict[str, Any]) -> list[str]:
    """A verdict line for the optimizers of the grid that this summary's run left out."""
    left_out = summary.get("left_out") or []
    if not left_out:
        return []
    return [
        f"no verdict for {', '.join(left_out)}: left out of this run of the grid "
        f"(`--optimizers {','.join(summary['optimizers_run'])}`)"
    ]


def write_report(root: Path, target: Path = Path("docs/results.md")) -> dict[str, Any]:
    img = target.parent / "img" / "results"
    img.mkdir(parents=True, exist_ok=True)
    lines = [
        "# Results: the two papers' claims at small scale",
        "",
        "Generated by `nobubble experiment report` from the runs under "
        f"`{root}`; regenerate every number with the commands in each section (defaults, this "
        "2-core CPU machine).",
        "",
        *rules(),
        *_method(root),
    ]
    verdicts = {}
    for name, title, paper, verdict, table in SECTIONS:
        summary = _load(root, name)
        command = COMMANDS.get(name, name)
        lines += [f"## {title}", ""]
        if summary is None:
            lines += [f"Not run yet: `nobubble experiment {command}`.", ""]
            continue
        stale_depth = name == "depth" and summary.get("design") != depth_analysis.DESIGN
        if stale_depth and summary.get("format") == analysis.FORMAT:
            verdicts[name] = "inconclusive (stale summary)"
            lines += [
                "Stale: this summary predates the redone depth design (clip 0 with one "
                "synchronous baseline, PipeDream at B/P sequences per update, Muon momentum "
                "0.99); rerun `nobubble experiment depth`. No verdict.",
                "",
            ]
            continue
        if summary.get("format") != analysis.FORMAT:
            verdicts[name] = "inconclusive (stale summary)"
            lines += [
                f"Stale: this summary predates seed-paired statistics; rerun `nobubble "
                f"experiment {command}` (its runs are redone under the new run keys). No verdict.",
                "",
            ]
            continue
        parts = verdict(summary) + _left_out(summary)
        verdicts[name] = "; ".join(parts)
        lines += [
            f"Command: `nobubble experiment {command} --seeds {summary['seeds']}"
            f"{PROFILE_FLAGS.get(summary['profile'], '')}"
            f"{_depths_flag(summary)}{_optimizers_flag(summary)}` "
            f"({summary['runs']} runs; models and tokens per run: {summary['params']}; "
            f"learning rates from the synchronous sweep: {summary['lrs']}).",
            "",
            f"Paper: {paper()}.",
            "",
            "**Verdict:**",
            "",
            *[f"- {part}" for part in parts],
            "",
            table(summary),
            "",
        ]
        for fig in summary.get("figures", []):
            dest = img / f"{name}-{fig}"
            shutil.copyfile(root / _folder(name) / fig, dest)
            lines += [f"![{name} {fig}](img/results/{dest.name})", ""]
    discussion = target.parent / "results-discussion.md"
    if discussion.exists():  # hand-written reading of these runs and the follow-ups tried
        lines += [
            "## Discussion",
            "",
            f"What the verdicts mean, what was tried where a claim did not reproduce, and the "
            f"limits of this scale: [{discussion.name}]({discussion.name}).",
            "",
        ]
    target.write_text("\n".join(lines) + "\n")
    return {"report": str(target), "verdicts": verdicts}
