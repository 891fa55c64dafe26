"""The verdicts of docs/results.md: each claim of the two papers, what it predicts at small scale,
and the rule that decides from an experiment's summary whether the runs reproduce it (``verdict_*``,
``rules``)."""

from __future__ import annotations

from typing import Any

from nobubble.app.experiments import (
    stats,
    targets,
)
from nobubble.app.experiments.stats import ABOVE, LOSS_MARGIN, MATCHES, SHARE_MARGIN


def paper_delay() -> str:
    gaps = ", ".join(f"{opt} {targets.delay_gap(opt):+.3f}" for opt in targets.TABLE2)
    return f"arXiv 2606.30634 Table 2 (360M), standard 2BW - sync: {gaps}"


def paper_ef() -> str:
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


def paper_depth() -> str:
    pd = targets.PIPEDREAM_P4_MUON_EF
    return (
        "arXiv 2606.30634 sec. 6 (135M): original PipeDream at P=4 with Muon + EF "
        f"{pd['pipedream+EF']:.3f} vs sync {pd['sync']:.3f}; at P=16 even the best setting loses "
        f"> {targets.PIPEDREAM_P16_LOSS_AT_LEAST}; 2BW's delay is 1 at any depth"
    )


def paper_paci() -> str:
    diffs = ", ".join(f"{k} {v:+.3f}" for k, v in targets.paci_minus_flush().items())
    return f"arXiv 2606.07881, P=8, PACI - flush final training loss: {diffs}"


def paper_gap() -> str:
    return (
        "neither paper varies the learning rate against the delay's gap; both tune it on the "
        "synchronous schedule and reuse it. Paper A's 2bw - sync at its tuned lr: "
        + ", ".join(f"{opt} {targets.delay_gap(opt):+.3f}" for opt in ("adamw", "muon"))
        + "; paper B's paci - flush: within 0.009 (AdamW, a >= P-1). The corrections predict, "
        "delay-lr, and EF on paci are nobubble's (docs/numerics.md); a correction *helps* under "
        "R3 (corrected - plain below 0), *closes the gap* under R1 against sync"
    )


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


def rules() -> list[str]:
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
        f"Paper B: {paper_paci()}.",
        "",
    ]
