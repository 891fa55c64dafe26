"""The grids of issue 34's experiments: ``lr-gap`` (paci and 2bw at fractions of each optimizer's
best synchronous lr, against their flush baselines) and ``corrections`` (2bw's delay corrections at
the same points)."""

from __future__ import annotations

from typing import Any

from nobubble.app.experiments.profiles import Profile, sweep_key
from nobubble.app.experiments.runner import RunSpec

# ----- issue 34: the gaps as a function of the learning rate, and the corrections -------------
LR_FACTORS = (0.25, 0.5, 1.0)  # of each optimizer's best synchronous lr


GAP_CORRECTIONS = ("ef", "predict", "delay-lr")


PACI_A = 4  # paci and its flush baseline at P = a = M = 4, no clipping (paper B)


def _gap_lrs(profile: Profile, lrs: dict[str, float], opt: str) -> list[tuple[float, float]]:
    """(factor, lr) of the lr-gap grid: x0.25, x0.5, x1 of the best synchronous lr."""
    return [(f, lrs[opt] * f) for f in LR_FACTORS]


def _sync_spec(profile: Profile, opt: str, lr: float, factor: float, seed: int) -> RunSpec:
    labels = {"optimizer": opt, "schedule": "1f1b", "seed": seed, "lr_factor": factor}
    overrides = {"optimizer": opt, "lr": lr, "schedule": "1f1b", "stages": 1, "seed": seed}
    # seed 0 on the sweep's grid is the sweep's own run (same settings: reused, not retrained)
    if seed == 0 and lr in profile.lr_grid[opt]:
        return RunSpec(sweep_key(opt, lr), overrides, labels)
    name = f"1f1b-{opt}-s{seed}" if factor == 1.0 else f"1f1b-{opt}-lr{lr:g}-s{seed}"
    return RunSpec(name, overrides, labels)


def _async_spec(
    opt: str, lr: float, factor: float, seed: int, schedule: str, correction: str
) -> RunSpec:
    """2bw at P=1 (its numbers are those of every P, tested) with the regime's clipping, or
    paci and its flush baseline at P = a = 4 without clipping, as the existing grids run them
    (the same names at x1, so those runs are shared)."""
    labels = {"optimizer": opt, "seed": seed, "lr_factor": factor, "correction": correction}
    tail = "" if factor == 1.0 else f"-lr{lr:g}"
    if schedule == "2bw":
        overrides: dict[str, Any] = {"stages": 1}
        fix = "" if correction == "none" else f"-{correction}"
        name = f"2bw{fix}-{opt}{tail}-s{seed}"
    else:
        overrides = {"stages": 4, "clip": 0.0, "microbatches": PACI_A}
        kind = {"1f1b": "flush", "paci": "paci"}[schedule]
        fix = "" if correction == "none" else f"-{correction}"
        name = f"paci-{kind}{fix}-{opt}-a{PACI_A}{tail}-s{seed}"
    overrides |= {"optimizer": opt, "lr": lr, "schedule": schedule, "seed": seed}
    if correction != "none":
        overrides["correction"] = correction
    return RunSpec(name, overrides, {**labels, "schedule": schedule})


def lr_gap(profile: Profile, lrs: dict[str, float], seeds: int) -> list[RunSpec]:
    """Issue 34 item 3: sync vs 2bw and flush vs paci at x0.25, x0.5 and x1 of each optimizer's
    best synchronous lr, AdamW and Muon, ``seeds`` seeds each."""
    specs = []
    for opt in [o for o in ("adamw", "muon") if o in profile.optimizers]:
        for factor, lr in _gap_lrs(profile, lrs, opt):
            for seed in range(seeds):
                specs.append(_sync_spec(profile, opt, lr, factor, seed))
                specs.append(_async_spec(opt, lr, factor, seed, "2bw", "none"))
                specs.append(_async_spec(opt, lr, factor, seed, "1f1b", "none"))
                specs.append(_async_spec(opt, lr, factor, seed, "paci", "none"))
    return specs


def corrections(profile: Profile, lrs: dict[str, float], seeds: int) -> list[RunSpec]:
    """Issue 34 items 2-3: every correction (ef, predict, delay-lr) on 2bw and paci at each lr
    of the lr-gap grid, with the lr-gap grid itself (the runs they are compared against)."""
    specs = lr_gap(profile, lrs, seeds)
    # the best synchronous lr first, then down: a grid stopped early has the runs that matter
    for factor in sorted(LR_FACTORS, reverse=True):
        for opt in [o for o in ("adamw", "muon") if o in profile.optimizers]:
            lr = lrs[opt] * factor
            for seed in range(seeds):
                for schedule in ("2bw", "paci"):
                    for correction in GAP_CORRECTIONS:
                        specs.append(_async_spec(opt, lr, factor, seed, schedule, correction))
    return specs
