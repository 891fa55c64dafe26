"""Time to target: how long each schedule trains until it reaches the synchronous baseline's loss.

The measure users ask for ("does asynchrony get me there sooner?"), design.md section 6: the
target is the final validation loss of the baseline run (1f1b) of the same seed; a run's time to
target is the first moment its validation loss is at or below it, interpolated linearly between
two evaluations, on the training clock (wall seconds less validations and checkpoints; the
drains an asynchronous schedule takes for them stay on the clock). A run that never gets there
is "not reached" (None), never extrapolated.

``race`` runs the variants of each seed as one round, every run cut into segments that alternate
within the round (``nobubble.app.segments``), so every ratio to the baseline is taken between runs
that met the same conditions; the rounds' ratios give a median and a Student-t interval. With
``--runtime dist`` the clock is measured; with ``--runtime emulate`` it is *projected*: every
action's measured duration in the one-process emulator (median per stage and kind) replayed by
the simulator on P parallel stages with free transfers, the run's own schedule and drain points.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nobubble.app.segments import clock, read_records, run_alternating
from nobubble.core.schedules import SCHEDULES
from nobubble.optim.correction_registry import CORRECTIONS

BASELINE = "1f1b"


# ----- the measure -------------------------------------------------------------------------------
def crossing(points: Sequence[tuple[float, float]], target: float) -> float | None:
    """The first time a curve of (time, loss) points is at or below ``target``, interpolated
    linearly from the point before; the first point's own time when it is already there."""
    before: tuple[float, float] | None = None
    for t, loss in points:
        if loss <= target:
            if before is None or before[1] == loss:
                return t
            t0, l0 = before
            return t0 + (l0 - target) / (l0 - loss) * (t - t0)
        before = (t, loss)
    return None


def val_curve(
    records: Sequence[Mapping[str, Any]], times: Mapping[int, float] | None = None
) -> list[tuple[float, float]]:
    """(training clock, validation loss) at every evaluation of a run; ``times`` (step ->
    seconds) replaces the measured clock, e.g. by ``projected_times``."""
    return [
        (times[r["step"]] if times is not None else clock(r), float(r["val_loss"]))
        for r in records
        if r.get("val_loss") is not None
    ]


def final_val(records: Sequence[Mapping[str, Any]]) -> float:
    values = [r["val_loss"] for r in records if r.get("val_loss") is not None]
    if not values:
        raise ValueError("the run has no validation loss: give it an --eval-every")
    return float(values[-1])


def projected_times(run_dir: Path) -> dict[int, float]:
    """Step -> seconds at which a P-stage pipeline on P devices would finish it: the run's own
    schedule (its drain points included) simulated with the per-stage median F, B and STEP
    durations its emulator measured (``action_costs.json``), transfers free."""
    from nobubble.app.train.assemble import make_schedule
    from nobubble.app.train.config import TrainConfig
    from nobubble.core.ir import STEP
    from nobubble.core.sim import CostModel, simulate

    saved = json.loads((run_dir / "config.json").read_text())
    cfg = TrainConfig.from_mapping(saved["config"])
    durations = json.loads((run_dir / "action_costs.json").read_text())["durations_s"]
    costs = {
        s: {k: statistics.median(v) for k, v in kinds.items()} for s, kinds in durations.items()
    }
    schedule = make_schedule(cfg)
    stages = range(schedule.num_stages)

    def per_stage(kind: str) -> tuple[float, ...]:
        return tuple(costs[str(s)][kind] for s in stages)

    step = statistics.mean(costs[str(s)]["STEP"] for s in stages)
    model = CostModel(fwd=per_stage("F"), bwd=per_stage("B"), step=step)
    timeline = simulate(schedule, model, check=False).timeline
    ends: dict[int, float] = {}
    for rank in range(schedule.num_ranks):
        for action, _, end in timeline.spans(rank):
            if action.kind == STEP:
                ends[action.number] = max(ends.get(action.number, 0.0), end)
    return ends


# ----- variants ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Variant:
    """One contestant: a schedule, with a correction and a learning rate of its own if given.

    Written ``SCHEDULE[:CORRECTION][@LR]`` on the command line: ``paci``, ``2bw:ef``,
    ``paci:predict@0.008``.
    """

    schedule: str
    correction: str = "none"
    lr: float | None = None
    steps: int | None = None  # its own number of steps (an equal-budget race); None: the race's

    @classmethod
    def parse(cls, text: str) -> Variant:
        body, _, lr = text.partition("@")
        schedule, _, correction = body.partition(":")
        if schedule not in SCHEDULES:
            raise ValueError(
                f"variant {text!r}: schedule {schedule!r} is unknown; use one of "
                f"{', '.join(SCHEDULES)} (SCHEDULE[:CORRECTION][@LR], e.g. paci:predict@0.008)"
            )
        correction = correction or "none"
        if correction not in CORRECTIONS:
            raise ValueError(
                f"variant {text!r}: correction {correction!r} is unknown; use one of "
                f"{', '.join(CORRECTIONS)}"
            )
        try:
            rate = float(lr) if lr else None
        except ValueError:
            raise ValueError(f"variant {text!r}: {lr!r} after @ is not a learning rate") from None
        if rate is not None and not rate > 0:
            raise ValueError(f"variant {text!r}: the learning rate must be > 0, got {lr}")
        return cls(schedule, correction, rate)

    @property
    def label(self) -> str:
        text = self.schedule + ("" if self.correction == "none" else f":{self.correction}")
        return text + ("" if self.lr is None else f"@{self.lr:g}")

    def flags(self) -> list[str]:
        out = ["--schedule", self.schedule, "--correction", self.correction]
        out += [] if self.lr is None else ["--lr", repr(self.lr)]
        return out + ([] if self.steps is None else ["--steps", str(self.steps)])


def parse_variants(text: str) -> list[Variant]:
    """Comma-separated variants; the baseline (1f1b, plain) comes first, added when missing."""
    variants = [Variant.parse(part.strip()) for part in text.split(",") if part.strip()]
    labels = [v.label for v in variants]
    if len(set(labels)) != len(labels):
        raise ValueError(
            f"--variants names {sorted(x for x in labels if labels.count(x) > 1)} twice"
        )
    baseline = Variant(BASELINE)
    return [baseline] + [v for v in variants if v != baseline]


# ----- the race ----------------------------------------------------------------------------------
def _dir_name(label: str) -> str:
    return label.replace(":", "+").replace("@", "-lr")


def race(
    out: Path,
    base_flags: Sequence[str],
    variants: Sequence[Variant],
    seeds: Sequence[int],
    steps: int,
    segments: int,
    progress: bool = True,
) -> dict[str, Any]:
    """Train every variant for every seed (a round per seed, ``out/seedS/VARIANT``) and
    measure each one's time to its seed's baseline's final validation loss."""
    if variants[0].label != BASELINE:
        raise ValueError(f"the race's first variant is the baseline {BASELINE}, got {variants[0]}")
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds {list(seeds)!r}: give distinct seeds, e.g. 0,1,2")
    for i, seed in enumerate(seeds):
        common = [*base_flags, "--seed", str(seed), "--steps", str(steps)]
        runs = {_dir_name(v.label): [*common, *v.flags()] for v in variants}  # theirs win
        lengths = {_dir_name(v.label): v.steps or steps for v in variants}
        run_alternating(out / f"seed{seed}", runs, lengths, segments, progress, rotate=i)
    return summarize(out, variants, seeds)


def budget_steps(result: Mapping[str, Any], steps: int, quantum: int) -> dict[str, int]:
    """Each variant's steps for the same wall-clock budget as the baseline's ``steps``: its
    measured throughput ratio to the baseline (median over the race's seeds) times ``steps``,
    rounded to a multiple of ``quantum`` (segments and evaluations must divide it)."""
    out = {}
    base = result["variants"][BASELINE]["seeds"]
    for label, row in result["variants"].items():
        ratios = [r["tokens_per_s"] / base[s]["tokens_per_s"] for s, r in row["seeds"].items()]
        out[label] = max(quantum, round(steps * statistics.median(ratios) / quantum) * quantum)
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
) -> dict[str, Any]:
    """As a user would run it: first the race at equal steps (``out``), then every variant
    again for the baseline's wall-clock budget, its steps (and so its learning-rate schedule)
    scaled by its measured throughput (``out/equal-budget``); final loss against final loss."""
    same = race(out, base_flags, variants, seeds, steps, segments, progress)
    lengths = budget_steps(same, steps, quantum)
    budgeted = [dataclasses.replace(v, steps=lengths[v.label]) for v in variants]
    result = race(out / "equal-budget", base_flags, budgeted, seeds, steps, segments, progress)
    result["steps"] = lengths
    return {"equal_steps": same, "equal_budget": result}


def _emulated(run_dir: Path) -> bool:
    config = json.loads((run_dir / "config.json").read_text())["config"]
    return bool(config["runtime"] == "emulate")


def summarize(out: Path, variants: Sequence[Variant], seeds: Sequence[int]) -> dict[str, Any]:
    """Per variant and seed: final loss, tokens/s, time to target and its ratio to the
    baseline's time; across seeds: medians and the Student-t interval of the ratios. Emulated
    runs are timed on their projected clock."""
    from nobubble.app.experiments.stats import interval

    projected = _emulated(out / f"seed{seeds[0]}" / _dir_name(BASELINE))
    rows: dict[str, dict[str, Any]] = {v.label: {"seeds": {}} for v in variants}
    for seed in seeds:
        runs = {}
        for v in variants:
            run_dir = out / f"seed{seed}" / _dir_name(v.label)
            records = read_records(run_dir)
            times = projected_times(run_dir) if projected else None
            runs[v.label] = (records, times)
        base_records, base_times = runs[BASELINE]
        target = final_val(base_records)
        base_time = crossing(val_curve(base_records, base_times), target)
        for v in variants:
            records, times = runs[v.label]
            reached = crossing(val_curve(records, times), target)
            last = records[-1]
            seconds = times[last["step"]] if times is not None else clock(last)
            rows[v.label]["seeds"][seed] = {
                "steps": last["step"],
                "final_val": final_val(records),
                "target": target,
                "time_to_target_s": reached,
                "vs_baseline": None if reached is None or not base_time else reached / base_time,
                "train_s": seconds,
                "tokens_per_s": last["tokens"] / seconds,
            }
    for row in rows.values():
        per = row["seeds"]
        ratios = {s: r["vs_baseline"] for s, r in per.items() if r["vs_baseline"] is not None}
        row["reached"] = len(ratios)
        row["vs_baseline_median"] = statistics.median(ratios.values()) if ratios else None
        row["vs_baseline_interval"] = interval(ratios) if len(ratios) == len(per) else None
        row["final_val_mean"] = statistics.fmean(r["final_val"] for r in per.values())
        # final loss against the baseline's, paired by seed (negative: lower than 1f1b's)
        finals = {s: r["final_val"] - r["target"] for s, r in per.items()}
        row["final_vs_baseline"] = interval(finals)
        row["tokens_per_s_median"] = statistics.median(r["tokens_per_s"] for r in per.values())
    return {"baseline": BASELINE, "seeds": list(seeds), "projected": projected, "variants": rows}


def format_race(result: Mapping[str, Any]) -> str:
    """The race as a table: one row per variant, per-seed values after the medians."""
    seeds = result["seeds"]

    def seconds(value: float | None) -> str:
        return "not reached" if value is None else f"{value:.1f}"

    def ratio(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    def spread(iv: Mapping[str, Any] | None, sign: str = "") -> str:
        if iv is None or iv["lo"] is None:
            return "-"
        return f"{iv['mean']:{sign}.3f} [{iv['lo']:{sign}.3f}, {iv['hi']:{sign}.3f}]"

    header = ["variant", "steps", "final val (mean)", "- 1f1b [95%]", "tokens/s (median)"]
    header += ["time to target (s)"]
    header += ["vs 1f1b (median)", "vs 1f1b mean [95%]", "vs 1f1b per seed"]
    lines = []
    for label, row in result["variants"].items():
        per = [row["seeds"][s] for s in seeds]
        iv = row["vs_baseline_interval"]
        mean = (
            "-"
            if iv is None or iv["lo"] is None
            else f"{iv['mean']:.3f} [{iv['lo']:.3f}, {iv['hi']:.3f}]"
        )
        median = row["vs_baseline_median"]
        finals = row["final_vs_baseline"]
        lines.append(
            [
                label,
                "/".join(sorted({str(r["steps"]) for r in per})),
                f"{row['final_val_mean']:.4f}",
                "-" if label == result["baseline"] else spread(finals, "+"),
                f"{row['tokens_per_s_median']:,.0f}",
                " / ".join(seconds(r["time_to_target_s"]) for r in per),
                "-" if median is None else f"{median:.3f}",
                mean,
                " / ".join(
                    "-" if r["vs_baseline"] is None else f"{r['vs_baseline']:.3f}" for r in per
                ),
            ]
        )
    width = [max(len(str(x)) for x in column) for column in zip(header, *lines, strict=True)]
    text = [
        "  ".join(c.ljust(w) for c, w in zip(row, width, strict=True)) for row in [header, *lines]
    ]
    clock_kind = (
        "projected (emulator costs, P parallel stages)" if result["projected"] else "measured"
    )
    text.append(
        f"target: each seed's {result['baseline']} final validation loss; time on the training "
        f"clock ({clock_kind}), seeds {', '.join(map(str, seeds))}"
    )
    return "\n".join(text)
