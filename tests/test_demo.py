"""`nobubble demo`: the best synchronous peer, ratios taken within alternating rounds, and a
demo run cut into segments at its drain points."""

from __future__ import annotations

import json
import time

import pytest

from nobubble.app.demo import (
    MICROBATCHES,
    STAGES,
    best_synchronous,
    check_demo_args,
    format_demo,
    machine_busy_s,
    run_demo,
    segment_figures,
)
from nobubble.core.schedules import SCHEDULE_NAMES, SCHEDULES, build_schedule
from nobubble.core.sim import CostModel, simulate


def test_the_best_synchronous_peer_has_a_smaller_bubble_than_1f1b_closed_form():
    best = best_synchronous()
    assert best in SCHEDULE_NAMES and SCHEDULES[best].synchronous
    assert best not in ("gpipe", "1f1b")
    bubble = simulate(
        build_schedule(best, STAGES, MICROBATCHES, 2), CostModel(fwd=1.0, bwd=2.0, wgrad=1.0)
    ).metrics.bubble_share
    # 1f1b's bubble over one step at unit costs: (P-1) / (M+P-1) = 1/5 at P=2, M=4
    assert bubble < (STAGES - 1) / (MICROBATCHES + STAGES - 1) - 0.05


@pytest.mark.parametrize(
    ("steps", "rounds", "needle"),
    [(10, 0, "--rounds"), (10, 3, "multiple of --rounds 3"), (3, 3, "at least 2 steps")],
)
def test_a_demo_that_cannot_be_cut_into_equal_segments_is_refused(steps, rounds, needle):
    with pytest.raises(ValueError, match=needle):
        check_demo_args(steps, rounds)


def test_segment_speed_skips_the_segment_start_and_reads_the_drain_point_timeline():
    records = [
        {"step": 1, "tokens": 100, "elapsed_s": 5.0},
        {"step": 2, "tokens": 200, "elapsed_s": 6.0, "utilization": [0.5], "bubble_share": 0.5},
        {"step": 3, "tokens": 300, "elapsed_s": 20.0},  # a process start: warm-up, skipped
        {"step": 4, "tokens": 400, "elapsed_s": 20.5},
        {"step": 5, "tokens": 500, "elapsed_s": 21.0, "utilization": [0.9], "bubble_share": 0.1},
    ]
    figures = segment_figures(records, 2, 5)
    assert figures["tokens_per_s"] == pytest.approx(200 / 1.0)
    assert figures["utilization"] == [0.9] and figures["bubble_share"] == 0.1


@pytest.mark.slow
def test_a_demo_in_two_rounds_trains_every_step_and_continues_where_it_stopped(tmp_path, capsys):
    # `tiny`: the mechanics, not the speed-up (and Muon's bf16 steps on `mini` are slow on CPUs
    # without bf16 instructions)
    demo = {"steps": 4, "rounds": 2, "progress": False, "schedules": ("1f1b", "paci")}
    result = run_demo(tmp_path, **demo, model="tiny")
    for schedule in ("1f1b", "paci"):
        lines = (tmp_path / schedule / "metrics.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        assert [r["step"] for r in records] == [1, 2, 3, 4]  # two segments, no step twice
        assert [r["step"] for r in records if "val_loss" in r] == [2, 4]  # the segment ends
        assert len(result["speed"][schedule]["tokens_per_s_rounds"]) == 2
    assert result["speed"]["1f1b"]["vs_1f1b_rounds"] == [1.0, 1.0]
    assert "vs 1f1b per round" in format_demo(result)
    capsys.readouterr()
    again = run_demo(tmp_path, **demo, model="tiny")
    assert again["speed"] == result["speed"]  # every segment was there: nothing ran again
    with pytest.raises(ValueError, match="other settings"):  # refused before any run
        run_demo(tmp_path, **{**demo, "steps": 6}, model="tiny")


def test_a_busy_machine_is_named_beside_the_ratios_it_skews():
    """Other work fills the bubbles that async removes, so the table warns when other
    processes kept a quarter of a core or more busy, and stays quiet on an idle machine."""
    speed = {"tokens_per_s": 1.0, "tokens_per_s_rounds": [1.0], "vs_1f1b": 1.0}
    speed |= {"vs_1f1b_rounds": [1.0], "utilization": [0.8, 0.8], "bubble_share": 0.2}
    run = {"last_loss": 3.0, "val_loss": 3.0}
    result = {"schedules": ["1f1b"], "runs": {"1f1b": run}, "speed": {"1f1b": speed}}
    result |= {"rounds": 1, "steps": 10, "figure": "t.png", "cores": 2}
    assert "warning" not in format_demo({**result, "other_cores": 0.1})
    assert "warning" not in format_demo({**result, "other_cores": None})  # not measurable
    busy = format_demo({**result, "other_cores": 1.5})
    assert "1.5 of this machine's 2 cores" in busy and "rerun `nobubble demo`" in busy


def test_the_machine_wide_cpu_clock_counts_this_process_work():
    before = machine_busy_s()
    if before is None:
        pytest.skip("no /proc/stat on this platform")
    end = time.process_time() + 0.3
    while time.process_time() < end:  # 0.3 s of this process's CPU
        pass
    after = machine_busy_s()
    assert after is not None and after - before >= 0.25
