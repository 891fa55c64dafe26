"""Smoke tests of `nobubble experiment ... --quick`: files, keys and finite numbers.

The full experiments are not tests (they take about an hour each); their results live in
docs/results.md.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from nobubble.app.experiments import grids, runner
from nobubble.cli import main
from nobubble.core.errors import NobubbleError
from nobubble.data import fetch_shakespeare

pytestmark = pytest.mark.slow


def _finite(x) -> bool:
    if isinstance(x, dict):
        return all(_finite(v) for v in x.values())
    if isinstance(x, list):
        return all(_finite(v) for v in x)
    if isinstance(x, float):
        return math.isfinite(x)
    return True


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    out = tmp_path_factory.mktemp("experiments")
    for name in ("delay-vs-optimizer", "error-feedback", "depth", "paci"):
        assert (
            main(["experiment", name, "--quick", "--seeds", "1", "--out", str(out), "--json"]) == 0
        )
    for name in LONG:  # the longer regime's grids at the quick sizes; they share the runs folder
        argv = ["experiment", name, "--quick", "--regime", "long", "--seeds", "1"]
        assert main([*argv, "--out", str(out), "--json"]) == 0
    return out


LONG = ("error-feedback", "paci")


def test_quick_experiments_write_their_files(root):
    for name in ("delay-vs-optimizer", "error-feedback", "depth", "paci"):
        summary = json.loads((root / name / "summary.json").read_text())
        assert summary["experiment"] == name and summary["profile"] == "quick"
        assert (root / name / "table.md").read_text().startswith(f"# {name}")
        for fig in summary["figures"]:
            assert (root / name / fig).read_bytes()[:4] == b"\x89PNG"
        assert _finite({k: v for k, v in summary.items() if k != "base"})
    lr = json.loads((root / "lr-sweep" / "lr.json").read_text())
    assert set(lr["best"]) == {"adamw", "muon"}
    for name in LONG:
        summary = json.loads((root / f"{name}-long" / "summary.json").read_text())
        assert summary["experiment"] == name and summary["profile"] == "quick-long"
        assert _finite({k: v for k, v in summary.items() if k != "base"})
    long_lr = json.loads((root / "lr-sweep-long" / "lr.json").read_text())
    assert set(long_lr["val_loss"]["adamw"]) == {"0.0015", "0.003"}


def test_run_folders_carry_the_hash_of_their_config_and_code(root):
    runs = [p for p in (root / "runs").iterdir() if p.is_dir()]
    assert runs
    for run in runs:
        assert re.fullmatch(r".+-[0-9a-f]{8}", run.name), run.name
        key = json.loads((run / "key.json").read_text())
        assert {"config", "code"} <= set(key) and "out" not in key["config"]


def test_quick_summaries_have_the_reported_keys(root):
    delay = json.loads((root / "delay-vs-optimizer" / "summary.json").read_text())
    for row in delay["optimizers"].values():
        assert {"sync", "delayed", "gap"} <= set(row)
    ef = json.loads((root / "error-feedback" / "summary.json").read_text())
    for row in ef["optimizers"].values():
        assert {"gap_none", "ef", "sync-warmup", "lam_sweep_gap"} <= set(row)
    depth = json.loads((root / "depth" / "summary.json").read_text())
    assert set(depth["gaps"]["adamw"]) == {"pipedream", "pipedream+EF", "2bw"}
    assert set(depth["gaps"]["muon"]["pipedream"]) == {"2", "4"}
    assert set(depth["growth"]["adamw"]) == {"pipedream", "pipedream+EF"}
    ef_long = json.loads((root / "error-feedback-long" / "summary.json").read_text())
    for row in ef_long["optimizers"].values():  # EF only: no sync start, no lam sweep
        assert "ef" in row and "sync-warmup" not in row
    paci_long = json.loads((root / "paci-long" / "summary.json").read_text())
    assert [(p["optimizer"], p["a"]) for p in paci_long["pairs"]] == [("adamw", 4)]
    assert paci_long["measured"] is None and paci_long["lower_lr"] == []
    paci = json.loads((root / "paci" / "summary.json").read_text())
    assert {p["a"] for p in paci["pairs"] if p["optimizer"] == "adamw"} == {2, 4}
    assert paci["measured"]["seconds_to_target"]["paci"] is not None
    # the smaller-step side study: a tenth of the tuned lr (the quick grid has nothing below)
    assert [r["lr"] for r in paci["lower_lr"]] == [pytest.approx(3e-4)]
    assert all(math.isfinite(r["diff"]) for r in paci["lower_lr"])
    # the three arms of paci at a=4 (issue 12, item 4); paper B ran the bf16 one
    arms = paci["arms"]
    assert set(arms["arms"]) == {"fp32", "bf16", "pipedream"} and arms["paper_b_arm"] == "bf16"
    assert "minus_flush_bf16" in arms["arms"]["bf16"]


def test_finished_runs_are_reused_not_redone(root):
    runs = root / "runs"
    stamps = {p: p.stat().st_mtime for p in runs.glob("*/summary.json")}
    assert (
        main(
            [
                "experiment",
                "delay-vs-optimizer",
                "--quick",
                "--seeds",
                "1",
                "--out",
                str(root),
                "--json",
            ]
        )
        == 0
    )
    assert {p: p.stat().st_mtime for p in runs.glob("*/summary.json")} == stamps


def test_a_grid_for_some_optimizers_reuses_their_runs_and_the_report_names_the_rest(root, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(root, out)
    stamps = {p: p.stat().st_mtime for p in (out / "runs").glob("*/summary.json")}
    argv = ["experiment", "depth", "--quick", "--seeds", "1", "--optimizers", "adamw"]
    assert main([*argv, "--out", str(out), "--json"]) == 0
    # every adamw run of the depth grid has the same key as in the full grid: nothing reran
    assert {p: p.stat().st_mtime for p in (out / "runs").glob("*/summary.json")} == stamps
    summary = json.loads((out / "depth" / "summary.json").read_text())
    assert summary["optimizers_run"] == ["adamw"] and summary["left_out"] == ["muon"]
    assert set(summary["gaps"]) == {"adamw"}
    # the sweep still covers every optimizer: the other experiments' lrs are not narrowed
    assert set(json.loads((out / "lr-sweep" / "lr.json").read_text())["best"]) == {"adamw", "muon"}
    target = tmp_path / "results.md"
    assert main(["experiment", "report", "--out", str(out), "--report-to", str(target)]) == 0
    text = target.read_text()
    assert "`nobubble experiment depth --seeds 1 --quick --optimizers adamw`" in text
    assert "no verdict for muon: left out of this run of the grid" in text


def test_report_collects_every_experiment(root, tmp_path):
    target = tmp_path / "results.md"
    assert main(["experiment", "report", "--out", str(root), "--report-to", str(target)]) == 0
    text = target.read_text()
    for title in ("One-step delay", "Error feedback", "PipeDream vs 2BW", "PACI vs 1F1B"):
        assert title in text
    assert "## Method and budget" in text
    for name in LONG:
        assert f"Command: `nobubble experiment {name} --regime long --seeds 1 --quick`" in text
    assert "**Verdict:**" in text
    assert text.index("## Verdict rules") < text.index("## One-step delay")
    assert "inconclusive (1 seed; R4)" in text  # the quick profile runs one seed
    assert "arm bf16 (paper B's setting: bf16 autocast): paci bf16 a=4 - flush bf16" in text
    assert "| pipedream | stashed:" in text
    assert list((tmp_path / "img" / "results").glob("*.png"))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["paci", "--depths", "2"], "--depths is an option of the depth experiment"),
        (["depth", "--depths", "2,x"], "expected a comma list of stage counts"),
        (["depth", "--depths", "0"], "expected a comma list of stage counts"),
        (["depth", "--optimizers", "sgd"], "sgd is not an optimizer of the full profile"),
        (["depth", "--optimizers", "nadam,lion"], "the depth grid runs adamw,muon only"),
        (["depth", "--optimizers", "adamw,adamw"], "distinct optimizer names"),
        (["report", "--optimizers", "adamw"], "--optimizers is an option of the experiments"),
    ],
)
def test_bad_depths_or_optimizers_fail_before_any_run(argv, message, tmp_path, capsys):
    try:  # argparse exits for a malformed value; the experiment returns 2 for a misplaced one
        code = main(["experiment", *argv, "--out", str(tmp_path / "x")])
    except SystemExit as exit_info:
        code = exit_info.code
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


MEASURED = (
    "elapsed_s",
    "train_s",
    "utilization",
    "bubble_share",
    "steady_utilization",
    "tokens_per_s",
)


def _computed(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if k not in MEASURED} for x in lines]


def test_a_run_forked_by_the_runner_equals_a_separate_nobubble_train(tmp_path):
    """The runner forks each run from a warm server; the reference is the same config given to
    ``python -m nobubble train --config`` in a new interpreter: bitwise the same numbers."""
    spec = runner.RunSpec(
        "2bw-ef-muon",
        {
            "schedule": "2bw",
            "correction": "ef",
            "lr": 1e-2,
            "optimizer": "muon",
            "steps": 4,
            "eval_every": 2,
        },
    )
    outcome = runner.run_grid([spec], grids.QUICK.base, tmp_path / "runs", progress=False)
    config = {**grids.QUICK.base, **spec.overrides, "progress": False, "out": str(tmp_path / "ref")}
    (tmp_path / "ref.json").write_text(json.dumps(config))
    done = subprocess.run(
        [sys.executable, "-m", "nobubble", "train", "--config", str(tmp_path / "ref.json")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    forked = outcome["2bw-ef-muon"].run_dir
    assert [r["step"] for r in _computed(forked)] == [1, 2, 3, 4]
    assert _computed(forked) == _computed(tmp_path / "ref")
    assert "loading cached BPE tokenizer" in (forked.parent / f"{forked.name}.log").read_text()


def test_a_failed_run_names_its_status_and_the_end_of_its_log(tmp_path):
    (tmp_path / "empty.txt").write_text("")  # refused by the run itself, in its own process
    spec = runner.RunSpec("bad", {"data": str(tmp_path / "empty.txt")})
    with pytest.raises(NobubbleError, match=r"run bad-[0-9a-f]{8} failed \(status 2\)") as err:
        runner.run_grid([spec], grids.QUICK.base, tmp_path / "runs", progress=False)
    assert "is empty; give a file with text in it" in str(err.value)
    assert not list((tmp_path / "runs").glob("*/summary.json"))


GRID_SCRIPT = """
import signal, sys
from pathlib import Path
signal.signal(signal.SIGINT, signal.SIG_IGN)  # as under `nohup ... &` from a script
from nobubble.app.experiments import grids, runner
spec = runner.RunSpec("endless", {"steps": 100_000, "eval_every": 50_000})
runner.run_grid([spec], grids.QUICK.base, Path(sys.argv[1]), progress=False)
"""


def _holding(path) -> list[int]:
    """Processes with ``path`` open (a run's process writes its log on stdout and stderr)."""
    holders = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}") == str(path):
                        holders.append(int(pid))
                        break
    return holders


def test_a_grid_stopped_by_sigterm_stops_its_runs(tmp_path):
    """SIGTERM to a grid (a scheduler's stop, `kill`): the run it had started gets Ctrl-C, stops
    (resumable from its checkpoint) and leaves no process behind; the grid exits with 143. The
    grid ignores SIGINT, as a background job of a script does: its runs must stop all the same
    (they inherit the disposition; killed after the grace period, they would not say
    "interrupted")."""
    runs = tmp_path / "runs"
    grid = subprocess.Popen([sys.executable, "-c", GRID_SCRIPT, str(runs)])
    try:
        deadline = time.monotonic() + 120
        logs: list = []
        while not logs or "optimizer routing" not in logs[0].read_text():  # training started
            assert grid.poll() is None and time.monotonic() < deadline, "the run never started"
            time.sleep(0.05)
            logs = list(runs.glob("endless-*.log"))
        child = _holding(logs[0])
        assert child, "no process writes the run's log"
        grid.send_signal(signal.SIGTERM)
        assert grid.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if grid.poll() is None:
            grid.kill()
    assert _holding(logs[0]) == [], "a run outlived its grid"
    assert "interrupted" in logs[0].read_text()
    assert not list(runs.glob("*/summary.json"))


def test_a_forked_run_gets_the_environment_of_its_start_not_the_servers(tmp_path, monkeypatch):
    """The fork server outlives a grid; a later grid's runs must see the environment as it is
    then (here NOBUBBLE_CACHE, where the tokenizer goes), as a new process would."""
    corpus = tmp_path / "plays.txt"
    corpus.write_text(fetch_shakespeare().read_text()[:100_000])
    spec = runner.RunSpec("env", {"data": str(corpus), "steps": 2, "eval_every": 2})
    runner.run_grid([spec], grids.QUICK.base, tmp_path / "first", progress=False)  # server up
    monkeypatch.setenv("NOBUBBLE_CACHE", str(tmp_path / "cache"))
    outcome = runner.run_grid([spec], grids.QUICK.base, tmp_path / "second", progress=False)
    run_dir = outcome["env"].run_dir
    log_text = (run_dir.parent / f"{run_dir.name}.log").read_text()
    assert f"-> {tmp_path / 'cache'}" in log_text, log_text[-2000:]
