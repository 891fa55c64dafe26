"""The PACI grids: paci against its flush baseline (1f1b at the same accumulation) over optimizers
and seeds, and paci's three arms (``paci_arms``)."""

from __future__ import annotations

from typing import Any

from nobubble.app.experiments.profiles import (
    Profile,
)
from nobubble.app.experiments.runner import RunSpec

# The three semantics of a no-flush 1F1B pipeline that steps every a backwards (issue 12, item 4),
# each run beside the flush baseline at P=4, a=M=4, AdamW. The fp32 arm is the main grid's paci
# run; these are the other two, plus the flush baseline in bf16 that the bf16 arm pairs with.
ARMS_A = 4


def paci_arms(profile: Profile, lrs: dict[str, float], seeds: int) -> list[RunSpec]:
    """The bf16 and stashed arms of paci and the bf16 flush baseline (AdamW, P=4, a=M=4)."""
    if "adamw" not in profile.optimizers:
        return []
    common = {"optimizer": "adamw", "lr": lrs["adamw"], "stages": 4, "clip": 0.0}
    return [
        RunSpec(
            f"paci-{arm}-adamw-a{ARMS_A}-s{seed}",
            {**common, **settings, "microbatches": ARMS_A, "seed": seed},
            {"optimizer": "adamw", "a": ARMS_A, "seed": seed, "study": "arms", "arm": arm},
        )
        for arm, settings in PACI_ARMS.items()
        for seed in range(seeds)
    ]


def paci(profile: Profile, lrs: dict[str, float], seeds: int) -> list[RunSpec]:
    """Paper B: 1f1b flush vs paci at P=4 for a in {P/2, P, 2P}, no clipping (as the paper);
    paci with Muon; the three arms of paci (fp32 live weights, bf16 autocast, pipedream's
    stash) at a=4; and the wall-clock pair on the real 2-process runtime."""
    specs = []
    for opt in [o for o in profile.paci_optimizers if o in profile.optimizers]:
        accums = profile.accums if opt == "adamw" else (4,)
        for a in accums:
            common = {"optimizer": opt, "lr": lrs[opt], "stages": 4, "clip": 0.0}
            for seed in range(seeds):
                for schedule, name in (("1f1b", "flush"), ("paci", "paci")):
                    specs.append(
                        RunSpec(
                            f"paci-{name}-{opt}-a{a}-s{seed}",
                            {**common, "schedule": schedule, "microbatches": a, "seed": seed},
                            {"optimizer": opt, "schedule": schedule, "a": a, "seed": seed},
                        )
                    )
    if profile.paci_arms:
        specs += paci_arms(profile, lrs, seeds)
    if not profile.side_studies:
        return specs
    # Side study: AdamW's paci-vs-flush difference at smaller steps (a=4), since a forward
    # that crossed an update differs from its backward's weights by one whole update.
    if "adamw" in profile.optimizers:
        tuned = lrs["adamw"]
        for lr in sorted({x for x in profile.lr_grid["adamw"] if x < tuned} | {tuned / 10}):
            for schedule in ("1f1b", "paci"):
                specs.append(
                    RunSpec(
                        f"paci-{'flush' if schedule == '1f1b' else 'paci'}-adamw-a4-lr{lr:g}",
                        {
                            "optimizer": "adamw",
                            "lr": lr,
                            "stages": 4,
                            "clip": 0.0,
                            "schedule": schedule,
                            "microbatches": 4,
                        },
                        {
                            "optimizer": "adamw",
                            "schedule": schedule,
                            "a": 4,
                            "lr": lr,
                            "study": "lower-lr",
                        },
                    )
                )
    for schedule in ("1f1b", "paci"):  # measured wall clock: real processes, nothing beside them
        specs.append(
            RunSpec(
                f"paci-dist-{schedule}",
                {
                    "optimizer": "adamw",
                    "lr": lrs["adamw"],
                    "stages": 2,
                    "clip": 0.0,
                    "schedule": schedule,
                    "microbatches": 4,
                    "runtime": "dist",
                    "threads": 0,
                    "model": profile.extra.get("dist_model", profile.base["model"]),
                },
                {"optimizer": "adamw", "schedule": schedule, "a": 4, "runtime": "dist"},
                exclusive=True,
            )
        )
    return specs


PACI_ARMS: dict[str, dict[str, Any]] = {
    # autocast saves each Linear's bf16 weight copy made at forward time: the backward's matrix
    # products read the forward's weights, only the norm gains are live (paper B's runs)
    "bf16": {"schedule": "paci", "dtype": "bf16"},
    "flush-bf16": {"schedule": "1f1b", "dtype": "bf16"},
    # every weight stashed: forward and backward both at the forward's version
    "pipedream": {"schedule": "pipedream", "accum": ARMS_A},
}
