"""The three arms of PACI (issue 12, item 4): which weights a backward reads.

All three run 1F1B without the flush and step every a backwards (P=4, a=M=4, AdamW, no clip);
they differ only in what a micro-batch that crossed an update sees at backward time:

- ``fp32``: live weights everywhere (nobubble's default paci, the definition of arXiv
  2606.07881 taken literally: saved graph, weights as updated since);
- ``bf16``: autocast, so each Linear's backward reads the bf16 copy of its weight made at
  forward time and only the RMSNorm gains are live. This is what paper B's runs computed (they
  trained under bf16 autocast), so this arm is the one that reproduces paper B's setting; it is
  paired with a bf16 flush baseline so that precision alone is not counted as staleness;
- ``pipedream``: ``pipedream --accum a``, every weight stashed: forward and backward consistent
  at the forward's version (the same steps and the same crossed updates, no inconsistency).

Each arm is compared with the fp32 flush baseline, and the bf16 arm also with the bf16 flush,
paired by seed.
"""

from __future__ import annotations

from typing import Any

from nobubble.app.experiments import stats
from nobubble.app.experiments.analysis import _ms, final_val, mean_std, select
from nobubble.app.experiments.runner import RunOutcome

SEMANTICS = {
    "fp32": "live weights: the backward reads every weight as updated since the forward",
    "bf16": "autocast: Linear backward reads the forward-time bf16 weights, norm gains live",
    "pipedream": "stashed: forward and backward both at the forward's version",
}
PAPER_B_ARM = "bf16"  # paper B trained under bf16 autocast (docs/numerics.md)


def _by_seed(runs: list[RunOutcome]) -> dict[int, float]:
    return {o.spec.labels["seed"]: final_val(o) for o in runs}


def analyze_arms(outcomes: dict[str, RunOutcome], a: int = 4) -> dict[str, Any] | None:
    """Per arm: final validation loss and seed-paired differences with the flush baselines."""
    main = [o for o in select(outcomes, optimizer="adamw", a=a) if "runtime" not in o.spec.labels]
    flush = _by_seed([o for o in main if o.spec.labels["schedule"] == "1f1b"])
    val = {"fp32": _by_seed([o for o in main if o.spec.labels["schedule"] == "paci"])}
    for arm in ("bf16", "flush-bf16", "pipedream"):
        val[arm] = _by_seed(select(outcomes, study="arms", arm=arm, a=a))
    if not flush or not all(val.values()):
        return None
    arms = {}
    for arm, text in SEMANTICS.items():
        row: dict[str, Any] = {
            "semantics": text,
            "val": mean_std(list(val[arm].values())),
            "minus_flush": stats.paired(val[arm], flush),
        }
        if arm == "bf16":
            row["minus_flush_bf16"] = stats.paired(val[arm], val["flush-bf16"])
        arms[arm] = row
    return {
        "a": a,
        "flush": mean_std(list(flush.values())),
        "flush_bf16": mean_std(list(val["flush-bf16"].values())),
        "arms": arms,
        "paper_b_arm": PAPER_B_ARM,
    }


def arms_table(s: dict[str, Any]) -> list[str]:
    """Markdown lines of the arms table (empty when the arms did not run)."""
    if not s:
        return []
    lines = [
        "",
        f"The three arms of paci (AdamW, P=4, a=M={s['a']}): what a backward reads after its "
        f"micro-batch crossed an update. Flush val {_ms(s['flush'])} (fp32), "
        f"{_ms(s['flush_bf16'])} (bf16). Paper B's runs correspond to the "
        f"`{s['paper_b_arm']}` arm: they trained under bf16 autocast, where each Linear's "
        "backward reads the bf16 weight copy made at forward time, so only the norm gains are "
        "live; the fp32 arm is harsher than what paper B ran, the pipedream arm gentler.",
        "",
        "| arm | backward reads | val | arm - flush fp32 | arm - flush bf16 |",
        "|---|---|---|---|---|",
    ]
    for arm, row in s["arms"].items():
        own = row.get("minus_flush_bf16")
        lines.append(
            f"| {arm} | {row['semantics']} | {_ms(row['val'])} | "
            f"{stats.fmt_interval(row['minus_flush'])} | "
            f"{stats.fmt_interval(own) if own else '-'} |"
        )
    return lines
