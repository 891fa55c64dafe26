"""Time to target (issues 34, 44): the crossing rule, the variants' spelling and refusals, the
training clock that leaves validations out, the projected clock, a race's summary against the
best synchronous schedule, the equal budget's rounding, the tuning's grid and a race end to end."""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path

import pytest

from nobubble.app.time_to_target import (
    Variant,
    crossing,
    parse_variants,
    projected_times,
    val_curve,
)
from nobubble.core.schedules import build_schedule
from nobubble.core.sim import CostModel, simulate


# ----- the crossing rule --------------------------------------------------------------------------
def test_crossing_interpolates_between_the_evaluations_around_the_target():
    points = [(10.0, 5.0), (20.0, 4.0), (30.0, 3.0)]
    assert crossing(points, 3.5) == pytest.approx(25.0)  # halfway from 4.0 to 3.0
    assert crossing(points, 4.0) == 20.0  # reached exactly at an evaluation
    assert crossing(points, 6.0) == 10.0  # already there at the first evaluation
    assert crossing(points, 2.9) is None  # never reached: not extrapolated


def test_crossing_takes_the_first_time_a_noisy_curve_gets_there():
    points = [(1.0, 5.0), (2.0, 3.0), (3.0, 4.0), (4.0, 2.0)]
    assert crossing(points, 3.5) == pytest.approx(1.75)


def test_the_curve_reads_the_training_clock_and_only_evaluated_steps():
    records = [
        {"step": 1, "elapsed_s": 1.0, "train_s": 1.0, "tokens": 10},
        {"step": 2, "elapsed_s": 2.0, "train_s": 2.0, "tokens": 20, "val_loss": 4.0},
        {"step": 3, "elapsed_s": 9.0, "train_s": 3.0, "tokens": 30, "val_loss": 3.0},
    ]
    assert val_curve(records) == [(2.0, 4.0), (3.0, 3.0)]
    assert val_curve(records, {2: 20.0, 3: 30.0}) == [(20.0, 4.0), (30.0, 3.0)]
    old = [{"step": 2, "elapsed_s": 5.0, "tokens": 1, "val_loss": 4.0}]  # before train_s
    assert val_curve(old) == [(5.0, 4.0)]


# ----- variants -----------------------------------------------------------------------------------
def test_variants_round_trip_and_always_start_with_the_baseline():
    variants = parse_variants("paci:predict@0.008, 2bw:ef ,paci")
    assert [v.label for v in variants] == ["1f1b", "paci:predict@0.008", "2bw:ef", "paci"]
    assert variants[1] == Variant("paci", "predict", 0.008)
    assert variants[1].flags() == ["--schedule", "paci", "--correction", "predict", "--lr", "0.008"]
    assert [v.label for v in parse_variants("1f1b,paci")] == ["1f1b", "paci"]


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("pacy", "schedule 'pacy' is unknown"),
        ("paci:spectrain", "'paci:spectrain': correction='spectrain' is unknown"),
        ("paci@fast", "'fast' after @ is not a learning rate"),
        ("paci@-1", "must be > 0"),
        ("paci,paci", "twice"),
    ],
)
def test_a_bad_variant_is_refused_with_the_spelling(text, needle):
    with pytest.raises(ValueError, match=needle):
        parse_variants(text)


# ----- the clocks ---------------------------------------------------------------------------------
def _train(tmp_path: Path, name: str, *flags: str) -> Path:
    from nobubble.cli import main

    out = tmp_path / name
    common = "--model tiny --vocab-size 512 --seq-len 16 --micro-batch-size 2 --steps 4"
    common += " --eval-every 2 --eval-batches 2 --sample-tokens 0 --threads 1 --no-progress"
    assert main(["train", *common.split(), *flags, "--out", str(out)]) == 0
    return out


@pytest.mark.slow
def test_validation_is_off_the_training_clock_and_the_projection_replays_the_schedule(tmp_path):
    run = _train(tmp_path, "paci", "--schedule", "paci", "--stages", "2")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for before, after in itertools.pairwise(records):
        paused = (after["elapsed_s"] - before["elapsed_s"]) - (after["train_s"] - before["train_s"])
        # the validation of a drain point is paused; between other steps nothing is
        assert paused > 0 if "val_loss" in before else paused == pytest.approx(0.0, abs=1e-9)
    durations = json.loads((run / "action_costs.json").read_text())["durations_s"]
    assert set(durations) == {"0", "1"} and set(durations["0"]) == {"F", "B", "STEP"}
    assert [len(durations["1"][k]) for k in ("F", "B", "STEP")] == [16, 16, 4]  # M=4, 4 steps
    costs = {s: {k: statistics.median(v) for k, v in d.items()} for s, d in durations.items()}
    # the projection is the simulator's timeline of the run's schedule under those costs
    schedule = build_schedule("paci", 2, 4, 4, 4, drain_at=[2])
    model = CostModel(
        fwd=(costs["0"]["F"], costs["1"]["F"]),
        bwd=(costs["0"]["B"], costs["1"]["B"]),
        step=(costs["0"]["STEP"] + costs["1"]["STEP"]) / 2,
    )
    makespan = simulate(schedule, model).metrics.makespan
    times = projected_times(run)
    assert sorted(times) == [1, 2, 3, 4]
    assert times[4] == pytest.approx(makespan)
    assert times[1] < times[2] < times[3] < times[4]


def test_a_split_backward_is_projected_as_its_input_and_weight_halves(tmp_path):
    from nobubble.app.time_to_target import stage_costs

    durations = {
        "0": {"F": [1.0, 3.0, 2.0], "W": [4.0], "STEP": [0.5]},  # the first stage: no I
        "1": {"F": [2.0], "I": [1.0, 1.0], "W": [3.0], "STEP": [1.5]},
    }
    (tmp_path / "action_costs.json").write_text(json.dumps({"durations_s": durations}))
    model = stage_costs(tmp_path, transfer_s=0.25)
    assert model.fwd == (2.0, 2.0) and model.bwd == (4.0, 4.0) and model.wgrad == (4.0, 3.0)
    assert model.step == 1.0 and model.transfer() == 0.25
    fused = {str(s): {"F": [1.0], "B": [2.0], "STEP": [0.0]} for s in range(2)}
    (tmp_path / "action_costs.json").write_text(json.dumps({"durations_s": fused}))
    assert stage_costs(tmp_path).bwd == (2.0, 2.0) and stage_costs(tmp_path).wgrad is None
