"""Time to target: how long a run trains until it reaches a baseline's loss.

The measure users ask for ("does asynchrony get me there sooner?"): a run's time to a target
loss is the first moment its validation loss is at or below it, interpolated linearly between
two evaluations, on the training clock (wall seconds less validations and checkpoints; the
drains an asynchronous schedule takes for them stay on the clock). A run that never gets there
is "not reached" (None), never extrapolated. The clock is *measured* for ``--runtime dist``
runs and *projected* for emulated ones: every action's measured duration in the one-process
emulator (median per stage and kind) replayed by the simulator on P parallel stages, the run's
own schedule and drain points, transfers free unless given a cost per hop.

This module holds the measure, the clocks and the contestants' spelling; the race that uses
them is ``time_to_target_race``, its tuning ``time_to_target_tune``, its tables and figure
``time_to_target_report``.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nobubble.app.segments import clock
from nobubble.core.schedules import SCHEDULES
from nobubble.optim.correction_registry import correction_entry

if TYPE_CHECKING:
    from nobubble.app.train.config import TrainConfig
    from nobubble.core.sim import CostModel

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


def stage_costs(run_dir: Path, transfer_s: float = 0.0) -> CostModel:
    """The cost model of a run's emulator: per stage the median F, B and STEP duration it
    measured (``action_costs.json``); a split backward's B is its I + W (W its weight part);
    a hop between ranks costs ``transfer_s`` (0: free)."""
    from nobubble.core.sim import CostModel

    durations = json.loads((run_dir / "action_costs.json").read_text())["durations_s"]
    costs = {
        int(s): {k: statistics.median(v) for k, v in kinds.items()}
        for s, kinds in durations.items()
    }
    stages = sorted(costs)
    split = any("W" in costs[s] for s in stages)
    # a split stage with no input gradient (the first) runs an empty I, or none
    bwd = tuple(costs[s].get("I", 0.0) + costs[s]["W"] if split else costs[s]["B"] for s in stages)
    return CostModel(
        fwd=tuple(costs[s]["F"] for s in stages),
        bwd=bwd,
        wgrad=tuple(costs[s]["W"] for s in stages) if split else None,
        step=statistics.mean(costs[s]["STEP"] for s in stages),
        latency=transfer_s,
    )


def projected_times(run_dir: Path, transfer_s: float = 0.0) -> dict[int, float]:
    """Step -> seconds at which a P-stage pipeline on P devices would finish it: the run's own
    schedule (its drain points included) simulated with the per-stage median durations its
    emulator measured (``stage_costs``), each hop between ranks ``transfer_s`` (0: free)."""
    from nobubble.app.train.assemble import make_schedule
    from nobubble.app.train.config import TrainConfig
    from nobubble.core.ir import STEP
    from nobubble.core.sim import simulate

    saved = json.loads((run_dir / "config.json").read_text())
    cfg = TrainConfig.from_mapping(saved["config"])
    schedule = make_schedule(cfg)
    timeline = simulate(schedule, stage_costs(run_dir, transfer_s), check=False).timeline
    ends: dict[int, float] = {}
    for rank in range(schedule.num_ranks):
        for action, _, end in timeline.spans(rank):
            if action.kind == STEP:
                ends[action.number] = max(ends.get(action.number, 0.0), end)
    return ends


def transfer_seconds(run_dir: Path) -> float:
    """The median duration of a ``--runtime dist`` run's measured sends (``trace.json``): one
    hop's cost on this machine's transport (gloo point-to-point on CPU)."""
    events = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    spans = [
        e["dur"] / 1e6
        for e in events
        if e.get("ph") == "X" and e.get("args", {}).get("kind") in ("SEND_F", "SEND_B")
    ]
    if not spans:
        raise ValueError(f"{run_dir}/trace.json has no measured sends (a --runtime dist run?)")
    return statistics.median(spans)


def train_config(flags: Sequence[str]) -> TrainConfig:
    """The ``TrainConfig`` that ``nobubble train FLAGS`` would run."""
    from nobubble.app.train.flags import build_train_parser, config_from_args

    return config_from_args(build_train_parser().parse_args([*flags, "--out", "x"]))


def error_bar(
    check: Mapping[str, Any] | None, variant: Variant, transfer_s: float
) -> dict[str, Any] | None:
    """A projected row's relative error bar from a checked race: the same variant's error,
    else its schedule's (uncorrected), else the largest of any; None without a check."""
    if check is None:
        return None
    errors = check["with_transfers" if transfer_s else "free"]
    plain = variant.schedule
    source = next((k for k in (variant.label, plain) if k in errors), None)
    if source is not None:
        return {**{k: abs(v) for k, v in errors[source].items()}, "from": source}
    worst = {k: max(abs(e[k]) for e in errors.values()) for k in ("time", "vs_best", "vs_1f1b")}
    return {**worst, "from": "the largest of the checked variants"}


# ----- variants ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Variant:
    """One contestant: a schedule, with a correction and a learning rate of its own if given.

    Written ``SCHEDULE[:CORRECTION][@LR]`` on the command line: ``paci``, ``2bw:ef``,
    ``paci:predict@0.008``.
    """

    schedule: str
    correction: str = "none"
    lr: float | None = None  # as given (the centre of a tuning grid)
    steps: int | None = None  # its own number of steps (an equal-budget race); None: the race's
    tuned_lr: float | None = None  # the tuning's choice; trains in place of ``lr``

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
        try:
            correction_entry(correction)  # the registry's refusal, with the variant's spelling
        except ValueError as err:
            raise ValueError(f"variant {text!r}: {err}") from None
        try:
            rate = float(lr) if lr else None
        except ValueError:
            raise ValueError(f"variant {text!r}: {lr!r} after @ is not a learning rate") from None
        if rate is not None and not rate > 0:
            raise ValueError(f"variant {text!r}: the learning rate must be > 0, got {lr}")
        return cls(schedule, correction, rate)

    @property
    def synchronous(self) -> bool:
        """A synchronous schedule, uncorrected: every such variant trains the same gradients."""
        return SCHEDULES[self.schedule].synchronous and self.correction == "none"

    @property
    def label(self) -> str:
        text = self.schedule + ("" if self.correction == "none" else f":{self.correction}")
        return text + ("" if self.lr is None else f"@{self.lr:g}")

    def flags(self) -> list[str]:
        out = ["--schedule", self.schedule, "--correction", self.correction]
        lr = self.lr if self.tuned_lr is None else self.tuned_lr
        out += [] if lr is None else ["--lr", repr(lr)]
        return out + ([] if self.steps is None else ["--steps", str(self.steps)])


def parse_variants(text: str, extra: Sequence[str] = ()) -> list[Variant]:
    """Comma-separated variants; 1f1b (plain) comes first, added when missing, and the plain
    schedules of ``extra`` (the race's synchronous contestants) after the given ones."""
    variants = [Variant.parse(part.strip()) for part in text.split(",") if part.strip()]
    labels = [v.label for v in variants]
    if len(set(labels)) != len(labels):
        raise ValueError(
            f"--variants names {sorted(x for x in labels if labels.count(x) > 1)} twice"
        )
    baseline = Variant(BASELINE)
    out = [baseline] + [v for v in variants if v != baseline]
    return out + [Variant(name) for name in extra if Variant(name) not in out]


def dir_name(label: str) -> str:
    """A variant's run folder: its label with the characters a path should not hold replaced."""
    return label.replace(":", "+").replace("@", "-lr")
