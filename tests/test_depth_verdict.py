"""The depth study's grid (issue 44 item 4, ``nobubble experiment depth-verdict --regime
depth``): its pruning rule as its docstring states it, the same tokens in every run, and the
dry run's count and estimate. The runs themselves are not tests (about a day of two cores)."""

from __future__ import annotations

import itertools

from nobubble.app.experiments.grids_depth import (
    DEPTH,
    DEPTH_SECONDS_PER_STEP,
    VERDICT,
    depth_verdict,
)
from nobubble.app.experiments.profiles import sweep_key
from nobubble.cli import main

OPTIMIZERS = ("muon", "adamw", "rotation", "nadam-delay")
SEEDS = range(3)


def _grid():
    return depth_verdict(DEPTH, {o: 1e-3 for o in DEPTH.optimizers}, 3)


def _setting(spec, key):
    return spec.overrides.get(key, DEPTH.base[key])


def test_the_verdict_cell_runs_complete_and_every_other_cell_paci_as_pruned():
    specs = _grid()
    asynchronous = [s for s in specs if "stages" in s.labels]
    verdict = {
        (s.labels["optimizer"], s.labels["schedule"], s.labels["correction"], s.labels["seed"])
        for s in asynchronous
        if (s.labels["stages"], s.labels["microbatches"]) == VERDICT
    }
    schedules, corrections = ("paci", "2bw", "pipedream"), ("none", "ef", "predict")
    assert verdict == set(itertools.product(OPTIMIZERS, schedules, corrections, SEEDS))
    elsewhere = {
        (
            s.labels["stages"],
            s.labels["microbatches"],
            s.labels["optimizer"],
            s.labels["correction"],
        )
        for s in asynchronous
        if (s.labels["stages"], s.labels["microbatches"]) != VERDICT
    }
    cells = {(p, m) for p in (2, 4, 8, 16) for m in (p, 2 * p)} - {VERDICT}
    pruned = {(o, c) for o in ("muon", "rotation") for c in corrections}
    pruned |= {("adamw", "none"), ("nadam-delay", "none")}
    assert elsewhere == {(p, m, o, c) for p, m in cells for o, c in pruned}
    assert all(
        s.labels["schedule"] == "paci"
        for s in asynchronous
        if (s.labels["stages"], s.labels["microbatches"]) != VERDICT
    )
    assert len(asynchronous) == 108 + 7 * 8 * 3
    sync = [s for s in specs if "stages" not in s.labels]
    assert all(s.overrides["schedule"] == "1f1b" and s.overrides["stages"] == 1 for s in sync)
    keys = {(s.labels["microbatches"], s.labels["optimizer"], s.labels["seed"]) for s in sync}
    assert keys == set(itertools.product((2, 4, 8, 16, 32), OPTIMIZERS, SEEDS))
    assert len(sync) == 60
    assert len({s.name for s in specs}) == len(specs)


def test_every_run_trains_and_validates_on_the_same_sequences():
    for spec in _grid():
        b, m = _setting(spec, "micro_batch_size"), _setting(spec, "microbatches")
        assert b * m == 32 and b * _setting(spec, "eval_batches") == 32, spec.name
        if spec.overrides["schedule"] in ("paci", "pipedream"):
            assert spec.overrides["accum"] == m, spec.name  # one update per step
        assert _setting(spec, "clip") == 0.0 and _setting(spec, "steps") == 200


def test_the_synchronous_m8_seed0_runs_are_the_sweeps():
    lrs = {o: DEPTH.lr_grid[o][2] for o in OPTIMIZERS}
    names = {s.name for s in depth_verdict(DEPTH, lrs, 3)}
    assert {sweep_key(o, lrs[o]) for o in OPTIMIZERS} <= names


def test_the_dry_run_lists_and_prices_the_grid_and_runs_nothing(tmp_path, capsys):
    out = tmp_path / "x"
    argv = ["experiment", "depth-verdict", "--regime", "depth", "--dry-run", "--out", str(out)]
    assert main(argv) == 0
    t = DEPTH_SECONDS_PER_STEP
    per_step = {  # runs by their step time, counted from the docstring's rule
        t[1, 8]: 60 - 4 + 20,  # the baselines (4 of them the sweep's) and the sweep
        t[8, 8]: 108 + 24,  # the verdict cell and (8, 16)
        t[2, 2]: 24 + 24,  # (2, 2), (2, 4)
        t[4, 4]: 24 + 24,
        t[16, 16]: 24,
        t[16, 32]: 24,
    }
    hours = sum(seconds * n * 200 for seconds, n in per_step.items()) / 3600
    printed = capsys.readouterr().out
    assert f"352 runs, 20 of them the learning-rate sweep; estimated {hours:.1f} h" in printed
    assert not out.exists()


def test_every_run_of_the_grid_is_a_valid_training_config():
    """Each run's settings pass TrainConfig's checks (schedule, correction, optimizer and M
    together), so no run of the long grid fails on its config."""
    from nobubble.app.train.config import TrainConfig

    for spec in depth_verdict(DEPTH, {o: 1e-3 for o in DEPTH.optimizers}, 1):
        TrainConfig.of(**{**DEPTH.base, **spec.overrides})
