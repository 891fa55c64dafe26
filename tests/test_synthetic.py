"""Synthetic runs: the real interpreter and transport on P processes, waits instead of compute."""

from __future__ import annotations

import json

from nobubble.app.ranks.synthetic import run_synthetic
from nobubble.cli import main
from nobubble.core.schedules import build_schedule


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


def test_bench_runtime_reports_every_variant_with_its_figures_and_the_split(capsys):
    """The real (compute) mode end to end: nobubble and torch.distributed.pipelining runs."""
    argv = "bench runtime --model tiny --vocab-size 512 --seq-len 32 --micro-batch-size 2"
    argv += " --stages 2 --microbatches 2 --steps 2 --rounds 1 --schedule 1f1b,paci,torch-1f1b"
    assert main([*argv.split(), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for variant in ("1f1b", "paci", "torch-1f1b"):
        figures = out[variant]
        assert figures["tokens_per_s"] > 0
        assert len(figures["peak_activation_bytes"]) == 2
        assert all(b > 0 for b in figures["peak_activation_bytes"])
    assert all(0 < u <= 1 for u in out["paci"]["utilization"])
    # the peer notes torch's compute spans itself (distributed/peer_stage.TimedStage)
    assert all(0 < u <= 1 for u in out["torch-1f1b"]["utilization"])
    assert out["1f1b"]["vs_1f1b"] == 1.0
    part = out["config"]["partition"]
    assert part["layers"] == ["0-1", "2-3"] and 0 < part["balance"] <= 1
