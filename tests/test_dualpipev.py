"""DualPipeV and Looped BFS against torch 2.13's own orders and DualPipe's published figures.

Pure schedule tests; torch is imported only to read its per-rank orders (the oracle for the
order), converted here without nobubble's CSV reader: an overlapped pair becomes its two
actions in order, and where a schedule splits any backward a fused B becomes I then W.
DualPipe's table (deepseek-ai/DualPipe's README, DeepSeek-V3 report Table 2), with PP the number
of stages (2P for DualPipeV on P ranks) and F, B, W the times of one stage's chunk: bubble
(PP/2-1)(F&B+B-3W), parameters 2x (two stages per device), activation PP+1 per device.
"""

from __future__ import annotations

import itertools

import pytest

from nobubble.core.comm import check_communication
from nobubble.core.comm_ops import RECV
from nobubble.core.deps import sends_after
from nobubble.core.ir import Schedule
from nobubble.core.ledger import build_ledger, rank_peak_inflight
from nobubble.core.schedules import SCHEDULES, build_schedule
from nobubble.core.schedules.bounds import rank_peak_inflight as rank_peak_bound
from nobubble.core.sim import CostModel, simulate
from nobubble.core.validate import validate


def torch_orders(class_name: str, p: int, m: int, v: int = 2) -> list[list[str]]:
    """torch's compute orders for ``p`` ranks of ``v`` stages, as nobubble action strings."""
    visualizer = pytest.importorskip("torch.distributed.pipelining._schedule_visualizer")
    rows = visualizer.get_schedule_ops(class_name, p, m, v)
    flat = [[sub for a in row if a is not None for sub in (a.sub_actions or (a,))] for row in rows]
    split = any(a.computation_type.value in "IW" for row in flat for a in row)
    out = []
    for row in flat:
        order = []
        for a in row:
            kind = a.computation_type.value
            if kind not in ("F", "B", "I", "W"):
                continue  # REDUCE_GRAD
            kinds = ("I", "W") if split and kind == "B" else (kind,)
            order += [f"{a.stage_index}{k}{a.microbatch_index}" for k in kinds]
        out.append(order)
    return out


def ours(name: str, p: int, m: int, v: int | None = None) -> list[list[str]]:
    schedule = build_schedule(name, p, m, 1, virtual_stages=v)
    return [[str(a) for a in order if a.kind != "STEP"] for order in schedule.ranks]


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
def test_orders_equal_torchs(p):
    for m in range(2 * p, 2 * p + 7):
        assert ours("dualpipev", p, m) == torch_orders("DualPipeV", p, m), (p, m)
    for m, v in itertools.product(range(1, 7), (2, 3)):
        assert ours("looped-bfs", p, m, v) == torch_orders("LoopedBFS", p, m, v), (p, m, v)


def test_torchs_dualpipev_overlaps_forward_and_backward_pairs():
    """The oracle holds the pairs this schedule writes as consecutive actions."""
    visualizer = pytest.importorskip("torch.distributed.pipelining._schedule_visualizer")
    rows = visualizer.get_schedule_ops("DualPipeV", 2, 6)
    assert any(a is not None and a.sub_actions for row in rows for a in row)


@pytest.mark.parametrize(
    ("name", "p", "m", "v", "message"),
    [
        ("dualpipev", 3, 5, None, r"at least as many micro-batches as stages: M=5 < 2P=6"),
        ("dualpipev", 2, 8, 3, r"exactly 2 stages per rank in a V, got v=3"),
        ("looped-bfs", 2, 4, 1, r"v >= 2 .* use gpipe"),
    ],
)
def test_refusals_are_torchs(name, p, m, v, message):
    with pytest.raises(ValueError, match=message):
        build_schedule(name, p, m, 1, virtual_stages=v)


GRID = [(p, m) for p in range(1, 6) for m in range(1, 13)]


@pytest.mark.parametrize(("p", "m"), GRID)
def test_batch_j_runs_at_version_j(p, m):
    for name, v in (("dualpipev", 2), ("looped-bfs", 2), ("looped-bfs", 3)):
        if name == "dualpipev" and m < 2 * p:
            continue
        schedule = build_schedule(name, p, m, 3, virtual_stages=v)
        validate(schedule)
        assert SCHEDULES[name].synchronous and schedule.num_ranks == p
        for st in build_ledger(schedule).stages:
            assert st.fwd_version == st.bwd_version == [mb // m for mb in range(3 * m)]
            assert st.applied_step == [mb // m + 1 for mb in range(3 * m)]
            assert st.peak_versions == 1
        expected = [rank_peak_bound(name, p, m, 3, r, v) for r in range(p)]
        assert rank_peak_inflight(schedule) == expected


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6])
def test_dualpipev_holds_pp_plus_1_stages_of_activations(p):
    """DualPipe's activation column: PP+1 stage-micro-batches per device (PP = 2P stages), one
    more than 1F1B's PP on the device holding stage 0 of the same 2P stages."""
    for m in (2 * p, 2 * p + 1, 4 * p):
        schedule = build_schedule("dualpipev", p, m, 2)
        assert rank_peak_inflight(schedule) == [2 * p + 1] * p
        one_f_one_b = build_ledger(build_schedule("1f1b", 2 * p, m, 2))
        assert max(st.peak_inflight for st in one_f_one_b.stages) == 2 * p


def idle_per_rank(name: str, p: int, m: int, cost: CostModel) -> list[float]:
    metrics = simulate(build_schedule(name, p, m, 1), cost).metrics
    return [(1 - u) * metrics.makespan for u in metrics.utilization]


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6])
def test_dualpipev_bubble_against_dualpipes_formula(p):
    """Per stage F = I = W = 1 (B = 2), given per rank (two stages) as 2, 4 and 2.

    DualPipe's (PP/2-1)(F&B+B-3W) prices an overlapped pair as one chunk of time F&B. nobubble
    runs the pair as two actions, the forward as soon as its own input is there, and every rank
    idles (P-1)F: the formula's figure at F&B = B, below its figure at F&B = F+B (the pair's
    compute back to back, no overlap), and exactly ZB-V's idle time at these costs.
    """
    unit = CostModel(fwd=2.0, bwd=4.0, wgrad=2.0)
    for m in (2 * p, 2 * p + 1, 3 * p, 5 * p):
        idle = idle_per_rank("dualpipev", p, m, unit)
        assert idle == pytest.approx([p - 1.0] * p)
        f, b, w = 1.0, 2.0, 1.0
        assert idle[0] == pytest.approx((p - 1) * (b + b - 3 * w))  # F&B = B
        assert idle[0] <= (p - 1) * ((f + b) + b - 3 * w)  # F&B = F + B
        assert idle[0] == pytest.approx(idle_per_rank("zbv", p, m, unit)[0])


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6])
def test_looped_bfs_bubble_is_interleaved_1f1bs_from_m_p(p):
    """Breadth first, all forwards of a stage then the next: (P-1)/(vM+P-1) once M >= P, with
    vM micro-batch halves (v = 2) or thirds held per rank, against interleaved's fewer."""
    for v, m in itertools.product((2, 3), range(p, 3 * p + 1)):
        schedule = build_schedule("looped-bfs", p, m, 1, virtual_stages=v)
        metrics = simulate(schedule, CostModel(fwd=1.0, bwd=2.0)).metrics
        assert metrics.bubble_share == pytest.approx((p - 1) / (v * m + p - 1)), (v, m)
        assert rank_peak_inflight(schedule) == [v * m] * p


def held_receives(schedule: Schedule, plans: list) -> int:
    """Most receives a rank has posted whose consumer has not run yet (buffered tensors)."""
    most = 0
    for rank, batches in enumerate(plans):
        index = {a: i for i, a in enumerate(schedule.ranks[rank])}
        change = [0] * (len(index) + 1)
        for batch in batches:
            for op in batch.ops:
                if op.kind == RECV:
                    change[batch.position] += 1
                    change[index[sends_after(op.message, schedule.num_stages)]] -= 1
        most = max(most, *itertools.accumulate(change))
    return most


def test_the_communication_plan_completes_under_nccl_rules():
    """What the multi-process runtime runs: every message meets its peer's, with and without
    global clipping and drain points (tests/test_comm.py's check for the other V and loop).
    Receives posted ahead of their consumer hold at most 2 boundary tensors per rank under
    dualpipev, and max(0, M-P) under looped-bfs."""
    for name, p, v in itertools.product(("dualpipev", "looped-bfs"), (2, 3), (2, 3)):
        if name == "dualpipev" and v != 2:
            continue
        for m in {2 * p, 4 * p} if name == "dualpipev" else {1, p, 2 * p, 4 * p}:
            schedule = build_schedule(name, p, m, 3, virtual_stages=v)
            for clip, points in ((False, [3]), (True, [1, 2, 3])):
                plans = check_communication(schedule, clip, points)
                assert len(plans) == p
                held = held_receives(schedule, plans)
                assert held == (2 if name == "dualpipev" else max(0, m - p)), (name, p, m, v)
