"""Simulator against closed forms (unit costs) and the validator's error reports."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nobubble.core.ir import Action, Schedule, ScheduleError
from nobubble.core.schedules import build_schedule
from nobubble.core.sim import CostModel, simulate
from nobubble.core.validate import ScheduleValidationError, validate

grid = settings(max_examples=40, deadline=None)


@grid
@given(
    name=st.sampled_from(["gpipe", "1f1b"]),
    p=st.integers(1, 16),
    m=st.integers(1, 32),
    bwd=st.sampled_from([1.0, 2.0]),
)
def test_sync_bubble_share_is_closed_form(name, p, m, bwd):
    metrics = simulate(build_schedule(name, p, m, 1), CostModel(fwd=1.0, bwd=bwd)).metrics
    assert metrics.bubble_share == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    assert metrics.makespan == pytest.approx((m + p - 1) * (1.0 + bwd))


@grid
@given(
    name=st.sampled_from(["pipedream", "2bw", "paci"]),
    p=st.integers(1, 12),
    m=st.integers(1, 16),
    n=st.integers(2, 6),
    bwd=st.sampled_from([1.0, 2.0]),
)
def test_async_steady_window_is_fully_utilized(name, p, m, n, bwd):
    m = max(m, p - 1)
    n = max(n, -(-2 * p // m) + 1)  # enough micro-batches to fill the pipeline at all
    schedule = build_schedule(name, p, m, n, accum=m)
    metrics = simulate(schedule, CostModel(fwd=1.0, bwd=bwd)).metrics
    assert metrics.steady_utilization == pytest.approx([1.0] * p, abs=1e-12)
    assert metrics.throughput == pytest.approx(1.0 / (1.0 + bwd))


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (8, 8), (8, 32)])
def test_flush_over_paci_makespan_ratio_approaches_bubble_ratio(p, m):
    n = 200
    cost = CostModel(fwd=1.0, bwd=2.0)
    flush = simulate(build_schedule("1f1b", p, m, n), cost).metrics.makespan
    paci = simulate(build_schedule("paci", p, m, n), cost).metrics.makespan
    # exact for equal per-stage costs: flush N(M+P-1) slots, paci NM+P-1 slots
    assert flush / paci == pytest.approx(n * (m + p - 1) / (n * m + p - 1), rel=1e-12)
    assert flush / paci == pytest.approx((m + p - 1) / m, rel=(p - 1) / n)


def test_transfer_cost_delays_the_pipeline():
    schedule = build_schedule("gpipe", 3, 1, 1)  # one micro-batch: a pure chain
    free = simulate(schedule, CostModel(fwd=1.0, bwd=1.0)).metrics.makespan
    slow = simulate(
        schedule, CostModel(fwd=1.0, bwd=1.0, latency=0.5, bandwidth=10.0, activation_bytes=5.0)
    ).metrics.makespan
    # forward and backward each cross P-1 = 2 links; each hop costs 0.5 + 5/10 = 1
    assert free == pytest.approx(6.0)
    assert slow == pytest.approx(free + 2 * 2 * 1.0)


def test_per_stage_costs_and_step_cost():
    schedule = build_schedule("gpipe", 2, 1, 2)
    result = simulate(schedule, CostModel(fwd=(1.0, 3.0), bwd=(2.0, 4.0), step=0.5))
    # F0 [0,1] F1' [1,4] B1 [4,8] B0 [8,10] step [10,10.5]; second batch likewise
    assert result.metrics.makespan == pytest.approx(2 * 10.5)
    assert result.timeline.spans(0)[2][1:] == (10.0, 10.5)


def test_peak_metrics_come_from_the_ledger():
    metrics = simulate(build_schedule("2bw", 4, 4, 6), CostModel()).metrics
    assert metrics.peak_inflight == [4, 3, 2, 1]
    assert metrics.peak_versions == [2, 2, 2, 2]
    assert metrics.max_crossed == [1, 1, 1, 0]
    assert sum(metrics.crossed_histogram.values()) == 4 * 24


def _bad(ranks: list[str], name: str = "hand", m: int = 1, n: int = 1) -> Schedule:
    return Schedule(
        name,
        len(ranks),
        m,
        n,
        "current",
        "current",
        tuple(tuple(Action.parse(t) for t in r.split()) for r in ranks),
    )


@pytest.mark.parametrize(
    ("ranks", "rank", "position", "reason"),
    [
        (["0B0 0F0 0STEP1", "1F0 1B0 1STEP1"], 0, 0, "before its forward"),
        (["0F0 0F0 0B0 0STEP1", "1F0 1B0 1STEP1"], 0, 1, "second forward"),
        (["0F0 0STEP1 0B0", "1F0 1B0 1STEP1"], 0, 1, "has not run yet"),
        (["0F0 0B0 0STEP1", "1F0 1B0"], 1, 2, "missing STEP1"),
        (["0F0 0B0 0STEP1", "1F0 1STEP1"], 1, 1, "has not run yet"),
        (["0F0 1B0 0STEP1", "1F0 1B0 1STEP1"], 0, 1, "runs on rank 1"),
        (["0F0 0B0 0STEP2", "1F0 1B0 1STEP1"], 0, 2, "expected STEP1"),
        (["0F0 0B0 0SEND_F0 0STEP1", "1F0 1B0 1STEP1"], 0, 2, "not executable"),
        (["0F0 0B0 0STEP1", "1B0 1F0 1STEP1"], 1, 0, "before its forward"),
        (["0F0 0B0 0F1 0B1 0STEP1", "1F1 1F0 1B0 1B1 1STEP1"], 0, 1, "deadlock"),
        (["0F0 0F5 0B0 0STEP1", "1F0 1B0 1STEP1"], 0, 1, "outside"),
    ],
)
def test_validator_names_rank_position_and_reason(ranks, rank, position, reason):
    m = 2 if "0F1" in ranks[0] else 1
    schedule = _bad(ranks, m=m)
    with pytest.raises(ScheduleValidationError) as info:
        validate(schedule)
    err = info.value
    assert (err.rank, err.position) == (rank, position)
    head = str(err).splitlines()[0]
    assert f"rank {rank}, position {position}" in head and reason in head
    order = schedule.ranks[rank]
    expected = str(order[position]) if position < len(order) else None
    assert _marked_cell(str(err)) == (rank, position, expected)


def _marked_cell(message: str) -> tuple[int, int, str | None]:
    """(rank, position, action) of the one bracketed cell of the grid in ``message``, read by its
    column under the header of positions; the action is None for a cell past the rank's order."""
    lines = message.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("pos "))
    positions = [int(p) for p in lines[header][7:].split()]
    width = len(lines[header][7:]) // len(positions)
    marked = []
    for line in lines[header + 1 :]:
        if not line.startswith("rank "):
            continue
        rank = int(line[5:7])
        cells = [line[7 + k * width : 7 + (k + 1) * width].strip() for k in range(len(positions))]
        marked += [(rank, positions[k], c[1:-1]) for k, c in enumerate(cells) if c.startswith("[")]
    assert len(marked) == 1, message
    rank, position, text = marked[0]
    return rank, position, None if text in (".", "?") else text


@pytest.mark.parametrize("where", ["last step", "missing step"])
def test_validator_grid_shows_the_failing_cell_of_a_long_order(where):
    """The grid is cut to a window around the failure, which stays marked in its column."""
    good = build_schedule("1f1b", 3, 16, 3)
    ranks = [list(order) for order in good.ranks]
    last = len(ranks[1]) - 1
    if where == "last step":
        ranks[1][last] = Action(1, "STEP", 4)
    else:
        del ranks[1][last]
    bad = _bad([" ".join(map(str, order)) for order in ranks], "1f1b", m=16, n=3)
    with pytest.raises(ScheduleValidationError) as info:
        validate(bad)
    message = str(info.value)
    position = last if where == "last step" else len(ranks[1])
    expected = "1STEP4" if where == "last step" else None
    assert _marked_cell(message) == (1, position, expected)
    assert f"of {len(ranks[0])})" in message  # the window says it is one
    assert max(len(line) for line in message.splitlines()[1:]) < 160


def test_deadlock_message_lists_what_each_rank_waits_for():
    schedule = _bad(["0F0 0B0 0F1 0B1 0STEP1", "1F1 1F0 1B0 1B1 1STEP1"], m=2)
    with pytest.raises(
        ScheduleValidationError,
        match=r"rank 0 at 0B0 waits for 1B0.*rank 1 at "
        r"1F1 waits for 0F1",
    ):
        simulate(schedule, CostModel())


def test_malformed_inputs_raise_schedule_errors(tmp_path):
    for text in ["F3", "0X1", "0F", "", "0f1"]:
        with pytest.raises(ScheduleError, match="malformed action"):
            Action.parse(text)
    path = tmp_path / "s.json"
    path.write_text("{not json")
    with pytest.raises(ScheduleError, match="not valid JSON"):
        Schedule.load_json(path)
    path.write_text(json.dumps({"name": "x", "num_stages": 1}))
    with pytest.raises(ScheduleError, match="lacks num_microbatches"):
        Schedule.load_json(path)
    with pytest.raises(ScheduleError, match="does not exist"):
        Schedule.load_json(tmp_path / "missing.json")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"fwd": -1.0}, "--fwd"),
        ({"bwd": (1.0, float("nan"))}, "--bwd"),
        ({"bandwidth": 0.0}, "--bandwidth"),
        ({"latency": -2.0}, "--latency"),
    ],
)
def test_cost_model_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CostModel(**kwargs)


def test_per_stage_cost_count_must_match():
    with pytest.raises(ValueError, match="3 durations for 2 stages"):
        simulate(build_schedule("1f1b", 2, 2, 1), CostModel(fwd=(1.0, 1.0, 1.0)))
