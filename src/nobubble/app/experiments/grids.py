"""The experiment grids: which runs each experiment needs, as plain specs.

Scale (see docs/results.md for the reasoning): the `tiny` model (0.72M parameters at vocab
4096) or `mini` (2.5M, 8 layers) on the default corpus, context 128, micro-batches of 8
sequences. Learning rates come from a sweep on the synchronous schedule per optimizer (the
papers' protocol) and are reused unchanged by every asynchronous run.

Seeds: every comparison that carries a verdict (sync vs 2bw, the corrections, every depth, paci
vs flush) runs each of its configurations with seeds 0..seeds-1, and the report pairs them by
seed; the full profile asks for stats.MIN_SEEDS, the fewest that carry a verdict. Side studies
(the lam sweep, the lower learning rates, the measured wall-clock pair) run seed 0 only and
carry none.
"""

from __future__ import annotations

from typing import Any

from nobubble.app.experiments.grids_gap import GAP_CORRECTIONS, corrections, lr_gap
from nobubble.app.experiments.grids_paci import paci, paci_arms
from nobubble.app.experiments.profiles import (
    COMMON,
    FULL,
    LONG,
    LONG_SECONDS_PER_STEP,
    PROFILES,
    QUICK,
    QUICK_LONG,
    Profile,
    on_grid_edge,
    profile_for,
    step_seconds,
    sweep_key,
)
from nobubble.app.experiments.runner import RunSpec


def lr_sweep(profile: Profile) -> list[RunSpec]:
    """Synchronous runs (P=1: plain training) over each optimizer's lr grid, seed 0."""
    return [
        RunSpec(
            sweep_key(opt, lr),
            {"optimizer": opt, "lr": lr, "schedule": "1f1b", "stages": 1, "seed": 0},
            {"optimizer": opt, "lr": lr},
        )
        for opt in profile.optimizers
        for lr in profile.lr_grid[opt]
    ]


def delay_vs_optimizer(profile: Profile, lrs: dict[str, float], seeds: int) -> list[RunSpec]:
    """Paper A, table 1 in miniature: sync vs 2bw (one-step delay) per optimizer.

    P=1: sync and 2bw give the same numbers for every P (tested bitwise), and at P=1 the
    gradient clipping is the same global clipping for both, so only the delay differs.
    """
    specs = []
    for opt in profile.optimizers:
        for schedule in ("1f1b", "2bw"):
            for seed in range(seeds):
                # The synchronous seed-0 run is the winning run of the lr sweep: same
                # settings, so it is reused rather than trained twice.
                reuse = schedule == "1f1b" and seed == 0
                specs.append(
                    RunSpec(
                        sweep_key(opt, lrs[opt]) if reuse else f"{schedule}-{opt}-s{seed}",
                        {
                            "optimizer": opt,
                            "lr": lrs[opt],
                            "schedule": schedule,
                            "stages": 1,
                            "seed": seed,
                        },
                        {"optimizer": opt, "schedule": schedule, "seed": seed},
                    )
                )
    return specs


def error_feedback(profile: Profile, lrs: dict[str, float], seeds: int) -> list[RunSpec]:
    """Paper A, table 2: 2bw + EF (lam 1) and 2bw + sync warm-up; a lam sweep (adamw, muon)."""
    specs = delay_vs_optimizer(profile, lrs, seeds)
    for opt in profile.optimizers:
        for correction in profile.corrections:
            for seed in range(seeds):
                specs.append(
                    RunSpec(
                        f"2bw-{correction}-{opt}-s{seed}",
                        {
                            "optimizer": opt,
                            "lr": lrs[opt],
                            "schedule": "2bw",
                            "stages": 1,
                            "seed": seed,
                            "correction": correction,
                        },
                        {
                            "optimizer": opt,
                            "schedule": "2bw",
                            "correction": correction,
                            "seed": seed,
                            "lam": 1.0,
                        },
                    )
                )
    for opt in [o for o in ("adamw", "muon") if o in profile.optimizers]:
        for lam in profile.lambdas:
            specs.append(
                RunSpec(
                    f"2bw-ef-lam{lam:g}-{opt}-s0",
                    {
                        "optimizer": opt,
                        "lr": lrs[opt],
                        "schedule": "2bw",
                        "stages": 1,
                        "seed": 0,
                        "correction": "ef",
                        "ef_lambda": lam,
                    },
                    {
                        "optimizer": opt,
                        "schedule": "2bw",
                        "correction": "ef",
                        "seed": 0,
                        "lam": lam,
                    },
                )
            )
    return specs + (lower_lr_study(profile, lrs) if profile.side_studies else [])


def lower_lr_study(profile: Profile, lrs: dict[str, float]) -> list[RunSpec]:
    """AdamW and Muon one grid step below their tuned lr: sync (the sweep's run), 2bw, 2bw+EF.

    A side study of the error-feedback experiment: the delay's harm and EF's first-order
    correction both depend on how far one update moves the weights.
    """
    specs = []
    for opt in [o for o in ("adamw", "muon") if o in profile.optimizers]:
        lower = [lr for lr in profile.lr_grid[opt] if lr < lrs[opt]]
        if not lower:
            continue
        lr = max(lower)
        labels = {"optimizer": opt, "seed": 0, "study": "lower-lr"}
        specs.append(
            RunSpec(
                sweep_key(opt, lr),
                {"optimizer": opt, "lr": lr, "schedule": "1f1b", "stages": 1, "seed": 0},
                {**labels, "schedule": "1f1b", "correction": "sync"},
            )
        )
        for correction in ("none", "ef"):
            specs.append(
                RunSpec(
                    f"2bw-{correction}-lr{lr:g}-{opt}-s0",
                    {
                        "optimizer": opt,
                        "lr": lr,
                        "schedule": "2bw",
                        "stages": 1,
                        "seed": 0,
                        "correction": correction,
                    },
                    {**labels, "schedule": "2bw", "correction": correction},
                )
            )
    return specs


# Paper A's original-PipeDream runs at P=4 used Muon with momentum 0.99 (sec. 6); the depth
# experiment uses it for every Muon run, the synchronous baseline included.
DEPTH_MUON_MOMENTUM = 0.99


def depth(profile: Profile, lrs: dict[str, float], seeds: int) -> list[RunSpec]:
    """Paper A, section 6: original PipeDream (a=1), with and without EF, at growing P, against
    one synchronous baseline and 2bw.

    No clipping anywhere (clip 0): the synchronous schedule and 2bw then give the same numbers
    at every P (tested bitwise in test_emulator_oracles), so each runs once per seed, at P=1,
    and is the baseline of every depth. PipeDream as paper A ran it: B/P sequences per update
    (B = m*b, the synchronous batch) and P times the updates, so every run sees the same
    tokens; it evaluates every eval_every*P updates on the same validation windows (the same
    tokens between evaluations). Muon's momentum is DEPTH_MUON_MOMENTUM for every Muon run.
    """
    # m does not follow --depths, so a run means the same whichever depths are asked for
    b, m = profile.extra.get("depth_micro_batch", 2), profile.extra.get("depth_microbatches", 8)
    batch = b * m
    steps, every = profile.base["steps"], profile.base["eval_every"]
    windows = profile.base["eval_batches"] * b  # validation sequences of the baseline
    for p in profile.depths:
        if batch % p or windows % (batch // p):
            raise ValueError(
                f"depth {p} does not divide the update batch of {batch} sequences (and the "
                f"{windows} validation sequences into whole batches of {batch // max(1, p)}): "
                "use depths that divide it, e.g. --depths 2,4,8"
            )
    model = profile.extra.get("depth_model", profile.base["model"])
    specs = []
    for opt in [o for o in ("adamw", "muon") if o in profile.optimizers]:
        common: dict[str, Any] = {"optimizer": opt, "lr": lrs[opt], "model": model, "clip": 0.0}
        if opt == "muon":
            common["momentum"] = DEPTH_MUON_MOMENTUM
        for seed in range(seeds):
            # the baselines, once for every P: sync and 2bw (delay 1 at any depth)
            for schedule in ("1f1b", "2bw"):
                labels = {"optimizer": opt, "schedule": schedule, "seed": seed}
                if schedule == "2bw":
                    labels["correction"] = "none"
                specs.append(
                    RunSpec(
                        f"depth-{schedule}-{opt}-s{seed}",
                        {
                            **common,
                            "schedule": schedule,
                            "stages": 1,
                            "micro_batch_size": b,
                            "microbatches": m,
                            "seed": seed,
                        },
                        labels,
                    )
                )
            for p in profile.depths:
                for corr in ("none", "ef"):
                    specs.append(
                        RunSpec(
                            f"depth-pipedream-{corr}-{opt}-P{p}-s{seed}",
                            {
                                **common,
                                "schedule": "pipedream",
                                "stages": p,
                                "micro_batch_size": batch // p,
                                "microbatches": 1,
                                "accum": 1,
                                "steps": steps * p,
                                "eval_every": every * p,
                                "eval_batches": windows // (batch // p),
                                "correction": corr,
                                "seed": seed,
                            },
                            {
                                "optimizer": opt,
                                "schedule": "pipedream",
                                "stages": p,
                                "correction": corr,
                                "seed": seed,
                            },
                        )
                    )
    return specs


def grid_seconds(
    profile: Profile, table: dict[tuple[Any, ...], float], seeds: int | None = None
) -> dict[str, float]:
    """Training seconds of every run of ``profile``'s experiments, one at a time, by experiment
    (the lr sweep counted once, runs that two experiments share counted once)."""
    seeds = profile.seeds if seeds is None else seeds
    lrs = {opt: profile.lr_grid[opt][0] for opt in profile.optimizers}
    makers = {"error-feedback": error_feedback, "paci": paci, "depth": depth}
    makers.update({"delay-vs-optimizer": delay_vs_optimizer, "lr-gap": lr_gap})
    makers["corrections"] = corrections
    seen: set[str] = set()
    out: dict[str, float] = {}
    for name, specs in [("lr sweep", lr_sweep(profile))] + [
        (e, makers[e](profile, lrs, seeds)) for e in profile.experiments
    ]:
        total = 0.0
        for spec in specs:
            if spec.name in seen:
                continue
            seen.add(spec.name)
            steps = spec.overrides.get("steps", profile.base["steps"])
            total += steps * step_seconds(spec.overrides, table)
        out[name] = total
    return out


# the profiles (profiles.py) and issue 34's grids (grids_gap.py), named here with every grid
__all__ = [
    "COMMON",
    "DEPTH_MUON_MOMENTUM",
    "FULL",
    "GAP_CORRECTIONS",
    "LONG",
    "LONG_SECONDS_PER_STEP",
    "PROFILES",
    "QUICK",
    "QUICK_LONG",
    "Profile",
    "corrections",
    "delay_vs_optimizer",
    "depth",
    "error_feedback",
    "grid_seconds",
    "lr_gap",
    "lr_sweep",
    "on_grid_edge",
    "paci",
    "paci_arms",
    "profile_for",
    "step_seconds",
]
