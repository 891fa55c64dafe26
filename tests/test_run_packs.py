"""Runs packed into one file (app/experiments/packs.py) come back as the folders they were, and
the runner reuses a packed run through its usual path."""

from __future__ import annotations

import json

import pytest

from nobubble.app.experiments import packs, runner
from nobubble.app.experiments.runner import RunSpec


def _fake_run(folder, steps: int, stages: int, seed: int) -> None:
    """A finished run's folder as the trainer and runner leave it (made-up numbers)."""
    folder.mkdir(parents=True)
    rows = []
    for step in range(1, steps + 1):
        row = {
            "step": step,
            "loss": 6.0 / step + seed * 1e-3 + 1 / 3,
            "lr": 1e-3 * step / steps,
            "tokens": 4096 * step,
            "elapsed_s": 0.2062646809999933 * step,
            "grad_norm": [0.1 * (s + 1) / step for s in range(stages)],
        }
        if step % 4 == 0:
            row["val_loss"] = 5.5 / step
        if step == steps:
            row["utilization"] = [0.5, 0.25]
            row["note"] = "last"  # a field of no numeric kind is kept as JSON
        rows.append(row)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {"val_loss": rows[-1]["loss"], "steps": steps, "sample": None}
    (folder / "summary.json").write_text(json.dumps(summary, indent=1))
    (folder / "config.json").write_text(json.dumps({"config": {"stages": stages}}, indent=1))
    (folder / "key.json").write_text(json.dumps({"config": {}, "code": "b5661bf9"}))
    (folder / "ledger.json").write_text(json.dumps({"crossed_histogram": {"0": steps}}))


@pytest.fixture
def runs(tmp_path):
    runs_dir = tmp_path / "runs"
    _fake_run(runs_dir / "1f1b-adamw-s0-0123abcd", 12, 2, 0)
    _fake_run(runs_dir / "paci-adamw-s1-4567ef01", 9, 3, 1)
    (runs_dir / "unfinished-89abcdef").mkdir()  # no summary.json: not packed
    return runs_dir


def test_a_packed_run_is_reused_as_its_folder_was(runs, tmp_path):
    spec = RunSpec("paci-adamw-s1", {})
    key = "paci-adamw-s1-4567ef01"
    before = runner._run_one(spec, key, "code", {}, runs)  # an existing folder: reused
    files = {p.name: p.read_bytes() for p in (runs / key).iterdir()}
    done = packs.pack_runs(runs, tmp_path / "kept" / f"short{packs.SUFFIX}")
    assert done["runs"] == 2
    fresh = tmp_path / "fresh" / "runs"  # a new output folder holding the pack only
    fresh.mkdir(parents=True)
    (tmp_path / "kept" / f"short{packs.SUFFIX}").rename(fresh / f"short{packs.SUFFIX}")
    after = runner._run_one(spec, key, "code", {}, fresh)  # would train if it missed the pack
    assert (after.summary, after.metrics) == (before.summary, before.metrics)
    assert {p.name: p.read_bytes() for p in (fresh / key).iterdir()} == files
    assert after.metrics[-1]["note"] == "last" and after.metrics[3]["val_loss"] == 5.5 / 4
    assert packs.packed_keys(fresh / f"short{packs.SUFFIX}") == sorted(
        ["1f1b-adamw-s0-0123abcd", "paci-adamw-s1-4567ef01"]
    )
    assert not packs.unpack_run(fresh, "unfinished-89abcdef")


def test_the_pack_is_smaller_than_the_folders(runs, tmp_path):
    out = tmp_path / f"p{packs.SUFFIX}"
    packs.pack_runs(runs, out)
    size = sum(p.stat().st_size for p in runs.rglob("*") if p.is_file())
    assert out.stat().st_size < size / 2


def test_pack_refuses_a_wrong_name_and_an_empty_folder(runs, tmp_path):
    with pytest.raises(ValueError, match=r"ends in \.pack\.xz"):
        packs.pack_runs(runs, tmp_path / "p.xz")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no finished run"):
        packs.pack_runs(tmp_path / "empty", tmp_path / f"p{packs.SUFFIX}")
