"""The torch-free CLI: JSON shapes, human output, files written, and clean errors."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from nobubble.cli import main
from nobubble.core.ir import ScheduleError
from nobubble.core.schedules import SCHEDULE_NAMES, SCHEDULES, build_schedule
from nobubble.core.schedules.bounds import MAX_ACTIONS, num_actions


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_schedules_lists_every_name(capsys):
    code, out, _ = run(capsys, "schedules")
    assert code == 0
    assert [line.split()[0] for line in out.splitlines()] == list(SCHEDULE_NAMES)


def test_simulate_all_json_has_the_documented_keys(capsys, tmp_path):
    trace, plot = tmp_path / "t.json", tmp_path / "g.png"
    code, out, _ = run(
        capsys,
        "simulate",
        "--schedule",
        "all",
        "--stages",
        "4",
        "--microbatches",
        "8",
        "--steps",
        "3",
        "--json",
        "--trace",
        str(trace),
        "--plot",
        str(plot),
    )
    assert code == 0
    result = json.loads(out)
    assert list(result) == list(SCHEDULE_NAMES)
    for value in result.values():
        for key in (
            "makespan",
            "bubble_share",
            "utilization",
            "throughput",
            "peak_inflight",
            "peak_versions",
            "max_crossed",
        ):
            assert key in value
        assert len(value["utilization"]) == 4
    assert result["1f1b"]["bubble_share"] == pytest.approx(3 / 11)
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["cat"] for e in spans} == {"F", "B", "I", "W", "STEP"}
    assert {e["pid"] for e in spans} == set(range(len(SCHEDULE_NAMES)))
    lanes = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {"stage 0", "rank 0: stages 0,4", "rank 0: stages 0,7"} <= lanes
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ledger_json_records(capsys):
    code, out, _ = run(
        capsys,
        "ledger",
        "--schedule",
        "paci",
        "--stages",
        "3",
        "--microbatches",
        "2",
        "--steps",
        "3",
        "--json",
    )
    assert code == 0
    result = json.loads(out)
    assert len(result["records"]) == 3 * 6
    assert set(result["records"][0]) >= {
        "stage",
        "microbatch",
        "fwd_version",
        "bwd_version",
        "applied_step",
        "crossed",
    }
    assert [row["max_crossed"] for row in result["summary"]] == [1, 1, 0]


def test_ledger_human_output_has_summary(capsys):
    code, out, _ = run(
        capsys,
        "ledger",
        "--schedule",
        "2bw",
        "--stages",
        "3",
        "--microbatches",
        "2",
        "--steps",
        "2",
    )
    assert code == 0
    assert "peak_versions" in out and "crossed-update histogram" in out


def test_show_text_round_trips_through_from_json(capsys, tmp_path):
    code, out, _ = run(
        capsys,
        "show",
        "--schedule",
        "pipedream",
        "--stages",
        "3",
        "--steps",
        "4",
        "--format",
        "json",
    )
    assert code == 0
    path = tmp_path / "s.json"
    path.write_text(out)
    code, out2, _ = run(capsys, "show", "--from-json", str(path), "--format", "json")
    assert code == 0 and json.loads(out2) == json.loads(out)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["simulate", "--schedule", "nope"], "valid names: gpipe, 1f1b, pipedream, 2bw, paci"),
        (["simulate", "--schedule", "2bw", "--stages", "5", "--microbatches", "2"], "M >= P-1"),
        (["ledger", "--schedule", "1f1b", "--accum", "2"], "--accum 2 applies to pipedream"),
        (["simulate", "--fwd", "-1"], "--fwd"),
        (["simulate", "--from-json", "/no/such/file.json"], "does not exist"),
    ],
)
def test_bad_input_fails_cleanly(capsys, argv, message):
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert message in err
    assert "Traceback" not in err


def test_a_schedule_too_large_to_build_is_refused_at_once(capsys, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("the generator ran: the refusal came after work started")

    monkeypatch.setitem(SCHEDULES, "2bw", replace(SCHEDULES["2bw"], generate=never))
    argv = ["ledger", "--schedule", "2bw", "--stages", "100000", "--microbatches", "100000"]
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert "would hold 80,000,400,000 actions (P x steps x (2M + 1))" in err
    assert f"more than the {MAX_ACTIONS:,}" in err
    assert "lower --stages, --microbatches (--accum for pipedream and paci) or --steps" in err
    assert "Traceback" not in err and out == ""


def test_the_size_limit_admits_bench_sims_default():
    assert num_actions(64, 256, 100) <= MAX_ACTIONS  # `nobubble bench sim` with its defaults
    with pytest.raises(ScheduleError, match="lower --stages"):
        build_schedule("paci", 64, 256, MAX_ACTIONS // (64 * 513) + 1)


@pytest.mark.parametrize(
    "argv",
    [
        ["simulate", "--stages", "0"],
        ["simulate", "--microbatches", "-3"],
        ["ledger", "--accum", "0"],
        ["simulate", "--steps", "x"],
    ],
)
def test_bad_integers_are_rejected_by_the_parser(capsys, argv):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "expected an integer >= 1" in capsys.readouterr().err


def test_invalid_hand_written_schedule_file(capsys, tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(
        json.dumps(
            {
                "name": "hand",
                "num_stages": 2,
                "num_microbatches": 1,
                "num_steps": 1,
                "ranks": [["0F0", "0B0", "0STEP1"], ["1B0", "1F0", "1STEP1"]],
            }
        )
    )
    code, _, err = run(capsys, "simulate", "--from-json", str(path))
    assert code == 2
    assert "rank 1, position 0 (1B0): backward of micro-batch 0 before its forward" in err
    assert "[1B0]" in err


def test_python_dash_m_exits_nonzero_without_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "nobubble", "ledger", "--schedule", "gpipe2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "unknown schedule 'gpipe2'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bench_sim_reports_both_sizes(capsys):
    code, out, _ = run(
        capsys, "bench", "sim", "--stages", "4", "--microbatches", "4", "--steps", "4", "--json"
    )
    assert code == 0
    runs = json.loads(out)["runs"]
    assert [r["steps"] for r in runs] == [2, 4]
    assert runs[1]["actions"] == 2 * runs[0]["actions"]
