"""The time-to-target race: every contestant trained per seed, each against the best synchronous
schedule's final loss and 1f1b's.

``race`` runs the variants of each seed as one round, every run cut into segments that alternate
within the round (``nobubble.app.segments``), so every ratio is taken between runs that met the
same conditions; the seeds' ratios give a median (over the seeds that reached the target, k/n)
and a Student-t interval (when all did). The race includes every synchronous schedule the
runtime trains at its P and M (``sync_contestants``) and names as *best synchronous* the one that
reaches its own final loss soonest (median over seeds): the baseline of every ratio and of the
equal budget, besides 1f1b.

With ``check_projection`` (P=2, ``--runtime dist``) every run is trained a second time under the
emulator (``out/seedS/emulate/VARIANT``), whose losses are the runtime's bitwise, so the same
runs carry both clocks (``time_to_target_bench.check_projection`` compares them).
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nobubble.app.segments import clock, read_records, run_alternating
from nobubble.app.time_to_target import (
    BASELINE,
    Variant,
    crossing,
    dir_name,
    error_bar,
    final_val,
    projected_times,
    train_config,
    val_curve,
)
from nobubble.app.time_to_target_tune import Tune, tune_variants

# the synchronous schedules a race includes where the runtime trains them at its P and M
SYNC_CONTESTANTS = ("1f1b", "zbv", "interleaved-1f1b", "zb-h1")
EMULATED = "emulate"  # the folder of the emulated copies of a projection check
LEAVES_OUT = "transfers, the runtime's own overhead"
# A loss within this share of the target counts as reaching it: the synchronous schedules train
# the same gradients summed in other orders, and their final losses differ by ~1e-6 (zbv against
# 1f1b); without it one of two identical trainings "never reaches" the other's loss.
SAME_LOSS = 1e-5


def reached_at(curve: Sequence[tuple[float, float]], target: float) -> float | None:
    """``crossing`` with float rounding's allowance (``SAME_LOSS``) on the target."""
    return crossing(curve, target + SAME_LOSS * abs(target))


@dataclass(frozen=True)
class RaceOptions:
    """What a race does beyond training the variants.

    check_projection: train every run under the emulator too (a ``--runtime dist`` race) and
    report the projected clock's error. transfer_s: projected clocks charge each hop between
    ranks this many seconds (0: free). projection_error: a checked race's ``projection_check``,
    carried as error bars on projected figures. tune: tune every variant's lr first.
    baseline: the best synchronous schedule, when chosen already (an equal-budget race keeps
    the equal-steps race's: at equal budgets a schedule that trained fewer steps would reach its
    own, higher, final loss soonest). lean_budget: the equal-budget race keeps the equal-steps
    race's tuned learning rates instead of tuning again at the budget's step counts, and leaves
    out the plain synchronous schedules other than 1f1b and the baseline (they train the
    baseline's gradients, slower: fewer steps in the same budget).
    """

    check_projection: bool = False
    transfer_s: float = 0.0
    projection_error: Mapping[str, Any] | None = None
    tune: Tune | None = None
    baseline: str | None = None
    lean_budget: bool = False


def sync_contestants(base_flags: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """The synchronous schedules the runtime trains under ``base_flags`` (their P, M and model),
    and those it refuses, each with the refusal's reason."""
    from nobubble.app.train.assemble import make_plan
    from nobubble.app.train.config import TrainConfig

    base = train_config(base_flags).to_json()
    kept, skipped = [], {}
    for name in SYNC_CONTESTANTS:
        try:
            cfg = TrainConfig.from_mapping({**base, "schedule": name, "correction": "none"})
            make_plan(cfg, cfg.data.vocab_size)
        except ValueError as err:
            skipped[name] = str(err).splitlines()[0]
            continue
        kept.append(name)
    return kept, skipped


# ----- the race ----------------------------------------------------------------------------------
def race(
    out: Path,
    base_flags: Sequence[str],
    variants: Sequence[Variant],
    seeds: Sequence[int],
    steps: int,
    segments: int,
    progress: bool = True,
    options: RaceOptions = RaceOptions(),
) -> dict[str, Any]:
    """Train every variant for every seed (a round per seed, ``out/seedS/VARIANT``; with
    ``check_projection`` also ``out/seedS/emulate/VARIANT``) and measure each one's time to the
    best synchronous schedule's and 1f1b's final validation loss of its seed."""
    if variants[0].label != BASELINE:
        raise ValueError(f"the race's first variant is {BASELINE}, got {variants[0]}")
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds {list(seeds)!r}: give distinct seeds, e.g. 0,1,2")
    tuning = None
    if options.tune is not None:
        tuning = tune_variants(out, base_flags, variants, seeds, steps, options.tune, progress)
        variants = [dataclasses.replace(v, tuned_lr=tuning[v.label]["chosen"]) for v in variants]
    emulated = [*base_flags, "--runtime", "emulate", "--threads", "1"]
    for i, seed in enumerate(seeds):
        common = [*base_flags, "--seed", str(seed), "--steps", str(steps)]
        runs = {dir_name(v.label): [*common, *v.flags()] for v in variants}  # theirs win
        lengths = {dir_name(v.label): v.steps or steps for v in variants}
        if options.check_projection:  # the same runs under the emulator: same losses
            twin = [*emulated, "--seed", str(seed)]
            runs |= {f"{EMULATED}/{k}": [*twin, *runs[k][len(common) :]] for k in list(runs)}
            lengths |= {f"{EMULATED}/{k}": n for k, n in list(lengths.items())}
        run_alternating(out / f"seed{seed}", runs, lengths, segments, progress, rotate=i)
    result = summarize(out, variants, seeds, options)
    if tuning is not None:
        result["tuning"] = tuning
    return result


def budget_steps(result: Mapping[str, Any], steps: int, quantum: int) -> dict[str, int]:
    """Each variant's steps for the same wall-clock budget as the baseline's ``steps`` (the
    best synchronous schedule's): its throughput ratio to the baseline (median over the race's
    seeds) times ``steps``, rounded DOWN to a multiple of ``quantum`` (segments and evaluations
    must divide it), so no variant trains longer than the baseline."""
    out = {}
    base = result["variants"][result["baseline"]]["seeds"]
    for label, row in result["variants"].items():
        ratios = [r["tokens_per_s"] / base[s]["tokens_per_s"] for s, r in row["seeds"].items()]
        # a ratio of exactly 1 must not lose a quantum to rounding (x.9999999 floors down)
        whole = math.floor(steps * statistics.median(ratios) / quantum + 1e-9)
        out[label] = max(quantum, whole * quantum)
    return out


def equal_budget(
    out: Path,
    base_flags: Sequence[str],
    variants: Sequence[Variant],
    seeds: Sequence[int],
    steps: int,
    segments: int,
    quantum: int,
    progress: bool = True,
    options: RaceOptions = RaceOptions(),
) -> dict[str, Any]:
    """As a user would run it: first the race at equal steps (``out``), then every variant
    again for the best synchronous schedule's wall-clock budget, its steps (and so its
    learning-rate schedule, and its tuning) scaled by its throughput (``out/equal-budget``)."""
    same = race(out, base_flags, variants, seeds, steps, segments, progress, options)
    lengths = budget_steps(same, steps, quantum)
    budgeted = [dataclasses.replace(v, steps=lengths[v.label]) for v in variants]
    again = dataclasses.replace(options, check_projection=False, baseline=same["baseline"])
    if options.lean_budget:
        budgeted, again = _lean(budgeted, same), dataclasses.replace(again, tune=None)
    result = race(
        out / "equal-budget", base_flags, budgeted, seeds, steps, segments, progress, again
    )
    if options.lean_budget:
        result["lean"] = "tuning kept from the equal-steps race; left out: " + ", ".join(
            v.label for v in variants if v.label not in {b.label for b in budgeted}
        )
    result["steps"] = lengths
    result["budget_of"] = same["baseline"]
    return {"equal_steps": same, "equal_budget": result}


def _lean(budgeted: Sequence[Variant], same: Mapping[str, Any]) -> list[Variant]:
    """``lean_budget``'s variants: each with its equal-steps tuned lr, without the plain
    synchronous schedules that are neither 1f1b nor the baseline."""
    tuning = same.get("tuning", {})
    keep = [
        v
        for v in budgeted
        if v.label in (BASELINE, same["baseline"])
        or not (v.schedule in SYNC_CONTESTANTS and v.correction == "none")
    ]
    return [
        dataclasses.replace(v, tuned_lr=tuning[v.label]["chosen"]) if v.label in tuning else v
        for v in keep
    ]


# ----- the summary -------------------------------------------------------------------------------
def _emulated(run_dir: Path) -> bool:
    config = json.loads((run_dir / "config.json").read_text())["config"]
    return bool(config["runtime"] == "emulate")


def _load(run_dir: Path, transfer_s: float) -> dict[str, Any]:
    """A run's records, its clock's kind and its (time, validation loss) curve."""
    records = read_records(run_dir)
    projected = _emulated(run_dir)
    times = projected_times(run_dir, transfer_s) if projected else None
    last = records[-1]
    seconds = times[last["step"]] if times is not None else clock(last)
    return {
        "clock": "projected" if projected else "measured",
        "curve": val_curve(records, times),
        "final_val": final_val(records),
        "steps": last["step"],
        "train_s": seconds,
        "tokens_per_s": last["tokens"] / seconds,
    }


def best_synchronous(runs: Mapping[int, Mapping[str, Mapping[str, Any]]]) -> dict[str, Any]:
    """Among the plain synchronous variants (``runs``: seed -> label -> loaded run), the one
    that reaches its own final loss soonest, median over seeds; ties go to the earlier."""
    seeds = list(runs)
    labels = [label for label in runs[seeds[0]] if Variant.parse(label).synchronous]
    own = {
        label: statistics.median(
            reached_at(runs[s][label]["curve"], runs[s][label]["final_val"]) or math.inf
            for s in seeds
        )
        for label in labels
    }
    return {"best": min(labels, key=lambda x: own[x]), "own_final_s": own}


def _versus(run: Mapping[str, Any], base: Mapping[str, Any]) -> tuple[float | None, float | None]:
    """A run's time to ``base``'s final loss, and its ratio to ``base``'s own time to it."""
    reached = reached_at(run["curve"], base["final_val"])
    own = reached_at(base["curve"], base["final_val"])
    return reached, None if reached is None or not own else reached / own


def _seed_row(
    run: Mapping[str, Any], best: Mapping[str, Any], f1b: Mapping[str, Any]
) -> dict[str, Any]:
    to_best, vs_best = _versus(run, best)
    to_1f1b, vs_1f1b = _versus(run, f1b)
    fields = ("clock", "steps", "final_val", "train_s", "tokens_per_s", "curve")
    return {
        **{k: run[k] for k in fields},
        "target": best["final_val"],
        "time_to_target_s": to_best,
        "vs_best": vs_best,
        "target_1f1b": f1b["final_val"],
        "time_to_1f1b_s": to_1f1b,
        "vs_1f1b": vs_1f1b,
    }


def _aggregate(row: dict[str, Any]) -> None:
    """Across seeds: medians over the seeds that reached (k of n), the intervals of the ratios
    (when every seed reached) and of the final loss against each baseline's, paired by seed."""
    from nobubble.app.experiments.stats import interval

    per = row["seeds"]
    for name in ("vs_best", "vs_1f1b"):
        ratios = {s: r[name] for s, r in per.items() if r[name] is not None}
        row[f"{name}_reached"] = [len(ratios), len(per)]
        row[f"{name}_median"] = statistics.median(ratios.values()) if ratios else None
        row[f"{name}_interval"] = interval(ratios) if len(ratios) == len(per) else None
    row["final_val_mean"] = statistics.fmean(r["final_val"] for r in per.values())
    row["final_vs_best"] = interval({s: r["final_val"] - r["target"] for s, r in per.items()})
    row["final_vs_1f1b"] = interval({s: r["final_val"] - r["target_1f1b"] for s, r in per.items()})
    row["tokens_per_s_median"] = statistics.median(r["tokens_per_s"] for r in per.values())


def summarize(
    out: Path,
    variants: Sequence[Variant],
    seeds: Sequence[int],
    options: RaceOptions = RaceOptions(),
    under: str = "",
) -> dict[str, Any]:
    """Per variant and seed: final loss, tokens/s, time to the best synchronous schedule's and
    1f1b's final loss and the ratios to their own times; across seeds, ``_aggregate``. Each
    row says its clock; projected ones what the projection leaves out and, with a
    ``projection_error``, their error bar. ``under``: the runs' folder in each seed's."""
    runs = {
        s: {
            v.label: _load(out / f"seed{s}" / under / dir_name(v.label), options.transfer_s)
            for v in variants
        }
        for s in seeds
    }
    chosen = best_synchronous(runs)
    best = chosen["best"] = options.baseline or chosen["best"]
    rows: dict[str, dict[str, Any]] = {}
    for v in variants:
        per = {s: _seed_row(runs[s][v.label], runs[s][best], runs[s][BASELINE]) for s in seeds}
        rows[v.label] = row = {"seeds": per, "clock": per[seeds[0]]["clock"]}
        _aggregate(row)
        if row["clock"] == "projected":
            row["leaves_out"] = (
                LEAVES_OUT if not options.transfer_s else "the runtime's own overhead"
            )
            row["error_bar"] = error_bar(options.projection_error, v, options.transfer_s)
        else:
            row["leaves_out"] = None
    return {
        "baseline": best,
        "best_synchronous": chosen,
        "seeds": list(seeds),
        "transfer_s": options.transfer_s,
        "variants": rows,
    }


def against(race: Mapping[str, Any], reference: Mapping[str, Any], label: str) -> dict[str, Any]:
    """``race`` (a ``summarize`` output, its seeds' keys ints) with every ratio taken against
    ``label``'s run in ``reference`` (the equal-steps race, where every synchronous schedule
    ran) instead of the best synchronous schedule's: each variant's time to that run's final
    loss over the run's own time, per seed and across seeds, from the saved curves. The
    question "against zbv" at P=2, where zbv is not the fastest. 1f1b's columns stay."""
    if label not in reference["variants"]:
        raise ValueError(
            f"--against {label}: not a schedule of this race (it has "
            f"{', '.join(reference['variants'])})"
        )
    base = reference["variants"][label]["seeds"]
    f1b = race["variants"][BASELINE]["seeds"]  # the race's own 1f1b, as the race took it
    rows = {}
    for name, row in race["variants"].items():
        per = {s: _seed_row(r, base[s], f1b[s]) for s, r in row["seeds"].items()}
        kept = {k: row[k] for k in ("clock", "leaves_out", "error_bar") if k in row}
        rows[name] = new = {"seeds": per, **kept}
        _aggregate(new)
    return {**race, "baseline": label, "variants": rows}
