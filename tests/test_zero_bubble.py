"""The strongest synchronous baselines: interleaved 1F1B, ZB-H1 and ZB-V against their closed forms.

Pure schedule tests (torch is imported only to read torch 2.13's own per-rank orders, the oracle
for the order itself). Costs are per rank: a rank holding v stages spends 1/v of them on each,
so one cost model describes one model whatever the schedule. "Unit costs" are F = I = W = 1.
"""

from __future__ import annotations

import itertools

import pytest

from nobubble.cli import main
from nobubble.core.ir import Action, Schedule, ScheduleError
from nobubble.core.ledger import build_ledger, rank_peak_inflight
from nobubble.core.placement import Placement
from nobubble.core.schedules import SCHEDULES, build_schedule
from nobubble.core.schedules.bounds import num_actions, peak_inflight
from nobubble.core.schedules.bounds import rank_peak_inflight as rank_peak_bound
from nobubble.core.sim import CostModel, simulate
from nobubble.core.validate import ScheduleValidationError, validate

UNIT = CostModel(fwd=1.0, bwd=2.0, wgrad=1.0)  # F = I = W = 1 per rank
NEW = ("interleaved-1f1b", "zb-h1", "zbv")


def whole_rounds(p: int, m: int) -> bool:
    """interleaved-1f1b's precondition: M splits into equal rounds of at least P."""
    return m % max(1, m // p) == 0


def bubble(name: str, p: int, m: int, cost: CostModel = UNIT, v: int | None = None) -> float:
    schedule = build_schedule(name, p, m, 1, virtual_stages=v)
    return simulate(schedule, cost).metrics.bubble_share


def idle_per_rank(name: str, p: int, m: int, cost: CostModel = UNIT) -> float:
    metrics = simulate(build_schedule(name, p, m, 1), cost).metrics
    return metrics.bubble_share * metrics.makespan


# ----- closed forms with unit costs ---------------------------------------------------------------
@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 6])
def test_interleaved_bubble_is_p_minus_1_over_vm_plus_p_minus_1(p, v):
    for m in (p, 2 * p, 3 * p):
        for cost in (UNIT, CostModel(fwd=1.0, bwd=1.0)):
            assert bubble("interleaved-1f1b", p, m, cost, v) == pytest.approx(
                (p - 1) / (v * m + p - 1)
            ), (p, m, v)


def test_interleaved_bubble_matches_the_issue_table():
    """Issue 10's table, replayed from torch's orders: 1F1B 27%, interleaved (v=2) 16%."""
    assert bubble("1f1b", 4, 8) == pytest.approx(3 / 11)
    assert bubble("interleaved-1f1b", 4, 8) == pytest.approx(3 / 19)
    assert bubble("zbv", 4, 8) == pytest.approx(3 / 51)  # the table's 6%


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6, 8])
def test_zb_h1_idles_a_third_of_1f1b_when_f_i_w_are_equal(p):
    """Per rank, 1F1B idles (P-1)(F+B) = 3(P-1) and ZB-H1 (P-1)(F+I-W) = P-1 (for M >= P)."""
    for m in (p, p + 1, 2 * p, 4 * p):
        assert idle_per_rank("1f1b", p, m) == pytest.approx(3 * (p - 1))
        assert idle_per_rank("zb-h1", p, m) == pytest.approx(p - 1)
        assert bubble("zb-h1", p, m) == pytest.approx((p - 1) / (3 * m + p - 1))
    assert bubble("zb-h1", 4, 8) == pytest.approx(bubble("1f1b", 4, 8) * 11 / 27)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6, 8])
def test_zbv_bubble_is_near_zero_from_m_2p(p):
    """From M = 2P each rank idles (P-1)/2 (a sixth of 1F1B's): bubble (P-1)/(6M+P-1) < 1/13."""
    for m in (2 * p, 2 * p + 1, 3 * p, 4 * p):
        assert idle_per_rank("zbv", p, m) == pytest.approx((p - 1) / 2)
        share = bubble("zbv", p, m)
        assert share == pytest.approx((p - 1) / (6 * m + p - 1))
        assert share < 1 / 13
    for m in range(1, 2 * p):  # below 2P the V is never full; never worse than ZB-H1
        assert bubble("zbv", p, m) <= bubble("zb-h1", p, m) + 1e-12


def test_wgrad_splits_the_backward_and_defaults_to_half():
    """I = bwd - wgrad, W = wgrad; with no W at all ZB-H1 has nothing to fill bubbles with."""
    assert bubble("zb-h1", 4, 8, CostModel(fwd=1.0, bwd=2.0)) == bubble("zb-h1", 4, 8)
    no_w = CostModel(fwd=1.0, bwd=2.0, wgrad=0.0)
    assert bubble("zb-h1", 4, 8, no_w) == pytest.approx(bubble("1f1b", 4, 8))
    split = simulate(build_schedule("zb-h1", 2, 2, 1), CostModel(fwd=1.0, bwd=3.0, wgrad=1.0))
    durations = {str(a): e - s for a, s, e in split.timeline.spans(0)}
    assert (durations["0F0"], durations["0I0"], durations["0W0"]) == (1.0, 2.0, 1.0)


def test_a_rank_spreads_its_cost_over_its_stages_and_local_hops_are_free():
    cost = CostModel(fwd=(2.0, 4.0), bwd=4.0, latency=5.0)
    durations = cost.durations(Placement("v", 2, 2))
    assert durations["F"] == [1.0, 2.0, 2.0, 1.0]  # one number per rank, halved per stage
    per_stage = CostModel(fwd=(1.0, 2.0, 3.0, 4.0)).durations(Placement("loop", 2, 2))
    assert per_stage["F"] == [1.0, 2.0, 3.0, 4.0]
    spans = simulate(build_schedule("zbv", 2, 1, 1), cost).timeline.spans(1)
    start = {str(a): s for a, s, _ in spans}
    end = {str(a): e for a, _, e in spans}
    assert start["2F0"] == end["1F0"]  # stages 1 and 2 share rank 1: no transfer latency
    assert start["1F0"] == 1.0 + 5.0  # stage 0 (rank 0) -> stage 1 (rank 1): latency


# ----- peak in-flight micro-batches ---------------------------------------------------------------
GRID = [(p, m) for p in range(1, 7) for m in range(1, 13)]


@pytest.mark.parametrize(("p", "m"), GRID)
def test_peak_inflight_per_rank_is_the_papers(p, m):
    """Counted from F to the gradient (B, or W) over a rank's stages, each 1/v of its layers:

    - zb-h1: min(P, M) on every stage, which is 1F1B's peak on stage 0 (the paper's "same
      memory as 1F1B"); between F and I it holds 1F1B's own min(P-s, M);
    - zbv: 2P halves once M >= 2P-1, i.e. P whole micro-batches, 1F1B's stage 0 again;
    - interleaved-1f1b: its warm-up (v-1)g + 2(P-1-r) plus one, in 1/v pieces.
    """
    one_f_one_b = build_ledger(build_schedule("1f1b", p, m, 2))
    h1 = build_schedule("zb-h1", p, m, 2)
    assert rank_peak_inflight(h1) == [min(p, m)] * p
    assert max(rank_peak_inflight(h1)) == max(st.peak_inflight for st in one_f_one_b.stages)
    zbv = build_schedule("zbv", p, m, 2)
    assert rank_peak_inflight(zbv) == [min(2 * p, 2 * m, m + r + 1) for r in range(p)]
    if m >= 2 * p - 1:
        assert rank_peak_inflight(zbv) == [2 * p] * p
    for name, schedule in (("zb-h1", h1), ("zbv", zbv)):
        ledger = build_ledger(schedule)
        assert [st.peak_inflight for st in ledger.stages] == [
            peak_inflight(name, p, m, 2, s) for s in range(schedule.num_stages)
        ]
        assert rank_peak_inflight(schedule) == [rank_peak_bound(name, p, m, 2, r) for r in range(p)]
    if whole_rounds(p, m):
        for v in (2, 3):
            inter = build_schedule("interleaved-1f1b", p, m, 2, virtual_stages=v)
            g = m // max(1, m // p)
            expected = [min((v - 1) * g + 2 * (p - 1 - r) + 1, v * m) for r in range(p)]
            assert rank_peak_inflight(inter) == expected
            assert expected == [
                rank_peak_bound("interleaved-1f1b", p, m, 2, r, v) for r in range(p)
            ]
        ledger = build_ledger(build_schedule("interleaved-1f1b", p, m, 2))
        assert [st.peak_inflight for st in ledger.stages] == [
            peak_inflight("interleaved-1f1b", p, m, 2, s) for s in range(2 * p)
        ]


# ----- validity over a grid -----------------------------------------------------------------------
@pytest.mark.parametrize(("p", "m"), GRID)
def test_the_validator_accepts_every_new_schedule(p, m):
    for name, n in itertools.product(NEW, (1, 3)):
        for v in (2, 3) if name == "interleaved-1f1b" else (None,):
            if name == "interleaved-1f1b" and not whole_rounds(p, m):
                continue
            schedule = build_schedule(name, p, m, n, virtual_stages=v)
            validate(schedule)
            info = SCHEDULES[name]
            assert info.synchronous
            assert schedule.num_ranks == p
            assert schedule.num_actions() == num_actions(
                p, m, n, schedule.placement.stages_per_rank, info.split_backward
            )
            for st in build_ledger(schedule).stages:  # batch j at version j: plain accumulation
                for mb in range(schedule.total_microbatches):
                    assert st.fwd_version[mb] == st.bwd_version[mb] == mb // m
                    assert st.applied_step[mb] == mb // m + 1
                assert st.peak_versions == 1


@pytest.mark.parametrize("name", NEW)
def test_text_and_json_keep_the_placement(name, tmp_path):
    schedule = build_schedule(name, 3, 6, 2)
    assert Schedule.from_text(schedule.to_text()) == schedule
    assert Schedule.from_json(schedule.to_json()) == schedule
    assert Schedule.from_json(schedule.to_json()).placement == schedule.placement


GOLDEN = {
    ("interleaved-1f1b", 2, 2): [
        "0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1 0STEP1 2STEP1",
        "1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1 1STEP1 3STEP1",
    ],
    ("zb-h1", 3, 3): [
        "0F0 0F1 0F2 0I0 0W0 0I1 0W1 0I2 0W2 0STEP1",
        "1F0 1F1 1I0 1F2 1I1 1W0 1I2 1W1 1W2 1STEP1",
        "2F0 2I0 2F1 2I1 2F2 2I2 2W0 2W1 2W2 2STEP1",
    ],
    ("zbv", 2, 2): [
        "0F0 0F1 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 0I1 0W1 0STEP1 3STEP1",
        "1F0 2F0 1F1 2F1 2I0 2W0 1I0 1W0 2I1 2W1 1I1 1W1 1STEP1 2STEP1",
    ],
}


@pytest.mark.parametrize("key", list(GOLDEN), ids=lambda k: "-".join(map(str, k)))
def test_golden_orders(key):
    name, p, m = key
    schedule = build_schedule(name, p, m, 1)
    assert [" ".join(map(str, order)) for order in schedule.ranks] == GOLDEN[key]


# ----- torch 2.13's own orders as the oracle ------------------------------------------------------
TORCH_KIND = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}


def torch_orders(class_name: str, p: int, v: int, m: int) -> list[list[str]]:
    """torch's per-rank compute orders, built without stages or process groups: the generators
    read only these attributes (set as torch's constructors set them); the no-op slots go."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    sched = object.__new__(getattr(schedules, class_name))
    sched.pp_group_size, sched.n_local_stages, sched._n_microbatches = p, v, m
    sched.num_stages = v * p
    sched.number_of_rounds = max(1, m // p)
    sched.microbatches_per_round = m // sched.number_of_rounds
    return [
        [
            f"{a.stage_index}{TORCH_KIND[a.computation_type.name]}{a.microbatch_index}"
            for a in sched._calculate_single_rank_operations(rank)
            if a is not None
        ]
        for rank in range(p)
    ]


def our_orders(name: str, p: int, m: int, v: int | None = None) -> list[list[str]]:
    schedule = build_schedule(name, p, m, 1, virtual_stages=v)
    return [[str(a) for a in order if a.kind != "STEP"] for order in schedule.ranks]


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
def test_orders_equal_torchs(p):
    """ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble with one stage per rank (ZB-H1)
    and ScheduleZBVZeroBubble, rank by rank. (Schedule1F1B is no oracle: its pipeline_order
    fails torch's own validator on the last rank.)"""
    for m in range(1, 13):
        for v in (2, 3):
            if whole_rounds(p, m):
                assert our_orders("interleaved-1f1b", p, m, v) == torch_orders(
                    "ScheduleInterleaved1F1B", p, v, m
                ), (p, m, v)
        assert our_orders("zb-h1", p, m) == torch_orders(
            "ScheduleInterleavedZeroBubble", p, 1, m
        ), (p, m)
        assert our_orders("zbv", p, m) == torch_orders("ScheduleZBVZeroBubble", p, 2, m), (p, m)


# ----- bad inputs ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"name": "interleaved-1f1b", "num_stages": 4, "num_microbatches": 9},
            r"equal rounds of at least P=4: M=9 .* --microbatches 8",
        ),
        (
            {
                "name": "interleaved-1f1b",
                "num_stages": 4,
                "num_microbatches": 8,
                "virtual_stages": 1,
            },
            r"v >= 2 .* use 1f1b",
        ),
        (
            {"name": "zbv", "num_stages": 4, "num_microbatches": 8, "virtual_stages": 3},
            r"exactly 2 stages per rank in a V, got v=3",
        ),
        (
            {"name": "1f1b", "num_stages": 4, "num_microbatches": 8, "virtual_stages": 2},
            r"one stage per rank.*applies to interleaved-1f1b, zbv",
        ),
        (
            {"name": "zb-h1", "num_stages": 4, "num_microbatches": 8, "sync_warmup": 1},
            r"synchronous throughout",
        ),
        (
            {"name": "zbv", "num_stages": 64, "num_microbatches": 256, "num_steps": 100},
            r"P=64 stages x v=2.*P x v x steps x \(3M \+ 1\)",
        ),
    ],
)
def test_bad_schedule_inputs_name_the_fix(kwargs, message):
    kwargs.setdefault("num_steps", 2)
    with pytest.raises(ScheduleError, match=message):
        build_schedule(**kwargs)


def test_wgrad_larger_than_bwd_is_refused():
    with pytest.raises(ValueError, match=r"--wgrad 3 exceeds --bwd 2.*at most --bwd"):
        CostModel(fwd=1.0, bwd=2.0, wgrad=3.0)
    cost = CostModel(bwd=(2.0, 1.0), wgrad=1.5)  # per rank: caught once spread over stages
    with pytest.raises(ValueError, match=r"--wgrad 1.5 exceeds --bwd 1 on stage 1"):
        simulate(build_schedule("zb-h1", 2, 2, 1), cost)
    with pytest.raises(
        ValueError, match=r"3 durations for 4 stages on 2 ranks.*one per rank \(2\)"
    ):
        CostModel(fwd=(1.0, 2.0, 3.0)).durations(Placement("v", 2, 2))


def test_the_cli_refuses_bad_inputs_in_one_line(capsys):
    code = main(["simulate", "--schedule", "zbv", "--bwd", "2", "--wgrad", "3"])
    assert code != 0
    assert "--wgrad 3 exceeds --bwd 2" in capsys.readouterr().err
    code = main(["show", "--schedule", "interleaved-1f1b", "-P", "4", "-M", "9"])
    assert code != 0
    assert "equal rounds" in capsys.readouterr().err


def test_simulate_all_skips_what_does_not_fit_and_says_so(capsys):
    assert main(["simulate", "--schedule", "all", "-P", "4", "-M", "9", "-N", "1", "--json"]) == 0
    out, err = capsys.readouterr()
    assert "note: interleaved-1f1b skipped" in err
    assert "zbv" in out and "interleaved-1f1b" not in out


@pytest.mark.parametrize(
    ("ranks", "reason"),
    [
        (
            [["0F0", "0B0", "0STEP1"], ["1F0", "1I0", "1W0", "1STEP1"]],
            "split every backward or none",
        ),
        (
            [["0F0", "0I0", "0W0", "0STEP1"], ["1F0", "1W0", "1I0", "1STEP1"]],
            "W of micro-batch 0 before its input gradient I",
        ),
        (
            [["0F0", "0I0", "0STEP1"], ["1F0", "1I0", "1W0", "1STEP1"]],
            "the gradient of micro-batch 0",
        ),
        ([["0F0", "0I0", "0W0", "0STEP1"], ["1F0", "1I0"]], "missing 1W0"),
    ],
)
def test_the_validator_names_split_backward_mistakes(ranks, reason):
    schedule = Schedule(
        "hand",
        2,
        1,
        1,
        "current",
        "current",
        tuple(tuple(Action.parse(t) for t in order) for order in ranks),
    )
    with pytest.raises(ScheduleValidationError, match=reason):
        validate(schedule)


def test_the_validator_checks_stages_against_the_placement():
    schedule = build_schedule("zbv", 2, 1, 1)
    swapped = Schedule(
        "hand",
        4,
        1,
        1,
        "current",
        "current",
        (schedule.ranks[1], schedule.ranks[0]),
        placement=schedule.placement,
    )
    with pytest.raises(ScheduleValidationError, match=r"stage 1 runs on rank 1, not rank 0"):
        validate(swapped)
    with pytest.raises(ScheduleError, match=r"placement holds 3 stages on .*|3 stages"):
        Schedule("x", 3, 1, 1, "current", "current", ((), ()), placement=Placement("v", 2, 2))
