"""The experiment grids and the runner's run keys: enough seeds for every verdict pair, the
regimes' definitions, and keys that change with what a run computes and only with that."""

from __future__ import annotations

import itertools
import re

import pytest

from nobubble.app.experiments import (
    grids,
    keys,
    runner,
    stats,
)
from nobubble.app.experiments.experiment import GRIDS
from nobubble.app.experiments.runner import RunSpec

# ----- grids -----------------------------------------------------------------------------------


@pytest.mark.parametrize("profile", [grids.FULL, grids.LONG], ids=["short", "long"])
def test_every_verdict_pair_has_enough_seeds_in_the_full_grids(profile):
    lrs = {opt: profile.lr_grid[opt][0] for opt in profile.optimizers}
    assert profile.seeds >= stats.MIN_SEEDS
    for make in [GRIDS[e] for e in profile.experiments]:
        seeds: dict[tuple, set[int]] = {}
        for spec in make(profile, lrs, profile.seeds):
            labels = dict(spec.labels)
            side = labels.get("study") or labels.get("runtime") or labels.get("lam", 1.0) != 1.0
            if side or "seed" not in labels:  # side studies carry no verdict
                assert side, f"{spec.name}: a verdict run without a seed label"
                continue
            seed = labels.pop("seed")
            seeds.setdefault(tuple(sorted(labels.items())), set()).add(seed)
        assert seeds, make.__name__
        assert all(len(s) >= stats.MIN_SEEDS for s in seeds.values()), (make.__name__, seeds)


# ----- run keys --------------------------------------------------------------------------------
BASE = {**grids.QUICK.base}


def test_run_key_is_readable_and_stable():
    spec = RunSpec("2bw-adamw-s0", {"optimizer": "adamw", "schedule": "2bw", "stages": 1})
    key = runner.run_key(spec, BASE, code="v1")
    assert re.fullmatch(r"2bw-adamw-s0-[0-9a-f]{8}", key)
    assert runner.run_key(spec, dict(BASE), code="v1") == key


@pytest.mark.parametrize(
    ("field", "value"), [("lr", 1e-4), ("weight_decay", 0.0), ("momentum", 0.9), ("dtype", "bf16")]
)
def test_a_changed_setting_changes_the_key(field, value):
    spec = RunSpec("run", {"optimizer": "adamw", "stages": 1})
    changed = RunSpec("run", {**spec.overrides, field: value})
    assert runner.run_key(changed, BASE, code="v1") != runner.run_key(spec, BASE, code="v1")


def test_the_key_covers_the_resolved_config_only():
    spec = RunSpec("run", {"optimizer": "adamw", "stages": 1})
    explicit_default = RunSpec("run", {**spec.overrides, "weight_decay": 0.1, "out": "x"})
    assert runner.run_key(explicit_default, BASE, code="v1") == runner.run_key(spec, BASE, "v1")


def test_a_changed_code_version_changes_the_key(monkeypatch):
    spec = RunSpec("run", {"optimizer": "adamw", "stages": 1})
    monkeypatch.setattr(keys, "code_version", lambda: "before")
    before = runner.run_key(spec, BASE)
    monkeypatch.setattr(keys, "code_version", lambda: "after")
    assert runner.run_key(spec, BASE) != before


def test_code_version_ignores_comments_and_docstrings_not_code(tmp_path):
    module = tmp_path / "optim" / "step.py"
    module.parent.mkdir()
    module.write_text('"""Doc."""\nLR = 1\n')
    version = keys.code_version(tmp_path)
    module.write_text('"""Another doc."""\n# a comment\nLR = (\n    1\n)\n')
    assert keys.code_version(tmp_path) == version
    module.write_text('"""Doc."""\nLR = 2\n')
    assert keys.code_version(tmp_path) != version
    (tmp_path / "app" / "experiments").mkdir(parents=True)
    (tmp_path / "app" / "experiments" / "report.py").write_text("X = 1\n")  # not training code
    module.write_text('"""Doc."""\nLR = 1\n')
    assert keys.code_version(tmp_path) == version


def test_training_sources_cover_the_numerics_and_skip_the_readers():
    names = set(keys.training_sources())
    for name in ("model/gpt.py", "optim/build.py", "engine/worker.py", "core/schedules/paci.py"):
        assert name in names
    for name in (
        "core/ir.py",
        "core/deps.py",
        "core/ledger.py",
        "app/train/config.py",
        "app/train/trainer.py",
    ):
        assert name in names
    assert not any(n.startswith(("app/experiments/", "core/viz/")) for n in names)


def _resolved(spec: RunSpec, profile: grids.Profile):
    from nobubble.app.train.config import TrainConfig

    return TrainConfig.from_mapping({**profile.base, **spec.overrides})


def test_depth_grid_is_paper_a_section_6():
    """clip 0 for every run, one sync and one 2bw run per seed (P=1), PipeDream at B/P sequences
    per update for P times the updates on the same tokens and validation windows, Muon at 0.99."""
    profile = grids.FULL
    specs = grids.depth(profile, {"adamw": 1e-2, "muon": 1e-2}, 3)
    cfgs = {s.name: _resolved(s, profile) for s in specs}
    assert all(c.optimizer.clip == 0 for c in cfgs.values())
    muon = [c for c in cfgs.values() if c.optimizer.optimizer == "muon"]
    adamw = [c for c in cfgs.values() if c.optimizer.optimizer == "adamw"]
    assert muon and all(c.optimizer.momentum == 0.99 for c in muon)
    assert adamw and all(c.optimizer.momentum == 0.95 for c in adamw)
    base = [s for s in specs if s.labels["schedule"] in ("1f1b", "2bw")]
    assert len(base) == 2 * 2 * 3 and all(s.overrides["stages"] == 1 for s in base)
    sync = cfgs["depth-1f1b-adamw-s0"]
    tokens = sync.run.steps * sync.tokens_per_step
    windows = sync.run.eval_batches * sync.run.micro_batch_size
    for p in profile.depths:
        pd = cfgs[f"depth-pipedream-none-adamw-P{p}-s0"]
        assert (pd.schedule.schedule, pd.num_ranks, pd.num_microbatches) == ("pipedream", p, 1)
        assert pd.run.micro_batch_size * p == sync.num_microbatches * sync.run.micro_batch_size
        assert pd.run.steps == p * sync.run.steps and pd.run.steps * pd.tokens_per_step == tokens
        assert pd.run.eval_every * sync.run.steps == pd.run.steps * sync.run.eval_every
        assert pd.run.eval_batches * pd.run.micro_batch_size == windows


def test_depths_that_do_not_divide_the_batch_are_refused_before_any_run(tmp_path, capsys):
    from nobubble.cli import main

    out = tmp_path / "x"
    assert main(["experiment", "depth", "--depths", "3", "--out", str(out)]) == 2
    assert "depth 3 does not divide the update batch of 16 sequences" in capsys.readouterr().err
    assert not out.exists()


def test_the_longer_regime_is_20_tokens_per_parameter_with_a_x2_lr_grid():
    from nobubble.model import model_config

    profile = grids.LONG
    b = profile.base
    params = model_config(b["model"], b["vocab_size"], b["seq_len"]).num_params()
    tokens = b["steps"] * b["microbatches"] * b["micro_batch_size"] * b["seq_len"]
    assert 250_000 <= params <= 350_000 and b["vocab_size"] == 512
    assert b["microbatches"] * b["micro_batch_size"] == 32 and b["seq_len"] == 128
    assert 19 <= tokens / params <= 21
    assert profile.experiments == ("error-feedback", "paci", "lr-gap", "corrections")
    assert "soap" in profile.optimizers
    for grid in profile.lr_grid.values():
        assert all(hi / lo == pytest.approx(2.0) for lo, hi in itertools.pairwise(grid))
    sweep = grids.lr_sweep(profile)
    assert {(s.overrides["schedule"], s.overrides["stages"]) for s in sweep} == {("1f1b", 1)}
    lrs = {opt: 3e-3 for opt in profile.optimizers}
    ef = grids.error_feedback(profile, lrs, 3)
    assert {s.labels.get("correction") for s in ef} == {None, "ef"}  # sync, 2bw, 2bw + EF
    paci = grids.paci(profile, lrs, 3)
    assert {s.overrides.get("runtime", "emulate") for s in paci} == {"emulate"}
    pairs = [s for s in paci if "arm" not in s.labels]
    assert {(s.labels["optimizer"], s.labels["a"], s.overrides["clip"]) for s in pairs} == {
        ("adamw", 4, 0.0)
    }


def test_the_longer_regime_defines_only_its_two_claims(tmp_path, capsys):
    from nobubble.cli import main

    out = tmp_path / "x"
    assert main(["experiment", "depth", "--regime", "long", "--out", str(out)]) == 2
    assert (
        "--regime long defines error-feedback, paci, lr-gap, corrections, not depth"
        in capsys.readouterr().err
    )
    assert not out.exists()


def test_grid_seconds_counts_each_run_once():
    ones = {key: 1.0 for key in grids.LONG_SECONDS_PER_STEP}
    cost = grids.grid_seconds(grids.LONG, ones)
    lrs = {opt: grids.LONG.lr_grid[opt][0] for opt in grids.LONG.optimizers}
    names = {s.name for s in grids.lr_sweep(grids.LONG)}
    names |= {s.name for s in grids.error_feedback(grids.LONG, lrs, 3)}
    names |= {s.name for s in grids.paci(grids.LONG, lrs, 3)}
    names |= {s.name for s in grids.corrections(grids.LONG, lrs, 3)}  # lr-gap's included
    assert sum(cost.values()) == len(names) * grids.LONG.base["steps"]


def test_the_code_version_covers_the_optimizer_librarys_version(monkeypatch):
    import importlib.metadata

    before = keys.code_version()
    real = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata,
        "version",
        lambda name: "0.0.1" if name == "pytorch-optimizer" else real(name),
    )
    assert keys.code_version() != before
