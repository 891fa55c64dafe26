"""Synthetic runs: the real interpreter and transport on P processes, waits instead of compute."""

from __future__ import annotations

import json

from nobubble.cli import main
from nobubble.dist.synthetic import run_synthetic
from nobubble.schedules import build_schedule


def test_synthetic_run_executes_every_action_of_every_rank():
    result = run_synthetic("paci", 3, 2, 2, 0.002, 0.004)
    schedule = build_schedule("paci", 3, 2, 2)
    assert [len(lane) for lane in result["spans"]] == [len(o) for o in schedule.ranks]
    assert [[a for a, _, _ in lane] for lane in result["spans"]] == [
        [str(a) for a in order] for order in schedule.ranks
    ]
    # a pipeline cannot beat its critical path: (P-1) forwards + all of stage 0's work
    assert result["makespan_s"] > (2 + 4) * (0.002 + 0.004)


def test_bench_runtime_synthetic_reports_measured_and_predicted(capsys):
    code = main(
        [
            "bench",
            "runtime",
            "--synthetic",
            "0.002,0.004",
            "--stages",
            "2",
            "--microbatches",
            "2",
            "--steps",
            "2",
            "--rounds",
            "1",
            "--schedule",
            "1f1b,torch-1f1b",
            "--json",
        ]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["schedule"] for r in out["runs"]] == ["1f1b"]  # torch variants have no waits
    row = out["runs"][0]
    assert row["measured_s"] > 0 and row["predicted_s"] == 2 * (2 + 1) * 0.006
