"""A time-to-target race (issue 44): the best synchronous baseline, medians over the seeds that
reached (k/n), per-row clocks and error bars, an equal budget that never exceeds the baseline's
clock, the tuning's interior choice, and ``race`` / ``equal_budget`` end to end on a tiny model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from nobubble.app.time_to_target import Variant, error_bar, parse_variants
from nobubble.app.time_to_target_race import budget_steps, summarize
from nobubble.app.time_to_target_report import format_race


def _fake_run(root: Path, seed: int, name: str, curve: list[tuple[float, float]]) -> None:
    run = root / f"seed{seed}" / name
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"config": {"runtime": "dist"}}))
    lines = [
        {
            "step": 10 * (i + 1),
            "tokens": 1000 * (i + 1),
            "elapsed_s": t + 5,
            "train_s": t,
            "val_loss": v,
        }
        for i, (t, v) in enumerate(curve)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def _race(tmp_path: Path) -> dict:
    # zbv trains the same losses as 1f1b in less time: the best synchronous schedule
    for seed in (0, 1):
        _fake_run(tmp_path, seed, "1f1b", [(10.0, 4.0), (20.0, 3.5), (30.0, 3.0)])
        # the same training summed in another order: a final loss off by float rounding
        _fake_run(tmp_path, seed, "zbv", [(8.0, 4.0), (16.0, 3.5), (24.0, 3.000002)])
    _fake_run(tmp_path, 0, "paci", [(6.0, 3.8), (12.0, 3.2), (18.0, 2.9)])  # reaches 3.0
    _fake_run(tmp_path, 1, "paci", [(6.0, 3.9), (18.0, 3.1)])  # never does
    return summarize(tmp_path, parse_variants("paci", ["zbv"]), [0, 1])


def test_the_baseline_is_the_synchronous_schedule_that_reaches_its_own_loss_soonest(tmp_path):
    result = _race(tmp_path)
    assert result["baseline"] == "zbv"
    own = result["best_synchronous"]["own_final_s"]
    assert own == pytest.approx({"1f1b": 30.0, "zbv": 24.0}, rel=1e-4)
    paci = result["variants"]["paci"]
    # 3.2 at 12 s, 2.9 at 18 s: 3.0 two thirds of the way (rel=1e-4: the target's allowance
    # for float rounding, SAME_LOSS)
    reached = 12 + 6 * 0.2 / 0.3
    assert paci["seeds"][0]["vs_best"] == pytest.approx(reached / 24, rel=1e-4)
    assert paci["seeds"][0]["vs_1f1b"] == pytest.approx(reached / 30, rel=1e-4)
    assert paci["seeds"][1]["vs_best"] is None
    # the median over the seeds that got there, with how many did: 1 of 2
    assert paci["vs_best_reached"] == [1, 2] and paci["vs_best_median"] == pytest.approx(
        reached / 24, rel=1e-4
    )
    assert paci["vs_best_interval"] is None  # a seed that never got there: no mean ratio
    assert result["variants"]["1f1b"]["vs_best_median"] == pytest.approx(30 / 24, rel=1e-4)
    assert result["variants"]["zbv"]["vs_1f1b_median"] == pytest.approx(
        24 / 30, rel=1e-4
    )  # it got there


def test_an_equal_budget_race_keeps_the_equal_steps_races_baseline(tmp_path):
    from nobubble.app.time_to_target_race import RaceOptions

    _race(tmp_path)
    kept = summarize(
        tmp_path, parse_variants("paci", ["zbv"]), [0, 1], RaceOptions(baseline="1f1b")
    )
    assert kept["baseline"] == "1f1b" and kept["variants"]["zbv"]["vs_best_median"] < 1


def test_the_table_marks_each_rows_clock_and_the_seeds_that_reached(tmp_path):
    text = format_race(_race(tmp_path))
    paci = next(line for line in text.splitlines() if line.startswith("paci"))
    assert " measured " in paci and "(1/2)" in paci
    assert "best synchronous: zbv" in text


def test_a_projected_row_carries_the_checked_error_of_its_variant_or_schedule():
    check = {
        "free": {"paci": {"time": -0.1, "vs_best": 0.05, "vs_1f1b": 0.02}},
        "with_transfers": {"paci": {"time": 0.01, "vs_best": 0.0, "vs_1f1b": 0.0}},
    }
    bar = error_bar(check, Variant("paci", "ef"), transfer_s=0.0)
    assert bar == {"time": 0.1, "vs_best": 0.05, "vs_1f1b": 0.02, "from": "paci"}
    assert error_bar(check, Variant("paci"), transfer_s=1e-3)["time"] == 0.01
    assert error_bar(check, Variant("2bw"), 0.0)["from"].startswith("the largest")
    assert error_bar(None, Variant("paci"), 0.0) is None


def test_an_equal_budget_rounds_steps_down_never_past_the_baselines_clock():
    def row(*tokens_per_s: float) -> dict:
        return {"seeds": {s: {"tokens_per_s": t} for s, t in enumerate(tokens_per_s)}}

    result = {"baseline": "zbv", "variants": {"zbv": row(100.0, 200.0), "paci": row(135.0, 270.0)}}
    # 1.35 x 150 = 202.5 steps: 180 (rounded down to a multiple of 30), not 210
    assert budget_steps(result, 150, 30) == {"zbv": 150, "paci": 180}
    result["variants"]["1f1b"] = row(80.0, 160.0)  # slower than the baseline: fewer steps
    assert budget_steps(result, 150, 30)["1f1b"] == 120
    slow = {"baseline": "zbv", "variants": {"zbv": row(100.0), "paci": row(1.0)}}
    assert budget_steps(slow, 150, 30)["paci"] == 30  # never below one quantum


# ----- tuning ------------------------------------------------------------------------------------
def test_the_grid_is_geometric_around_its_centre():
    from nobubble.app.time_to_target_tune import lr_grid

    assert lr_grid(0.02, 5, 2.0) == [0.005, 0.01, 0.02, 0.04, 0.08]


def test_a_best_at_an_edge_grows_the_grid_until_it_is_interior(monkeypatch, tmp_path):
    from nobubble.app import time_to_target_tune as tune_mod

    best = 0.0012  # far below the grid around 0.02: the loss is a parabola in log(lr)
    tried: list[float] = []

    def losses(specs, *_):
        tried.extend(s.overrides["lr"] for s in specs)
        return {s.name: math.log(s.overrides["lr"] / best) ** 2 for s in specs}

    monkeypatch.setattr(tune_mod, "_run_losses", losses)
    flags = ["--model", "tiny", "--optimizer", "muon", "--lr", "0.02"]
    tune = tune_mod.Tune(seeds=(100,))
    variants = parse_variants("paci", ["zbv"])
    got = tune_mod.tune_variants(tmp_path, flags, variants, [0], 20, tune)
    paci = got["paci"]
    assert paci["interior"] and paci["chosen"] == 0.00125
    assert paci["grid"] == [0.000625, 0.00125, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08]
    # zbv trains 1f1b's gradients and takes 1f1b's tuning: two grids ran, each lr once
    assert got["zbv"]["tuned_as"] == "1f1b" and got["zbv"]["chosen"] == 0.00125
    assert sorted(tried) == sorted(paci["grid"] * 2)


def test_tuning_on_a_race_seed_is_refused(tmp_path):
    from nobubble.app.time_to_target_tune import Tune, tune_variants

    with pytest.raises(ValueError, match="tune on seeds the race does not use"):
        tune_variants(tmp_path, [], parse_variants("paci"), [0, 100], 20, Tune(seeds=(100,)))


# ----- end to end --------------------------------------------------------------------------------
def test_the_synchronous_contestants_are_those_the_model_can_be_cut_for():
    from nobubble.app.time_to_target_race import sync_contestants

    kept, skipped = sync_contestants(["--model", "tiny", "--stages", "4", "--runtime", "emulate"])
    assert kept == ["1f1b", "zb-h1"]  # tiny's 4 layers cannot make 2 stages per rank on 4 ranks
    assert set(skipped) == {"zbv", "interleaved-1f1b"} and "4 layers" in skipped["zbv"]


@pytest.mark.slow
def test_a_race_and_its_equal_budget_run_end_to_end_on_a_tiny_model(tmp_path):
    from nobubble.app.time_to_target_bench import RaceConfig, run_race
    from nobubble.app.time_to_target_race import LEAVES_OUT

    train = "--runtime emulate --model tiny --vocab-size 512 --seq-len 16 --micro-batch-size 2"
    train += " --microbatches 2 --eval-batches 2 --threads 1"
    cfg = RaceConfig(
        variants="paci",
        seeds=(0,),
        steps=4,
        rounds=1,
        eval_every=2,
        train=tuple(train.split()),
        equal_budget=True,
        sync=False,
        out=tmp_path,
        progress=False,
    )
    both = run_race(cfg)
    same, budget = both["equal_steps"], both["equal_budget"]
    assert same["baseline"] == "1f1b" and list(same["variants"]) == ["1f1b", "paci"]
    for row in same["variants"].values():
        assert row["clock"] == "projected" and row["leaves_out"] == LEAVES_OUT
        assert row["seeds"][0]["steps"] == 4 and len(row["seeds"][0]["curve"]) == 2
    assert same["variants"]["1f1b"]["vs_best_median"] == 1.0
    assert budget["budget_of"] == budget["baseline"] == "1f1b"
    # the budget race trains each variant the steps its throughput buys, rounded down
    assert budget["steps"] == budget_steps(same, 4, 2)
    for label, steps in budget["steps"].items():
        assert budget["variants"][label]["seeds"][0]["steps"] == steps
    assert (
        Path(same["figure"]) == tmp_path / "loss-vs-time-P2.png"
        and Path(same["figure"]).stat().st_size
    )


@pytest.mark.parametrize(
    ("settings", "runtime", "needle"),
    [
        ({"check_projection": True}, "emulate", "give --runtime dist"),
        ({"transfers": True}, "emulate", "give --projection-from FILE"),
        ({"projection_from": "race.json"}, "emulate", "holds no projection check"),
    ],
)
def test_projection_options_that_cannot_work_are_refused(tmp_path, settings, runtime, needle):
    from nobubble.app.time_to_target_bench import RaceConfig, options

    (tmp_path / "race.json").write_text(json.dumps({"equal_steps": {"variants": {}}}))
    if "projection_from" in settings:
        settings = {"projection_from": tmp_path / settings["projection_from"]}
    with pytest.raises(ValueError, match=needle):
        options(RaceConfig(**settings), runtime)


def test_a_tuning_grid_too_small_or_too_coarse_is_refused():
    from nobubble.app.time_to_target_tune import Tune

    with pytest.raises(ValueError, match="at least 5"):
        Tune(points=3)
    with pytest.raises(ValueError, match=r"between 1\.4 and 2\.5"):
        Tune(factor=4.0)


def test_a_saved_race_shown_again_carries_a_later_checks_error_bars(tmp_path):
    """``--show`` reads a race's JSON back and applies ``--projection-from``'s bars to its
    projected rows only, without training; several races make one row per race and variant."""
    from nobubble.app.time_to_target_bench import load_race, verdict_rows
    from nobubble.app.time_to_target_report import format_verdicts

    result = _race(tmp_path / "runs") | {"stages": 8, "microbatches": 8, "optimizer": "muon"}
    result["variants"]["paci"]["clock"] = "projected"
    saved, check = tmp_path / "p8-muon.json", tmp_path / "check.json"
    saved.write_text(json.dumps(result))
    errors = {"paci": {"time": 0.2, "vs_best": 0.1, "vs_1f1b": 0.05}}
    check.write_text(json.dumps({"projection_check": {"free": errors, "with_transfers": errors}}))
    shown = load_race(saved, check)
    assert shown["variants"]["paci"]["error_bar"]["vs_best"] == 0.1
    assert "error_bar" not in shown["variants"]["zbv"]  # a measured row gets no bar
    (row,) = [r for r in verdict_rows({"p8-muon": shown}) if r["variant"] == "paci"]
    assert (row["stages"], row["optimizer"], row["baseline"]) == (8, "muon", "zbv")
    median = shown["variants"]["paci"]["vs_best_median"]
    line = next(ln for ln in format_verdicts([row]).splitlines() if "paci" in ln)
    assert "paci" in format_race(shown)  # the seeds read back as the race wrote them
    assert f"{median:.3f} ±{0.1 * median:.3f} (1/2)" in line
    lean = {"equal_steps": shown, "equal_budget": {**shown, "variants": {}}}  # all left out
    assert all("budget_median" not in r for r in verdict_rows({"lean": lean}))
    with pytest.raises(ValueError, match="older format"):
        old = {"equal_steps": {"variants": {"paci": {}}}, "equal_budget": {"variants": {}}}
        saved.write_text(json.dumps(old))
        load_race(saved)


def test_a_lean_budget_keeps_the_tuned_lrs_and_drops_the_slower_synchronous_schedules():
    from nobubble.app.time_to_target_race import _lean

    variants = parse_variants("paci,paci:ef", ["zbv", "zb-h1", "interleaved-1f1b"])
    tuning = {v.label: {"chosen": 0.01 * (i + 1)} for i, v in enumerate(variants)}
    kept = _lean(variants, {"baseline": "zbv", "tuning": tuning})
    assert [v.label for v in kept] == ["1f1b", "paci", "paci:ef", "zbv"]
    assert [v.tuned_lr for v in kept] == [tuning[v.label]["chosen"] for v in kept]


def test_shown_against_another_schedule_every_ratio_is_taken_against_its_run(tmp_path):
    """``--show FILE --against 1f1b``: the ratios against 1f1b's run although zbv is the best
    synchronous schedule, per seed from the saved curves; an unknown schedule is refused."""
    from nobubble.app.time_to_target_bench import load_race, rebase, verdict_rows
    from nobubble.app.time_to_target_report import format_verdicts

    saved = tmp_path / "race.json"
    saved.write_text(json.dumps(_race(tmp_path / "runs")))
    shown = rebase(load_race(saved), "1f1b")
    assert shown["baseline"] == "1f1b" and shown["best_synchronous"]["best"] == "zbv"
    paci = shown["variants"]["paci"]
    reached = 12 + 6 * 0.2 / 0.3  # 3.2 at 12 s, 2.9 at 18 s: 1f1b's 3.0 two thirds on
    assert paci["seeds"][0]["vs_best"] == pytest.approx(reached / 30, rel=1e-4)
    assert paci["vs_best_reached"] == [1, 2]
    # zbv ends 2e-6 above 1f1b, within the allowance: it reaches 1f1b's loss at its own end
    assert shown["variants"]["zbv"]["vs_best_median"] == pytest.approx(24 / 30, rel=1e-4)
    assert "target: each seed's 1f1b final validation loss (--against)" in format_race(shown)
    header = format_verdicts(verdict_rows({"race": shown})).splitlines()[0]
    assert "against" in header and "best sync" not in header  # the column names what it is
    with pytest.raises(ValueError, match="--against zb-h1: not a schedule of this race"):
        rebase(load_race(saved), "zb-h1")
