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
    stats,
    targets,
)
from nobubble.app.experiments.stats import ABOVE, LOSS_MARGIN, MATCHES, SHARE_MARGIN
from nobubble.model import model_config


def _paper_delay() -> str:
    gaps = ", ".join(f"{opt} {targets.delay_gap(opt):+.3f}" for opt in targets.TABLE2)
    return f"arXiv 2606.30634 Table 2 (360M), standard 2BW - sync: {gaps}"


def _paper_ef() -> str:
    parts = []
    for corr, title in (("ef", "EF recovers"), ("sync-warmup", "the synchronous start recovers")):
        shares = []
        for opt in targets.TABLE2:
            share = f"{opt} {targets.recovered(opt, corr):.1%}"
            if corr == "ef" and opt in targets.STATED_EF_RECOVERY:
                share += f" (stated {targets.STATED_EF_RECOVERY[opt]:.0%})"
            shares.append(share)
        parts.append(f"{title} {', '.join(shares)}")
    return "arXiv 2606.30634 Table 2 (360M): " + "; ".join(parts)


def _paper_depth() -> str:
    pd = targets.PIPEDREAM_P4_MUON_EF
    return (
        "arXiv 2606.30634 sec. 6 (135M): original PipeDream at P=4 with Muon + EF "
        f"{pd['pipedream+EF']:.3f} vs sync {pd['sync']:.3f}; at P=16 even the best setting loses "
        f"> {targets.PIPEDREAM_P16_LOSS_AT_LEAST}; 2BW's delay is 1 at any depth"
    )


def _paper_paci() -> str:
    diffs = ", ".join(f"{k} {v:+.3f}" for k, v in targets.paci_minus_flush().items())
    return f"arXiv 2606.07881, P=8, PACI - flush final training loss: {diffs}"


def _paper_gap() -> str:
    return (
        "neither paper varies the learning rate against the delay's gap; both tune it on the "
        "synchronous schedule and reuse it. Paper A's 2bw - sync at its tuned lr: "
        + ", ".join(f"{opt} {targets.delay_gap(opt):+.3f}" for opt in ("adamw", "muon"))
        + "; paper B's paci - flush: within 0.009 (AdamW, a >= P-1). The corrections predict, "
        "delay-lr, and EF on paci are nobubble's (docs/numerics.md); a correction *helps* under "
        "R3 (corrected - plain below 0), *closes the gap* under R1 against sync"
    )


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


def _claim(
    what: str, iv: dict[str, Any], margin: float, paper: float, paper_text: str | None = None
) -> str:
    """One verdict part: the judgement, our interval with its rule, and the paper's class."""
    expected = stats.classify_point(paper, margin)
    return (
        f"{stats.judge(iv, margin, expected)}: {stats.describe(iv, margin, what)}; "
        f"paper {paper_text or f'{paper:+.3f}'}: {expected}"
    )


def verdict_delay(s: dict[str, Any]) -> list[str]:
    """AdamW's gap exceeds Muon's; each optimizer's gap has the class of the paper's."""
    rows = s["optimizers"]
    parts = []
    contrast = s.get("adamw_gap_minus_muon_gap")
    if contrast is not None:
        paper = targets.delay_gap("adamw") - targets.delay_gap("muon")
        parts.append(_claim("AdamW gap - Muon gap", contrast, LOSS_MARGIN, paper))
    for opt, row in rows.items():
        if opt in targets.TABLE2:
            paper = targets.delay_gap(opt)
            parts.append(_claim(f"{opt} 2bw - sync", row["gap"], LOSS_MARGIN, paper))
    return parts or ["inconclusive (no optimizer of Table 2 ran)"]


def verdict_ef(s: dict[str, Any]) -> list[str]:
    """Each correction recovers the share of the delay's gap that Table 2 gives (±SHARE_MARGIN),
    judged only where the gap itself is established (R2)."""
    parts = []
    for opt, row in s["optimizers"].items():
        if opt not in targets.TABLE2:
            continue
        gap_class = stats.classify(row["gap_none"], LOSS_MARGIN)
        for corr, name in (("ef", "EF"), ("sync-warmup", "sync start")):
            if corr not in row:  # this regime did not run it
                continue
            if gap_class != ABOVE:
                parts.append(
                    f"inconclusive: {opt} {name}, no established gap to recover "
                    f"({stats.describe(row['gap_none'], LOSS_MARGIN, '2bw - sync')})"
                )
                continue
            paper = targets.recovered(opt, corr)
            shares = stats.per_seed(row[corr]["recovered"])
            minus_paper = stats.interval({seed: r - paper for seed, r in shares.items()})
            stated = targets.STATED_EF_RECOVERY.get(opt) if corr == "ef" else None
            note = f" (the paper's text: {stated:.0%})" if stated is not None else ""
            parts.append(
                f"{stats.judge(minus_paper, SHARE_MARGIN, MATCHES)}: {opt} {name} recovers "
                f"{stats.fmt_interval(row[corr]['recovered'], pct=True)} of the gap against "
                f"the paper's {paper:.1%} from Table 2{note}; "
                f"{stats.describe(minus_paper, SHARE_MARGIN, 'recovered - paper', pct=True)}"
            )
    return parts or ["inconclusive (no optimizer of Table 2 ran)"]


def verdict_depth(s: dict[str, Any]) -> list[str]:
    """PipeDream's gap grows with P; Muon + EF PipeDream matches sync at P=4. 2BW's gap is the
    same at every P by construction here (one run, no clipping), so it carries no verdict."""
    if not s.get("growth_depths"):
        return ["inconclusive (one depth only)"]
    lo, hi = s["growth_depths"]
    parts = []
    paper_p4 = targets.PIPEDREAM_P4_MUON_EF["pipedream+EF"] - targets.PIPEDREAM_P4_MUON_EF["sync"]
    # What the paper implies, as a number the rule can classify: PipeDream's gap grows from a
    # match at P=4 to a loss of more than 0.03 at P=16.
    grows = targets.PIPEDREAM_P16_LOSS_AT_LEAST - paper_p4
    expected = {
        "pipedream": (grows, f"grows by > {grows:.3f} from P=4 to P=16"),
        "pipedream+EF": (grows, f"grows by > {grows:.3f} from P=4 to P=16"),
    }
    for opt, growth in s["growth"].items():
        for name, (paper, text) in expected.items():
            if name == "pipedream+EF" and opt != "muon":
                continue  # the paper's depth claim with EF is Muon's
            what = f"{opt} {name} gap(P={hi}) - gap(P={lo})"
            parts.append(_claim(what, growth[name], LOSS_MARGIN, paper, text))
    muon_p4 = s["gaps"].get("muon", {}).get("pipedream+EF", {}).get("4")
    if muon_p4 is not None:
        what = "muon pipedream+EF - sync at P=4 (momentum 0.99)"
        parts.append(_claim(what, muon_p4, LOSS_MARGIN, paper_p4))
    parts.append(
        "no verdict: 2bw's gap is one run for every P (delay 1 at any depth; with no clipping "
        "its numbers do not depend on P, tested bitwise), so its constancy is by construction"
    )
    return parts


def verdict_paci(s: dict[str, Any]) -> list[str]:
    """PACI matches flush at every a (paper B's differences all lie inside the margin); the
    ledger's crossed updates stay within the bound and the activation memory equals flush's."""
    paper = max(targets.paci_minus_flush().values(), key=abs)  # the largest: still a match
    parts = []
    for p in s["pairs"]:
        P, a = p["stages"], p["a"]
        bound = [-(-(P - 1 - stage) // a) for stage in range(P)]  # ceil((P-1-s)/a)
        within = all(c <= b for c, b in zip(p["max_crossed"], bound, strict=True))
        same_memory = p["peak_activation_bytes"]["flush"] == p["peak_activation_bytes"]["paci"]
        what = f"{p['optimizer']} a={a}{'' if a >= P - 1 else ' (< P-1)'} paci - flush"
        parts.append(
            _claim(what, p["diff"], LOSS_MARGIN, paper, f"at most {paper:+.3f} in magnitude")
            + f"; crossed updates {p['max_crossed']} {'within' if within else 'OVER'} the bound "
            f"{bound} and activation memory {'equal to' if same_memory else 'unlike'} flush's "
            "(checks, not statistics)"
        )
    return (parts or ["inconclusive (no pair ran)"]) + _verdict_arms(s.get("arms"), paper)


def _verdict_arms(arms: dict[str, Any] | None, paper: float) -> list[str]:
    """Each arm of paci against the flush of its precision; the bf16 arm is paper B's setting."""
    if not arms:
        return []
    parts = []
    for arm, row in arms["arms"].items():
        own = row.get("minus_flush_bf16", row["minus_flush"])
        base = "flush bf16" if "minus_flush_bf16" in row else "flush"
        mark = " (paper B's setting: bf16 autocast)" if arm == arms["paper_b_arm"] else ""
        name = "pipedream" if arm == "pipedream" else f"paci {arm}"
        what = f"arm {arm}{mark}: {name} a={arms['a']} - {base}"
        parts.append(_claim(what, own, LOSS_MARGIN, paper, f"at most {paper:+.3f} in magnitude"))
    return parts


def _rules() -> list[str]:
    return [
        "## Verdict rules (fixed before the numbers)",
        "",
        "Runs are paired by seed (same initial weights, same data order). Each comparison is the "
        "mean of the per-seed differences with a two-sided "
        f"{stats.CONFIDENCE:.0%} Student-t interval (n - 1 degrees of freedom), and needs at "
        f"least {stats.MIN_SEEDS} paired seeds. The margin m is ±{LOSS_MARGIN} for a "
        "validation-loss difference (between what the papers treat as no loss, +0.009 and "
        "+0.012, and what paper A calls a loss, > 0.03) and ±"
        f"{SHARE_MARGIN:.0%} around the paper's share for a recovered share of the delay's gap "
        "(the paper's own Muon figure is 71% stated and 58% from its rounded losses).",
        "",
        *[f"- {rule}" for rule in stats.RULES.values()],
        "",
        "A claim is *reproduced* when our interval's class equals the class the same rule gives "
        "the paper's number (taken as exact), *not reproduced* when it is another of R1-R3, and "
        "*inconclusive* under R4. Recovered shares are judged only where the gap 2bw - sync is "
        "established (R2).",
        "",
        "## The papers' targets",
        "",
        "Paper A (arXiv 2606.30634), Table 2 at 360M: validation loss; recovered = (standard - "
        "corrected) / (standard - sync).",
        "",
        targets.table2_markdown(),
        "",
        f"Paper B: {_paper_paci()}.",
        "",
    ]


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
        _paper_delay,
        verdict_delay,
        analysis.delay_table,
    ),
    (
        "error-feedback",
        "Error feedback and synchronous start (paper A, Table 2)",
        _paper_ef,
        verdict_ef,
        analysis.ef_table,
    ),
    (
        "depth",
        "Delay growing with depth: PipeDream vs 2BW (paper A, sec. 6)",
        _paper_depth,
        verdict_depth,
        depth_analysis.depth_table,
    ),
    ("paci", "PACI vs 1F1B-flush (paper B)", _paper_paci, verdict_paci, paci_analysis.paci_table),
    (
        "delay-long",
        "Longer regime, ~20 tokens per parameter: one-step delay vs optimizer (paper A)",
        _paper_delay,
        verdict_delay,
        analysis.delay_table,
    ),
    (
        "error-feedback-long",
        "Longer regime, ~20 tokens per parameter: error feedback (paper A, Table 2)",
        _paper_ef,
        verdict_ef,
        analysis.ef_table,
    ),
    (
        "paci-long",
        "Longer regime, ~20 tokens per parameter: PACI vs 1F1B-flush (paper B)",
        _paper_paci,
        verdict_paci,
        paci_analysis.paci_table,
    ),
    (
        "corrections-long",
        "Longer regime: the delay's gap by learning rate, and the corrections (issue 34)",
        _paper_gap,
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
        *_rules(),
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
