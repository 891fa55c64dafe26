"""Summarize the finished corrections --regime long grid with main's analysis, never training.

Usage: python resummarize.py ROOT (the folder holding runs/). The runs were made by code
version 2c4f8a5a (commit c9cdc67); main's code version differs, so its keys would name new
runs. Here each spec resolves to the one finished run of its name; a spec without one is an
error, not a new run.
"""

import sys
from pathlib import Path

from nobubble.app.experiments import experiment, runner

ROOT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("runs/experiments")
RUNS = ROOT / "runs"


def existing(spec, base, code=None):
    found = [
        d.name
        for d in RUNS.glob(f"{spec.name}-*")
        if (d / "summary.json").exists() and d.name[len(spec.name) + 1 :].isalnum()
    ]
    if len(found) != 1:
        raise SystemExit(f"{spec.name}: {len(found)} finished runs {found}; refusing to train")
    return found[0]


def no_training(spec, key, code, base, runs_dir):
    run_dir = runs_dir / key
    assert (run_dir / "summary.json").exists(), run_dir
    return runner._load(spec, run_dir)


runner.run_key = existing
runner._run_one = no_training
if __name__ == "__main__":
    s = experiment.run_experiment("corrections", False, None, str(ROOT), 1, False, regime="long")
    print(s["runs"], s["format"], s["lrs"])
