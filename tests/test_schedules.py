"""Property tests of the generators against the closed forms of docs/semantics.md.

The checks here recompute every quantity from the raw per-rank orders (counting, walking), not
through the ledger, except where the ledger itself is under test; closed forms are the oracle.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nobubble.core.ir import STEP, B, F, I, Schedule
from nobubble.core.ledger import build_ledger, stage_order
from nobubble.core.schedules import SCHEDULE_NAMES, SCHEDULES, build_schedule
from nobubble.core.schedules.bounds import peak_inflight
from nobubble.core.validate import validate

grid = settings(max_examples=60, deadline=None)
stages = st.integers(1, 16)
micro = st.integers(1, 32)
accum = st.integers(1, 12)
steps = st.integers(1, 5)
SYNC = [name for name, info in SCHEDULES.items() if info.synchronous]


def make(name: str, p: int, m: int, n: int, a: int | None = None) -> Schedule:
    if name == "2bw":
        m = max(m, p - 1)
    if name == "interleaved-1f1b" and m >= p:
        m -= m % p  # rounds of P micro-batches
    if name == "dualpipev":
        m = max(m, 2 * p)  # at least as many micro-batches as stages
    schedule = build_schedule(name, p, m, n, accum=a)
    validate(schedule)
    return schedule


def walk(schedule: Schedule, stage: int) -> dict[str, dict[int, int]]:
    """Positions of every F, B (or I) and W and the step count at each, straight from the order
    of the stage's rank."""
    out: dict[str, dict[int, int]] = {"F": {}, "B": {}, "W": {}, "Fv": {}, "Bv": {}, "Wv": {}}
    version = 0
    for pos, action in enumerate(stage_order(schedule, stage)):
        if action.kind == STEP:
            version += 1
        else:
            kind = B if action.kind == I else action.kind
            assert action.number not in out[kind], f"duplicate {action}"
            out[kind][action.number] = pos
            out[kind + "v"][action.number] = version
    return out


@grid
@given(name=st.sampled_from(SCHEDULE_NAMES), p=stages, m=micro, n=steps, a=accum)
def test_every_microbatch_has_one_forward_and_one_backward_per_stage(name, p, m, n, a):
    schedule = make(name, p, m, n, a if name in ("pipedream", "paci") else None)
    total = schedule.total_microbatches
    for s in range(schedule.num_stages):
        seen = walk(schedule, s)
        assert sorted(seen["F"]) == list(range(total))
        assert sorted(seen["B"]) == list(range(total))
        assert all(seen["F"][mb] < seen["B"][mb] for mb in range(total))
        if schedule.split_backward:  # one W per micro-batch, after its I
            assert all(seen["B"][mb] < seen["W"][mb] for mb in range(total))
        steps_ = [x.number for x in stage_order(schedule, s) if x.kind == STEP]
        assert steps_ == list(range(1, n + 1))


@grid
@given(name=st.sampled_from(SYNC), p=stages, m=micro, n=steps)
def test_sync_schedules_run_batch_j_at_version_j(name, p, m, n):
    schedule = make(name, p, m, n)
    m = schedule.num_microbatches
    ledger = build_ledger(schedule)
    for s in range(schedule.num_stages):
        seen = walk(schedule, s)
        for mb in range(schedule.total_microbatches):
            assert seen["Fv"][mb] == seen["Bv"][mb] == mb // m
            assert ledger.stages[s].fwd_version[mb] == ledger.stages[s].bwd_version[mb] == mb // m
            assert ledger.stages[s].applied_step[mb] == mb // m + 1
            if schedule.split_backward:
                assert seen["Wv"][mb] == mb // m
        expected_inflight = peak_inflight(name, p, m, n, s)
        if name in ("gpipe", "1f1b"):
            assert expected_inflight == (m if name == "gpipe" else min(p - s, m))
        assert ledger.stages[s].peak_inflight == expected_inflight
        assert ledger.stages[s].peak_versions == 1


@grid
@given(p=stages, m=micro, n=steps)
def test_2bw_has_delay_exactly_one_and_two_versions(p, m, n):
    schedule = make("2bw", p, m, n)
    m = schedule.num_microbatches
    ledger = build_ledger(schedule)
    for s in range(p):
        st_ = ledger.stages[s]
        seen = walk(schedule, s)
        for mb in range(schedule.total_microbatches):
            j = mb // m
            assert st_.fwd_version[mb] == st_.bwd_version[mb] == max(j - 1, 0)
            assert st_.fwd_version[mb] <= seen["Fv"][mb]  # the version exists at forward time
            assert st_.delay[mb] == (0 if j == 0 else 1)
        assert st_.peak_versions <= 2
        assert st_.peak_inflight == min(p - s, schedule.total_microbatches)


def test_2bw_rejects_too_few_microbatches():
    with pytest.raises(ValueError, match=r"M >= P-1.*M=2 with P=4"):
        build_schedule("2bw", 4, 2, 3)


@grid
@given(p=stages, a=accum, n=steps)
def test_pipedream_delay_bound(p, a, n):
    schedule = make("pipedream", p, 1, n, a)
    ledger = build_ledger(schedule)
    for s in range(p):
        st_ = ledger.stages[s]
        seen = walk(schedule, s)
        bound = math.ceil((p - 1 - s) / a)
        for mb in range(schedule.total_microbatches):
            assert st_.bwd_version[mb] == st_.fwd_version[mb] == seen["Fv"][mb]  # stashed
            assert 0 <= st_.delay[mb] <= bound
        if s == p - 1:
            assert max(st_.delay) == 0
        assert st_.peak_versions <= math.ceil((p - s) / a) + 1
        assert st_.peak_inflight == min(p - s, schedule.total_microbatches)


def test_pipedream_delay_bound_is_reached_in_steady_state():
    ledger = build_ledger(make("pipedream", 8, 1, 40, 2))
    assert [max(st.delay) for st in ledger.stages] == [math.ceil((7 - s) / 2) for s in range(8)]


@grid
@given(p=stages, a=accum, n=steps)
def test_paci_crossed_updates_bound_and_share(p, a, n):
    schedule = make("paci", p, 1, n, a)
    ledger = build_ledger(schedule)
    for s in range(p):
        st_ = ledger.stages[s]
        seen = walk(schedule, s)
        crossed = [seen["Bv"][mb] - seen["Fv"][mb] for mb in range(schedule.total_microbatches)]
        assert crossed == st_.crossed
        assert max(crossed) <= math.ceil((p - 1 - s) / a)
        for mb in range(schedule.total_microbatches):
            assert st_.bwd_version[mb] == mb // a  # backward at the synchronous version
        if a >= p - 1 - s:
            # every step but the last is crossed by exactly the P-1-s micro-batches in flight
            assert sum(c > 0 for c in crossed) == (n - 1) * (p - 1 - s)
            assert max(crossed) <= 1
        assert st_.peak_versions == 1
        assert st_.peak_inflight == min(p - s, schedule.total_microbatches)
    assert max(ledger.stages[-1].crossed) == 0


@grid
@given(
    name=st.sampled_from(["pipedream", "2bw", "paci"]),
    p=st.integers(2, 8),
    m=st.integers(1, 8),
    n=st.integers(2, 6),
    k=st.integers(1, 3),
)
def test_drain_points_leave_nothing_in_flight(name, p, m, n, k):
    schedule = build_schedule(name, p, max(m, p - 1), n, drain_every=k)
    validate(schedule)
    per = schedule.num_microbatches
    for s in range(p):
        inflight, steps_done = 0, 0
        for action in schedule.ranks[s]:
            inflight += {F: 1, B: -1}.get(action.kind, 0)
            if action.kind == STEP:
                steps_done += 1
                if steps_done % k == 0:
                    assert inflight == 0, f"stage {s} not drained at step {steps_done}"
        assert inflight == 0
    assert per >= 1


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_text_and_json_round_trip(name, tmp_path):
    schedule = make(name, 3, 4, 3)
    assert Schedule.from_text(schedule.to_text()) == schedule
    path = tmp_path / "s.json"
    schedule.save_json(path)
    assert Schedule.load_json(path) == schedule


GOLDEN = {
    ("gpipe", 2, 2, 1): [
        "0F0 0F1 0B0 0B1 0STEP1",
        "1F0 1F1 1B0 1B1 1STEP1",
    ],
    ("1f1b", 3, 3, 1): [
        "0F0 0F1 0F2 0B0 0B1 0B2 0STEP1",
        "1F0 1F1 1B0 1F2 1B1 1B2 1STEP1",
        "2F0 2B0 2F1 2B1 2F2 2B2 2STEP1",
    ],
    ("1f1b", 2, 2, 2): [
        "0F0 0F1 0B0 0B1 0STEP1 0F2 0F3 0B2 0B3 0STEP2",
        "1F0 1B0 1F1 1B1 1STEP1 1F2 1B2 1F3 1B3 1STEP2",
    ],
    ("pipedream", 3, 1, 4): [
        "0F0 0F1 0F2 0B0 0STEP1 0F3 0B1 0STEP2 0B2 0STEP3 0B3 0STEP4",
        "1F0 1F1 1B0 1STEP1 1F2 1B1 1STEP2 1F3 1B2 1STEP3 1B3 1STEP4",
        "2F0 2B0 2STEP1 2F1 2B1 2STEP2 2F2 2B2 2STEP3 2F3 2B3 2STEP4",
    ],
    ("2bw", 3, 2, 2): [
        "0F0 0F1 0F2 0B0 0F3 0B1 0STEP1 0B2 0B3 0STEP2",
        "1F0 1F1 1B0 1F2 1B1 1STEP1 1F3 1B2 1B3 1STEP2",
        "2F0 2B0 2F1 2B1 2STEP1 2F2 2B2 2F3 2B3 2STEP2",
    ],
    ("paci", 3, 2, 2): [
        "0F0 0F1 0F2 0B0 0F3 0B1 0STEP1 0B2 0B3 0STEP2",
        "1F0 1F1 1B0 1F2 1B1 1STEP1 1F3 1B2 1B3 1STEP2",
        "2F0 2B0 2F1 2B1 2STEP1 2F2 2B2 2F3 2B3 2STEP2",
    ],
}


@pytest.mark.parametrize("key", list(GOLDEN), ids=lambda k: "-".join(map(str, k)))
def test_golden_orders(key):
    name, p, m, n = key
    schedule = build_schedule(name, p, m, n, accum=m if name in ("pipedream", "paci") else None)
    assert [" ".join(map(str, order)) for order in schedule.ranks] == GOLDEN[key]


def test_2bw_and_paci_share_the_order_but_not_the_versions():
    two_bw, paci = build_schedule("2bw", 4, 4, 3), build_schedule("paci", 4, 4, 3)
    assert two_bw.ranks == paci.ranks
    assert build_ledger(two_bw).stages[0].fwd_version != build_ledger(paci).stages[0].fwd_version
