"""``nobubble experiment report``: docs/results.md from the latest experiment summaries.

For each claim of the two papers: the paper's number, nobubble's at small scale, and a verdict
computed by a stated rule (reproduced in direction / not reproduced / inconclusive within
noise). Figures are copied next to the page; every number names the command that made it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from nobubble.experiments import analysis, paci_analysis

PAPER = {
    "delay": "arXiv 2606.30634 table 1 (135M): AdamW 2.877 -> 3.227 (+0.350), Muon 2.841 -> "
    "2.855 (+0.014), NAdam +0.040, Lion +0.024",
    "ef": "arXiv 2606.30634 (360M): EF recovers 90% of AdamW's gap, 71% of Muon's; sync start "
    "recovers ~20-30%",
    "depth": "arXiv 2606.30634 sec. 6 (135M): original PipeDream at P=4 with Muon + EF matches "
    "sync; at P=16 even the best setting loses > 0.03; 2BW's delay is 1 at any depth",
    "paci": "arXiv 2606.07881: PACI a=16 2.774 vs flush 2.779, a=8 2.781 (batch 256); a=4 < P-1 "
    "lags slightly (2.799 vs 2.790); ideal speed-up (a+P-1)/a",
}


def _load(root: Path, name: str) -> dict[str, Any] | None:
    path = root / name / "summary.json"
    return json.loads(path.read_text()) if path.exists() else None


NOISE_FROM = ("adamw", "muon")  # the optimizers every verdict compares


def _noise(delay: dict[str, Any] | None) -> float:
    """Seed noise: the larger seed std of AdamW's and Muon's synchronous runs (0.01 if unknown).

    Only those two: every verdict compares AdamW or Muon runs, and one noisy optimizer (Lion
    here) must not widen the band of the others.
    """
    if not delay:
        return 0.01
    rows = [delay["optimizers"][o] for o in NOISE_FROM if o in delay["optimizers"]]
    stds = [r["sync"]["std"] for r in rows if r["sync"]["n"] > 1]
    return max(stds) if stds else 0.01


def verdict_delay(s: dict[str, Any], noise: float) -> str:
    rows = s["optimizers"]
    if "adamw" not in rows or "muon" not in rows:
        return "inconclusive (adamw and muon both needed)"
    adam, muon = rows["adamw"]["gap"], rows["muon"]["gap"]
    if adam <= 2 * noise:
        return f"inconclusive within noise (AdamW gap {adam:+.4f}, noise {noise:.4f})"
    ratio = adam / muon if muon > 0 else float("inf")
    if ratio >= 2:
        return f"reproduced in direction (AdamW gap {ratio:.1f}x Muon's)"
    return f"not reproduced (AdamW gap only {ratio:.1f}x Muon's)"


def verdict_ef(s: dict[str, Any]) -> str:
    parts = []
    for opt in ("adamw", "muon"):
        row = s["optimizers"].get(opt)
        if row is None or row["ef"]["recovered"] is None:
            parts.append(f"{opt}: no gap to recover")
            continue
        rec = row["ef"]["recovered"]
        word = "reproduced" if rec >= 0.5 else ("partly" if rec > 0 else "not reproduced")
        warm = row["sync-warmup"]["recovered"]
        parts.append(
            f"{opt}: EF recovers {rec:.0%} ({word}); the synchronous start {_share(warm)} "
            "(paper: ~20-30%)"
        )
    return "; ".join(parts)


def _depths_flag(summary: dict[str, Any]) -> str:
    depths = summary.get("depths")
    default = [2, 4] if summary["profile"] == "quick" else [2, 4, 8]
    return f" --depths {','.join(map(str, depths))}" if depths and depths != default else ""


def _share(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0%}"


def verdict_depth(s: dict[str, Any], noise: float) -> str:
    parts = []
    for opt, schedules in s["gaps"].items():
        pd, tbw = schedules.get("pipedream", {}), schedules.get("2bw", {})
        if len(pd) < 2 or len(tbw) < 2:
            continue
        ps = sorted(pd, key=int)
        lo, hi = ps[0], ps[-1]
        change = pd[hi] - pd[lo]
        flat = abs(tbw[hi] - tbw[lo]) <= 2 * noise
        if change > 2 * noise:
            word = "reproduced in direction" if flat else "partly: 2bw's gap moves too"
        elif change < -2 * noise:
            word = "not reproduced: pipedream's gap shrinks"
        else:
            word = "inconclusive within noise"
        parts.append(
            f"{opt}: pipedream gap P={lo}->{hi}: {pd[lo]:+.4f} -> {pd[hi]:+.4f}, 2bw "
            f"{tbw[lo]:+.4f} -> {tbw[hi]:+.4f}, pipedream - 2bw {pd[lo] - tbw[lo]:+.4f} -> "
            f"{pd[hi] - tbw[hi]:+.4f} ({word})"
        )
    return "; ".join(parts) or "inconclusive (runs missing)"


def verdict_paci(s: dict[str, Any], noise: float) -> str:
    parts = []
    for p in s["pairs"]:
        near = abs(p["diff"]) <= 2 * noise
        big_a = p["a"] >= p["stages"] - 1
        word = "within noise" if near else ("worse" if p["diff"] > 0 else "better")
        speed = p["projected_speedup"] / p["ideal_speedup"]
        P, a = p["stages"], p["a"]
        bound = [-(-(P - 1 - s) // a) for s in range(P)]  # ceil((P-1-s)/a)
        within = all(c <= b for c, b in zip(p["max_crossed"], bound, strict=True))
        same_memory = p["peak_activation_bytes"]["flush"] == p["peak_activation_bytes"]["paci"]
        parts.append(
            f"{p['optimizer']} a={a}{'' if big_a else ' (< P-1)'}: paci {word} "
            f"({p['diff']:+.4f}), projected speed-up {p['projected_speedup']:.2f}x = "
            f"{speed:.0%} of ideal, crossed updates {p['max_crossed']} "
            f"{'within' if within else 'OVER'} the bound {bound}, activation memory "
            f"{'equal to' if same_memory else 'different from'} flush"
        )
    m = s.get("measured")
    if m and m.get("speedup"):
        parts.append(
            f"measured on 2 processes: {m['speedup']:.2f}x to target "
            f"(ideal {m['ideal_speedup']:.2f}x)"
        )
    return "; ".join(parts)


def write_report(root: Path, target: Path = Path("docs/results.md")) -> dict[str, Any]:
    img = target.parent / "img" / "results"
    img.mkdir(parents=True, exist_ok=True)
    delay, ef = _load(root, "delay-vs-optimizer"), _load(root, "error-feedback")
    depth, paci = _load(root, "depth"), _load(root, "paci")
    noise = _noise(delay or (ef or {}).get("delay"))
    lines = [
        "# Results: the two papers' claims at small scale",
        "",
        "Generated by `nobubble experiment report` from the runs under "
        f"`{root}`; regenerate every number with the commands in each section (defaults, this "
        "2-core CPU machine). Seed noise used by the verdicts: "
        f"{noise:.4f} (the larger seed std of AdamW's and Muon's synchronous runs; every "
        "table gives each optimizer's own spread); a difference below twice that is 'within "
        "noise'.",
        "",
    ]
    sections = [
        (
            "delay-vs-optimizer",
            delay,
            "One-step delay vs optimizer (paper A, table 1)",
            PAPER["delay"],
            lambda s: verdict_delay(s, noise),
            analysis.delay_table,
        ),
        (
            "error-feedback",
            ef,
            "Error feedback and synchronous start (paper A, table 2)",
            PAPER["ef"],
            verdict_ef,
            analysis.ef_table,
        ),
        (
            "depth",
            depth,
            "Delay growing with depth: PipeDream vs 2BW (paper A, sec. 6)",
            PAPER["depth"],
            lambda s: verdict_depth(s, noise),
            analysis.depth_table,
        ),
        (
            "paci",
            paci,
            "PACI vs 1F1B-flush (paper B)",
            PAPER["paci"],
            lambda s: verdict_paci(s, noise),
            paci_analysis.paci_table,
        ),
    ]
    verdicts = {}
    for name, summary, title, paper, verdict, table in sections:
        lines += [f"## {title}", ""]
        if summary is None:
            lines += [f"Not run yet: `nobubble experiment {name}`.", ""]
            continue
        verdicts[name] = verdict(summary)
        lines += [
            f"Command: `nobubble experiment {name} --seeds {summary['seeds']}"
            f"{' --quick' if summary['profile'] == 'quick' else ''}"
            f"{_depths_flag(summary)}` "
            f"({summary['runs']} runs; models and tokens per run: {summary['params']}; "
            f"learning rates from the synchronous sweep: {summary['lrs']}).",
            "",
            f"Paper: {paper}.",
            "",
            f"**Verdict:** {verdicts[name]}.",
            "",
            table(summary),
            "",
        ]
        for fig in summary.get("figures", []):
            dest = img / f"{name}-{fig}"
            shutil.copyfile(root / name / fig, dest)
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
