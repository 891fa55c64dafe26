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

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from nobubble.app.experiments.runner import RunSpec
from nobubble.app.experiments.stats import MIN_SEEDS


@dataclass(frozen=True)
class Profile:
    """Sizes of one experiment run; ``quick`` is the CI smoke-test version.

    seeds: seeds per configuration when ``--seeds`` is not given.
    experiments: the experiments this profile defines (``--regime long`` has two).
    corrections: the corrections of 2bw that error-feedback runs (ef, sync-warmup).
    side_studies: the lam sweep, the lower learning rates and the measured wall-clock pair.
    paci_optimizers, paci_arms: who runs paci vs flush, and whether its three arms run.
    """

    name: str
    base: dict[str, Any]
    optimizers: tuple[str, ...]
    lr_grid: dict[str, tuple[float, ...]]
    seeds: int
    depths: tuple[int, ...] = (2, 4, 8)
    accums: tuple[int, ...] = (2, 4, 8)
    lambdas: tuple[float, ...] = (0.5, 2.0)
    extra: dict[str, Any] = field(default_factory=dict)
    experiments: tuple[str, ...] = ("delay-vs-optimizer", "error-feedback", "depth", "paci")
    corrections: tuple[str, ...] = ("ef", "sync-warmup")
    side_studies: bool = True
    paci_optimizers: tuple[str, ...] = ("adamw", "muon")
    paci_arms: bool = True


COMMON = {
    "data": "shakespeare",
    "tokenizer": "bpe",
    "sample_tokens": 0,
    "threads": 1,
    "runtime": "emulate",
    "checkpoint_every": 0,
}

FULL = Profile(
    name="full",
    base={
        **COMMON,
        "model": "tiny",
        "vocab_size": 4096,
        "seq_len": 128,
        "micro_batch_size": 8,
        "microbatches": 4,
        "steps": 250,
        "eval_every": 25,
        "eval_batches": 16,
    },
    optimizers=("adamw", "muon", "nadam", "lion"),
    # A first partial sweep (tiny, 250 steps) put AdamW's and NAdam's best lr at the top of
    # (1e-3, 3e-3, 1e-2): val 5.238 / 4.806 / 4.706 for AdamW, so the grid reaches 3e-2.
    # Lion's best was the top of (3e-4, 1e-3, 3e-3), so its grid reaches 1e-2.
    lr_grid={
        "adamw": (3e-3, 1e-2, 3e-2),
        "muon": (3e-3, 1e-2, 3e-2),
        "nadam": (3e-3, 1e-2, 3e-2),
        "lion": (3e-4, 1e-3, 3e-3, 1e-2),
    },
    seeds=MIN_SEEDS,
    # The measured wall-clock pair runs `mini`: at vocab 4096 its two stages balance to 0.92
    # of each other (`small` only to 0.83: layers are indivisible), so the light stage's idling
    # does not hide the bubble that paci removes; compute still dominates (demo: 1.25x).
    extra={
        "depth_model": "mini",
        "depth_micro_batch": 2,
        "depth_microbatches": 8,  # 2bw needs M >= P-1 at the largest depth, 8
        "dist_model": "mini",
    },
)

QUICK = Profile(
    name="quick",
    base={
        **COMMON,
        "model": "tiny",
        "vocab_size": 512,
        "seq_len": 32,
        "micro_batch_size": 4,
        "microbatches": 4,
        "steps": 8,
        "eval_every": 4,
        "eval_batches": 2,
    },
    optimizers=("adamw", "muon"),
    lr_grid={"adamw": (3e-3,), "muon": (1e-2,), "nadam": (3e-3,), "lion": (1e-3,)},
    seeds=1,  # a smoke test: its verdicts read "inconclusive (1 seed)"
    depths=(2, 4),
    accums=(2, 4),
    extra={"depth_microbatches": 4},
    lambdas=(2.0,),
)


# The longer regime of issue 12, item 7, for the two claims that did not reproduce at 1.4 tokens
# per parameter (EF's recovery; PACI vs flush): `tiny` at vocab 512 (262,720 parameters, 74.8%
# of them Muon's hidden matrices), 32 x 128 tokens per step, 1,270 steps = 5.2M tokens, about
# 20 tokens per parameter as both papers train. Learning rates from a x2 grid on the synchronous
# schedule, 3 seeds for every verdict pair, no side studies. `docs/results.md` (method) gives
# its measured budget on this machine.
LONG = Profile(
    name="long",
    base={
        **COMMON,
        "model": "tiny",
        "vocab_size": 512,
        "seq_len": 128,
        "micro_batch_size": 8,
        "microbatches": 4,
        "steps": 1270,
        "eval_every": 127,
        "eval_batches": 16,
    },
    optimizers=("adamw", "muon", "soap"),  # soap needs the optim extra
    # x2 around item 9's untuned 3e-3 (the papers' 2e-3 to 4e-3 for AdamW); a best value on the
    # grid's edge is logged, and the grid is then extended: Muon's best was 1.2e-2, its top, in
    # the first sweep (2026-12-02), then 2.4e-2, so its grid goes three steps further
    lr_grid={
        "adamw": (1.5e-3, 3e-3, 6e-3, 1.2e-2),
        "muon": (1.5e-3, 3e-3, 6e-3, 1.2e-2, 2.4e-2, 4.8e-2, 9.6e-2),
        "soap": (1.5e-3, 3e-3, 6e-3, 1.2e-2),
    },
    seeds=MIN_SEEDS,
    accums=(4,),  # a = M = P: every micro-batch crosses at most one update (paper B's a >= P-1)
    lambdas=(),
    experiments=("error-feedback", "paci", "lr-gap", "corrections"),
    corrections=("ef",),
    side_studies=False,
    paci_optimizers=("adamw",),  # paper B studied AdamW only
)

# The longer regime's smoke test: its grid shapes at the quick sizes (no optim extra needed).
QUICK_LONG = Profile(
    name="quick-long",
    base=QUICK.base,
    optimizers=("adamw", "muon"),
    # adamw: a x2 pair that ends on the quick grid's value, muon: the quick grid's value, so the
    # smoke test reuses most of the quick runs (same settings, same keys)
    lr_grid={"adamw": (1.5e-3, 3e-3), "muon": (1e-2,)},
    seeds=1,
    accums=(4,),
    lambdas=(),
    experiments=LONG.experiments,
    corrections=LONG.corrections,
    side_studies=False,
    paci_optimizers=LONG.paci_optimizers,
)
PROFILES = {"short": {False: FULL, True: QUICK}, "long": {False: LONG, True: QUICK_LONG}}


def on_grid_edge(best: float, grid: Sequence[float]) -> bool:
    """Whether a sweep's best lr is the smallest or largest of a grid of several (extend it)."""
    return len(grid) > 1 and best in (min(grid), max(grid))


def profile_for(regime: str, quick: bool) -> Profile:
    """The profile of ``--regime REGIME`` (short | long), full or ``--quick``."""
    if regime not in PROFILES:
        raise ValueError(f"--regime {regime!r} is unknown: use one of {', '.join(PROFILES)}")
    return PROFILES[regime][quick]


def _key(**parts: Any) -> str:
    return "-".join(f"{k}{v}" if k not in ("", "name") else str(v) for k, v in parts.items())


def _sweep_key(opt: str, lr: float) -> str:
    return f"sweep-{opt}-lr{lr:g}"


def lr_sweep(profile: Profile) -> list[RunSpec]:
    """Synchronous runs (P=1: plain training) over each optimizer's lr grid, seed 0."""
    return [
        RunSpec(
            _sweep_key(opt, lr),
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
                        _sweep_key(opt, lrs[opt]) if reuse else f"{schedule}-{opt}-s{seed}",
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
                _sweep_key(opt, lr),
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


# The three semantics of a no-flush 1F1B pipeline that steps every a backwards (issue 12, item 4),
# each run beside the flush baseline at P=4, a=M=4, AdamW. The fp32 arm is the main grid's paci
# run; these are the other two, plus the flush baseline in bf16 that the bf16 arm pairs with.
ARMS_A = 4
PACI_ARMS: dict[str, dict[str, Any]] = {
    # autocast saves each Linear's bf16 weight copy made at forward time: the backward's matrix
    # products read the forward's weights, only the norm gains are live (paper B's runs)
    "bf16": {"schedule": "paci", "dtype": "bf16"},
    "flush-bf16": {"schedule": "1f1b", "dtype": "bf16"},
    # every weight stashed: forward and backward both at the forward's version
    "pipedream": {"schedule": "pipedream", "accum": ARMS_A},
}


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


# Seconds per training step of the longer regime's runs on this 2-core machine, keyed by
# (schedule, optimizer, dtype, stages). The P=1 entries are the medians of the grid's own runs
# of 1,270 steps (2026-12-02 16:06-16:50 UTC, `--jobs 2`: two one-thread runs at a time, nothing
# else running; summary.json's elapsed_s / 1270): adamw 1f1b 0.171 (5 runs), 2bw 0.186 (3),
# muon 0.183 (5), soap 0.182 (4). The P=4 entries come from one timed run of 40 steps each
# (steps 10-39, one run at a time, while other engineers' jobs loaded the machine: load average
# 1.4 to 8.0), so they are likely high; the unmeasured flush-bf16 and pipedream arms take their
# measured neighbours' figures (paci bf16, paci fp32).
LONG_SECONDS_PER_STEP = {
    ("1f1b", "adamw", "fp32", 1): 0.171,
    ("2bw", "adamw", "fp32", 1): 0.186,
    ("1f1b", "muon", "fp32", 1): 0.183,
    ("1f1b", "soap", "fp32", 1): 0.182,
    ("1f1b", "adamw", "fp32", 4): 0.325,
    ("paci", "adamw", "fp32", 4): 0.385,
    ("paci", "adamw", "bf16", 4): 0.778,
    ("1f1b", "adamw", "bf16", 4): 0.778,
    ("pipedream", "adamw", "fp32", 4): 0.385,
    # issue 34's lr-gap and corrections grids: Muon at P=4 not yet timed, taken as AdamW's
    ("1f1b", "muon", "fp32", 4): 0.325,
    ("paci", "muon", "fp32", 4): 0.385,
}


def step_seconds(overrides: dict[str, Any], table: dict[tuple[Any, ...], float]) -> float:
    """A run's seconds per step from ``table``: its own entry, else its synchronous P=1 one's
    (2bw and its corrections cost what a synchronous step of the same optimizer costs)."""
    opt, dtype = overrides["optimizer"], overrides.get("dtype", "fp32")
    stages = overrides.get("stages", 1)
    own = (overrides["schedule"], opt, dtype, stages)
    return table.get(own, table[("1f1b", opt, dtype, 1)] if stages == 1 else table[own])


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
        return RunSpec(_sweep_key(opt, lr), overrides, labels)
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
