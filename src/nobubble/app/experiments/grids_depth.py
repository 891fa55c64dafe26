"""The grid of issue 44's depth study, ``depth-verdict``: does an asynchronous schedule, with the
corrections made for depth, keep up with synchronous training at P = 2, 4, 8 and 16?

Model and budget: ``tiny-deep16`` (tiny's blocks, 16 of them: one block per stage at P = 16) at
vocab 512, context 128, 200 steps of B = 32 sequences (4,096 tokens) each, no clipping (clip 0:
synchronous schedules then give the same numbers at every P, tested bitwise, and each
asynchronous stage clips nothing its neighbours would not). Every run, whatever its P and M,
trains on the same B sequences per step (micro-batches of B / M), is evaluated on the same 32
validation sequences every 20 steps, and takes its optimizer's learning rate from the
synchronous sweep of ``DEPTH`` (P = 1, M = 8, five values x2 apart, seed 0; an edge best is
logged, as for every sweep).

The space (issue 44 item 4): P in {2, 4, 8, 16}, M in {P, 2P}; optimizers muon, adamw, rotation
(Adam in the gradients' eigenbasis) and nadam-delay (the delay-aware look-ahead, at its
authors' published betas (0.99, 0.999)); schedules paci (a = M), 2bw, pipedream (a = M: the
same tokens per update as every other run, so its delay is at most one update, as paci's, with
stashed instead of live weights); corrections none, ef, predict; seeds 0, 1, 2; and the
synchronous baseline. Whole, that is 8 x 4 x 3 x 3 x 3 = 864 asynchronous runs.

Pruning rule (what runs):
- The verdict, P = 8 and M = 8, runs complete: every optimizer, schedule and correction, three
  seeds (108 runs).
- Elsewhere only paci runs. 2bw's delay is one update at every depth and, without clipping, its
  numbers are the same at every P (tested), so another P tells nothing new (nadam-delay's beta1
  aside, which reads 1/P). pipedream at a = M >= P - 1 has paci's delay bound; it differs from
  paci only in stashing, which the verdict cell measures: widen it there first if that matters.
- Elsewhere the corrections ef and predict run for muon and rotation only, the two optimizers
  the issue's verdict is asked for (Muon and a rotated Adam); adamw (whose staleness the
  rotation paper says grows with depth) and nadam-delay (itself a correction) run uncorrected.
  That is 7 cells x 8 runs x 3 seeds = 168 runs.
- The synchronous baseline runs once per M, optimizer and seed at P = 1 (equal to 1f1b, zbv,
  ... at any P: tested bitwise), 5 x 4 x 3 = 60 runs; its M = 8 seed-0 runs are the sweep's.
``depth_verdict_seconds`` prices every run from measured step times; ``nobubble experiment
depth-verdict --regime depth --dry-run`` prints the count and the estimate without training.
"""

from __future__ import annotations

from typing import Any

from nobubble.app.experiments.profiles import DEPTH, QUICK_DEPTH, Profile, sweep_key
from nobubble.app.experiments.runner import RunSpec

VERDICT = (8, 8)  # (P, M) of the cell run complete
BATCH = DEPTH.base["micro_batch_size"] * DEPTH.base["microbatches"]  # sequences per step: 32
WINDOWS = DEPTH.base["micro_batch_size"] * DEPTH.base["eval_batches"]  # validation sequences
SCHEDULES = ("paci", "2bw", "pipedream")
CORRECTIONS = ("none", "ef", "predict")
CORRECTED_ELSEWHERE = ("muon", "rotation")  # the optimizers corrected outside the verdict cell


def _cells(profile: Profile) -> list[tuple[int, int]]:
    return [(p, m) for p in profile.depths for m in (p, 2 * p)]


def _microbatches(m: int) -> dict[str, Any]:
    """The settings that give every run B sequences per step in M micro-batches."""
    if BATCH % m:
        raise ValueError(f"M={m} does not divide the step's {BATCH} sequences: use P <= 16")
    b = BATCH // m
    return {"micro_batch_size": b, "microbatches": m, "eval_batches": WINDOWS // b}


def _sync(profile: Profile, opt: str, lr: float, m: int, seed: int) -> RunSpec:
    overrides = {"optimizer": opt, "lr": lr, "schedule": "1f1b", "stages": 1, "seed": seed}
    labels = {"optimizer": opt, "schedule": "1f1b", "microbatches": m, "seed": seed}
    if m == profile.base["microbatches"] and seed == 0 and lr in profile.lr_grid[opt]:
        return RunSpec(sweep_key(opt, lr), overrides, labels)  # the sweep's own run
    return RunSpec(f"dv-sync-{opt}-M{m}-s{seed}", overrides | _microbatches(m), labels)


def _async(opt: str, lr: float, cell: tuple[int, int], run: tuple[str, str, int]) -> RunSpec:
    (p, m), (schedule, correction, seed) = cell, run
    overrides: dict[str, Any] = {"optimizer": opt, "lr": lr, "schedule": schedule, "stages": p}
    overrides |= _microbatches(m) | {"seed": seed}
    if schedule in ("paci", "pipedream"):
        overrides["accum"] = m  # a = M: one update per step of B sequences
    if correction != "none":
        overrides["correction"] = correction
    labels = {"optimizer": opt, "schedule": schedule, "stages": p, "microbatches": m}
    labels |= {"correction": correction, "seed": seed}
    name = f"dv-{schedule}-{correction}-{opt}-P{p}-M{m}-s{seed}"
    return RunSpec(name, overrides, labels)


def _pruned(cell: tuple[int, int], opt: str) -> list[tuple[str, str]]:
    """The (schedule, correction) pairs that run in ``cell`` for ``opt`` (module docstring)."""
    if cell == VERDICT:
        return [(s, c) for s in SCHEDULES for c in CORRECTIONS]
    fixes = CORRECTIONS if opt in CORRECTED_ELSEWHERE else ("none",)
    return [("paci", c) for c in fixes]


def depth_verdict(profile: Profile, lrs: dict[str, float], seeds: int) -> list[RunSpec]:
    """Issue 44 item 4's runs under the pruning rule of the module docstring: the verdict cell
    first (a grid stopped early has it), then the other cells by P, then the baselines."""
    cells = sorted(_cells(profile), key=lambda c: (c != VERDICT, c))
    specs = []
    for cell in cells:
        for opt in profile.optimizers:
            for schedule, correction in _pruned(cell, opt):
                for seed in range(seeds):
                    specs.append(_async(opt, lrs[opt], cell, (schedule, correction, seed)))
    for m in sorted({m for _, m in cells}):
        for opt in profile.optimizers:
            specs += [_sync(profile, opt, lrs[opt], m, seed) for seed in range(seeds)]
    return specs


# CPU seconds (user + system, one thread) per training step by (P, M), muon: the difference of
# a 14-step and a 4-step `nobubble train` run with the grid's settings (startup, data and the
# final evaluation cancel), divided by 10, timed with /usr/bin/time on 2026-12-06 14:33-14:44
# UTC while other engineers' jobs loaded the two cores (load average 10 to 14). For example
# (P = 8): nobubble train --model tiny-deep16 --vocab-size 512 --seq-len 128 --data
# shakespeare --tokenizer bpe --sample-tokens 0 --threads 1 --checkpoint-every 0 --schedule
# paci --stages 8 --microbatches 8 --micro-batch-size 4 --steps 14 --eval-every 14
# --eval-batches 8 --clip 0 --optimizer muon --lr 1e-2. P = 1 is the synchronous baseline.
DEPTH_SECONDS_PER_STEP: dict[tuple[int, int], float] = {
    (1, 8): 0.880,
    (2, 2): 0.747,
    (4, 4): 0.734,
    (8, 8): 0.971,
    (16, 16): 1.310,
    (16, 32): 1.762,
}


def depth_verdict_seconds(overrides: dict[str, Any], base: dict[str, Any]) -> float:
    """A run's estimated training CPU seconds: its steps times the measured step time of its
    (P, M); an unmeasured M takes its P's slowest measured one, and the synchronous baseline
    (P = 1) its one measured M. The optimizer is taken as muon's cost; the evaluations every 20
    steps (forward passes over 32 sequences) are left out."""
    p = overrides.get("stages", 1)
    m = overrides.get("microbatches", base["microbatches"])
    same_p = [s for (q, _), s in DEPTH_SECONDS_PER_STEP.items() if q == p]
    fallback = max(same_p) if same_p else max(DEPTH_SECONDS_PER_STEP.values())
    per_step = DEPTH_SECONDS_PER_STEP.get((p, m), fallback)
    return overrides.get("steps", base["steps"]) * per_step


__all__ = ["DEPTH", "QUICK_DEPTH", "VERDICT", "depth_verdict", "depth_verdict_seconds"]
