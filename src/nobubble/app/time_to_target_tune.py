"""Tuned contestants: each variant's learning rate chosen on seeds the race does not use.

Per variant (schedule, correction; the optimizer is the race's) a geometric grid of ``points``
learning rates ``factor`` apart, centred on the variant's own lr (``@LR``) or the race's, each
trained at the variant's step count on the tuning seeds; the lr with the lowest mean final
validation loss is chosen. A choice at an edge of the grid is no choice (the best may lie
beyond), so the grid grows past that edge, one value at a time, until the best is interior.
A run that diverges (non-finite gradients) counts as an infinite loss.

Tuning runs train under the emulator, one thread each, two at a time: their losses are the
multi-process runtime's bitwise and their clock is not read. They go through the experiment
runner (``nobubble.app.experiments.runner``), whose run keys make a rerun of the same grid, or a
grid that shares runs with another race's, free. The plain synchronous schedules train the same
gradients, so they share one tuning: 1f1b's.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nobubble.app.time_to_target import BASELINE, Variant, dir_name, final_val, train_config

MAX_EXTENSIONS = 6  # values added past an edge before the tuning gives up on an interior best


@dataclass(frozen=True)
class Tune:
    """How to tune: the seeds (none of the race's), the grid's size and spacing, the runs'
    folder (default: the race's ``tune/runs``) and how many run at once."""

    seeds: tuple[int, ...] = (100,)
    points: int = 5
    factor: float = 2.0
    runs_dir: Path | None = None
    jobs: int = 2

    def __post_init__(self) -> None:
        if self.points < 5:
            raise ValueError(f"--tune-points {self.points}: give at least 5 (an interior best)")
        if not 1.4 <= self.factor <= 2.5:
            raise ValueError(
                f"--tune-factor {self.factor}: give a spacing between 1.4 and 2.5 (e.g. 2)"
            )
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"--tune-seeds {list(self.seeds)}: give distinct seeds, e.g. 100")


def lr_grid(center: float, points: int, factor: float) -> list[float]:
    """``points`` learning rates ``factor`` apart, ``center`` in the middle (rounded to 4
    significant digits, so the same grid is spelled the same way every time)."""
    return [float(f"{center * factor ** (k - points // 2):.4g}") for k in range(points)]


def choice(losses: Mapping[float, float]) -> float:
    """The lr with the lowest loss (the smaller lr of a tie)."""
    return min(sorted(losses), key=lambda lr: losses[lr])


def extension(losses: Mapping[float, float], factor: float) -> float | None:
    """The next lr to try: one step past the edge where the best is; None when it is interior."""
    ordered = sorted(losses)
    best = ordered.index(choice(losses))
    if 0 < best < len(ordered) - 1:
        return None
    edge = ordered[best]
    return float(f"{(edge / factor if best == 0 else edge * factor):.4g}")


def tuning_group(variant: Variant) -> Variant:
    """Whose tuning a variant takes: 1f1b's for a plain synchronous schedule, else its own."""
    return Variant(BASELINE, lr=variant.lr) if variant.synchronous else variant


def _run_losses(
    specs: Sequence[Any], base: dict[str, Any], runs_dir: Path, jobs: int, progress: bool
) -> dict[str, float]:
    """Final validation loss by run name; a run that diverged gives inf. The runs go together;
    where one fails, each that is not finished is retried alone to tell which diverged."""
    from nobubble.app.experiments.runner import run_grid
    from nobubble.core.errors import NobubbleError

    def loss(records: list[dict[str, Any]]) -> float:
        value = final_val(records)
        return value if math.isfinite(value) else math.inf

    try:
        done = run_grid(specs, base, runs_dir, jobs, progress, desc="tuning")
        return {name: loss(o.metrics) for name, o in done.items()}
    except NobubbleError:
        pass
    out = {}
    for spec in specs:
        try:
            out[spec.name] = loss(run_grid([spec], base, runs_dir, 1, False)[spec.name].metrics)
        except NobubbleError as err:
            if "non-finite" not in str(err):
                raise
            out[spec.name] = math.inf
    return out


def tune_variants(
    out: Path,
    base_flags: Sequence[str],
    variants: Sequence[Variant],
    race_seeds: Sequence[int],
    steps: int,
    tune: Tune,
    progress: bool = True,
) -> dict[str, dict[str, Any]]:
    """Each variant's tuning (label -> grid, losses, choice) at its own step count."""
    if set(tune.seeds) & set(race_seeds):
        raise ValueError(
            f"--tune-seeds {list(tune.seeds)} and --seeds {list(race_seeds)} share "
            f"{sorted(set(tune.seeds) & set(race_seeds))}: tune on seeds the race does not use"
        )
    cfg = train_config(base_flags)
    base = cfg.to_json() | {"runtime": "emulate", "threads": 1, "checkpoint_every": 0}
    groups = {v.label: tuning_group(v) for v in variants}
    lengths = {v.label: v.steps or steps for v in variants}
    todo = {(groups[k].label, n) for k, n in lengths.items()}  # (group, steps)
    by_group = {g.label: g for g in groups.values()}
    losses: dict[tuple[str, int], dict[float, float]] = {key: {} for key in todo}
    pending = {
        key: lr_grid(by_group[key[0]].lr or cfg.optimizer.lr, tune.points, tune.factor)
        for key in todo
    }
    for _ in range(MAX_EXTENSIONS + 1):
        specs = _specs(pending, by_group, tune.seeds)
        runs_dir = tune.runs_dir or out / "tune" / "runs"
        got = _run_losses([s for s, _, _ in specs.values()], base, runs_dir, tune.jobs, progress)
        per: dict[tuple[tuple[str, int], float], list[float]] = {}
        for name, (_, key, lr) in specs.items():
            per.setdefault((key, lr), []).append(got[name])
        for (key, lr), values in per.items():
            losses[key][lr] = statistics.fmean(values)
        pending = {}
        for key, table in losses.items():
            more = extension(table, tune.factor)
            if more is not None:
                pending[key] = [more]
        if not pending:
            break
    return {
        label: _report(
            losses[(groups[label].label, lengths[label])], tune, groups[label].label, lengths[label]
        )
        for label in lengths
    }


def _specs(
    pending: Mapping[tuple[str, int], Sequence[float]],
    by_group: Mapping[str, Variant],
    seeds: Sequence[int],
) -> dict[str, tuple[Any, tuple[str, int], float]]:
    """The runs of the learning rates still to try: name -> (spec, (group, steps), lr)."""
    from nobubble.app.experiments.runner import RunSpec

    specs = {}
    for (group, n), lrs in pending.items():
        v = by_group[group]
        for lr in lrs:
            for seed in seeds:
                name = f"{dir_name(group)}-n{n}-lr{lr:g}-s{seed}"
                overrides: dict[str, Any] = {"schedule": v.schedule, "correction": v.correction}
                overrides |= {"lr": lr, "seed": seed, "steps": n}
                specs[name] = (RunSpec(name, overrides), (group, n), lr)
    return specs


def _report(losses: Mapping[float, float], tune: Tune, group: str, steps: int) -> dict[str, Any]:
    grid = sorted(losses)
    return {
        "grid": grid,
        "losses": [losses[lr] for lr in grid],
        "chosen": choice(losses),
        "interior": extension(losses, tune.factor) is None,
        "tuned_as": group,
        "steps": steps,
        "seeds": list(tune.seeds),
    }
