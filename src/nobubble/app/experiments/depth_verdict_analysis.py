"""The depth-verdict experiment's summary (grids_depth.py): per asynchronous configuration, its
final validation loss and its gap to synchronous training at the same M, paired by seed.

The time-to-accuracy half of issue 44 item 4 (the equal-budget time to the best synchronous
schedule's final loss, projected) is not computed here: it needs the race's clocks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nobubble.app.experiments.analysis import by_seed, select
from nobubble.app.experiments.runner import RunOutcome
from nobubble.app.experiments.stats import fmt_interval, interval, paired

CONFIG = ("stages", "microbatches", "optimizer", "schedule", "correction")


def analyze_depth_verdict(
    outcomes: dict[str, RunOutcome], out: Path, optimizers: tuple[str, ...]
) -> dict[str, Any]:
    """Rows of (P, M, optimizer, schedule, correction): the final loss and the paired gap."""
    del out  # no figure yet
    configs = sorted(
        {
            tuple(o.spec.labels[k] for k in CONFIG)
            for o in outcomes.values()
            if "stages" in o.spec.labels
        },
        key=lambda c: (c[0], c[1], optimizers.index(c[2]), c[3], c[4]),
    )
    rows = []
    for p, m, opt, schedule, correction in configs:
        runs = select(
            outcomes,
            stages=p,
            microbatches=m,
            optimizer=opt,
            schedule=schedule,
            correction=correction,
        )
        sync = by_seed(select(outcomes, schedule="1f1b", microbatches=m, optimizer=opt))
        losses = by_seed(runs)
        rows.append(
            dict(zip(CONFIG, (p, m, opt, schedule, correction), strict=True))
            | {"loss": interval(losses), "gap": paired(losses, sync) if sync else None}
        )
    return {"rows": rows}


def depth_verdict_table(summary: dict[str, Any]) -> str:
    """One markdown row per configuration: mean final loss and the gap to synchronous training
    (mean [95% interval] (seeds))."""
    lines = [
        "| P | M | optimizer | schedule | correction | final val loss | gap to sync |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in summary["rows"]:
        loss = r["loss"]
        lines.append(
            f"| {r['stages']} | {r['microbatches']} | {r['optimizer']} | {r['schedule']} | "
            f"{r['correction']} | {loss['mean']:.4f} (n={loss['n']}) | {fmt_interval(r['gap'])} |"
        )
    return "\n".join(lines)
