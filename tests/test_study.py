"""`nobubble study`: costs read from measured timelines, and the simulated grid's closed forms."""

from __future__ import annotations

import json

import pytest

from nobubble.app.study import MeasuredCosts, cost_model, measure_costs, simulate_grid, simulate_row

UNIT = MeasuredCosts(
    fwd=1.0,
    bwd=2.0,
    bwd_input=1.0,
    bwd_weight=1.0,
    step=0.0,
    transfer=0.0,
    boundary_bytes=1000,
    activation_bytes=100,
    tokens_per_microbatch=10,
)


def _span(kind, stage, dur_s):
    return {"ph": "X", "dur": dur_s * 1e6, "args": {"kind": kind, "stage": stage}}


def test_costs_are_the_mean_over_stages_of_each_kinds_median_span(tmp_path):
    """I and W come from the stages after the first: the first stage's I is empty (its input
    takes no gradient) and its W the whole backward."""
    fused, split = tmp_path / "fused", tmp_path / "split"
    for run in (fused, split):
        run.mkdir()
        config = {"model": "tiny", "vocab_size": 256, "seq_len": 32, "micro_batch_size": 2}
        (run / "config.json").write_text(json.dumps({"config": config}))
        summary = {"peak_activation_bytes": [400, 100], "peak_inflight": [2, 1]}
        (run / "summary.json").write_text(json.dumps(summary))
    events = [_span("F", 0, d) for d in (1.0, 3.0, 2.0)] + [_span("F", 1, 4.0)]
    events += [_span("B", 0, 5.0), _span("B", 1, 7.0), _span("STEP", 0, 0.5)]
    events += [_span("SEND_F", 0, 0.01), _span("SEND_B", 1, 0.03)]
    (fused / "trace.json").write_text(json.dumps({"traceEvents": events}))
    events = [_span("I", 0, 0.0), _span("W", 0, 6.0), _span("I", 1, 5.0), _span("W", 1, 2.0)]
    events += [_span("I", 2, 3.0), _span("W", 2, 2.0)]
    (split / "trace.json").write_text(json.dumps({"traceEvents": events}))
    costs = measure_costs(fused, split)
    assert costs.fwd == pytest.approx((2.0 + 4.0) / 2)  # stage medians 2 and 4
    assert (costs.bwd, costs.bwd_input, costs.bwd_weight) == pytest.approx((6.0, 4.0, 2.0))
    assert costs.step == pytest.approx(0.5) and costs.transfer == pytest.approx(0.02)
    assert costs.activation_bytes == 150  # 400 / 2 and 100 / 1 per micro-batch
    assert costs.boundary_bytes == 2 * 32 * 64 * 4  # tiny's dim is 64, fp32
    assert costs.tokens_per_microbatch == 64


def test_the_measured_split_pays_i_plus_w_and_the_ideal_split_pays_b():
    costs = MeasuredCosts(**{**UNIT.__dict__, "bwd": 2.0, "bwd_input": 2.0, "bwd_weight": 1.0})
    measured, ideal = cost_model(costs, "zb-h1", "measured"), cost_model(costs, "zb-h1", "ideal")
    assert (measured.bwd, measured.wgrad) == (3.0, 1.0)
    assert (ideal.bwd, ideal.wgrad) == pytest.approx((2.0, 2.0 / 3))
    assert cost_model(costs, "1f1b", "measured").bwd == 2.0  # fused: B either way


def test_grid_rows_follow_the_closed_forms_at_unit_costs():
    P, M = 4, 8
    row = {s: simulate_row(UNIT, s, P, M, "ideal") for s in ("1f1b", "interleaved-1f1b", "zbv")}
    # rank 0's in-flight micro-batches: P for 1f1b and ZB-V, P + (P-1)/v interleaved (v=2)
    assert row["1f1b"]["peak_inflight"] == P and row["zbv"]["peak_inflight"] == P
    assert row["interleaved-1f1b"]["peak_inflight"] == P + (P - 1) / 2
    # ZB-V sends twice what 1f1b sends (both turns of the V cross ranks, but one stays local)
    assert row["zbv"]["bytes_sent_per_step"] == 2 * row["1f1b"]["bytes_sent_per_step"]
    assert row["1f1b"]["bytes_sent_per_step"] == 2 * M * UNIT.boundary_bytes  # F out, B out
    copies = {s: simulate_row(UNIT, s, P, M, "ideal")["weight_copies"] for s in ("2bw", "paci")}
    assert copies == {"2bw": 2, "paci": 1}


def test_the_grid_is_relative_to_1f1b_at_every_point():
    rows = simulate_grid(UNIT, sizes=(4,), factors=(1, 2), scenarios=("ideal",))
    assert {(r["P"], r["M"]) for r in rows} == {(4, 4), (4, 8)}
    assert all(r["vs_1f1b"] == 1.0 for r in rows if r["schedule"] == "1f1b")
    paci = [r for r in rows if r["schedule"] == "paci"]
    assert all(r["vs_1f1b"] > 1.0 and r["bubble"] < 0.05 for r in paci)


def test_dualpipev_and_looped_bfs_join_the_grid_where_they_run():
    rows = simulate_grid(UNIT, sizes=(4,), factors=(1, 2), scenarios=("ideal",))
    where = {(r["schedule"], r["M"]) for r in rows}
    assert ("dualpipev", 8) in where and ("dualpipev", 4) not in where  # M >= 2P only
    assert {("looped-bfs", 4), ("looped-bfs", 8)} <= where
    by = {(r["schedule"], r["M"]): r for r in rows}
    # DualPipeV: between ZB-V and 1F1B; 2P+1 stage-micro-batches of half a rank's layers each
    assert by[("zbv", 8)]["bubble"] <= by[("dualpipev", 8)]["bubble"] < by[("1f1b", 8)]["bubble"]
    assert by[("dualpipev", 8)]["peak_inflight"] == (2 * 4 + 1) / 2
    # Looped BFS: GPipe's activations (all M micro-batches), less idle than 1F1B
    assert by[("looped-bfs", 8)]["peak_inflight"] == 8
    assert by[("looped-bfs", 8)]["bubble"] < by[("1f1b", 8)]["bubble"]
