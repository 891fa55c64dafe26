"""torch.distributed.pipelining's CSV schedule format, in and out (core/torch_csv.py).

Round trips are pure. The orders torch itself generates come from
``_schedule_visualizer.get_schedule_ops`` (no process group), written to CSV as torch's
``_dump_csv`` writes them (csv.writer, an idle slot as an empty cell), and read back.
"""

from __future__ import annotations

import csv
import io
import itertools

import pytest

from nobubble.cli import main
from nobubble.core.ir import Action, Schedule, ScheduleError
from nobubble.core.schedules import SCHEDULES, build_schedule
from nobubble.core.sim import CostModel, simulate
from nobubble.core.torch_csv import (
    TorchCsvError,
    from_torch_csv,
    load_torch_csv,
    to_torch_csv,
    validate_torch_csv,
)
from nobubble.core.validate import validate

SYNC = [name for name, info in SCHEDULES.items() if info.synchronous]
ASYNC = [name for name, info in SCHEDULES.items() if not info.synchronous]


def sync_schedules() -> list[Schedule]:
    out = []
    for name, p in itertools.product(SYNC, (1, 2, 3)):
        for m in (1, p, 2 * p + 1):
            virtual = (2, 3) if SCHEDULES[name].placement == "loop" else (None,)
            for v in virtual:
                try:
                    out.append(build_schedule(name, p, m, 3, virtual_stages=v))
                except ScheduleError:
                    continue  # a (P, M) the schedule refuses
    return out


def test_every_synchronous_schedule_round_trips():
    schedules = sync_schedules()
    assert {s.name for s in schedules} == set(SYNC)
    for schedule in schedules:
        text = to_torch_csv(schedule)
        assert len(text.splitlines()) == schedule.num_ranks
        back = from_torch_csv(
            text,
            name=schedule.name,
            num_steps=schedule.num_steps,
            placement=schedule.placement.kind,
        )
        assert back == schedule, schedule.header()


def test_torch_reads_what_nobubble_writes():
    """Every cell parses with torch's own _Action.from_str and prints back unchanged."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    for schedule in (s for s in sync_schedules() if s.num_ranks == 3):
        for row in csv.reader(io.StringIO(to_torch_csv(schedule))):
            assert [repr(schedules._Action.from_str(cell)) for cell in row] == row


@pytest.mark.parametrize("name", ASYNC)
def test_asynchronous_schedules_are_refused_with_the_reason(name):
    schedule = build_schedule(name, 3, 4, 2)
    with pytest.raises(TorchCsvError, match=r"asynchronous.*no column in torch's CSV format"):
        to_torch_csv(schedule)


def test_a_schedule_whose_batches_differ_is_refused():
    schedule = build_schedule("1f1b", 2, 2, 2)
    swapped = list(schedule.ranks[0])
    second = swapped.index(schedule.ranks[0][0]._replace(number=2))
    swapped[second], swapped[second + 1] = swapped[second + 1], swapped[second]  # 0F2 0F3
    bad = Schedule(**{**schedule.__dict__, "ranks": (tuple(swapped), schedule.ranks[1])})
    with pytest.raises(TorchCsvError, match="rank 0 runs batch 1 in another order"):
        to_torch_csv(bad)


def test_a_stage_may_step_before_its_ranks_other_stage_finishes():
    """Rank 1 of zbv at P=2 holds stages 1 and 2; stage 2's step moved to right after its
    last W, before stage 1's last Ws, is the same batch per step: same rows."""
    schedule = build_schedule("zbv", 2, 4, 2)
    order = [a for a in schedule.ranks[1] if str(a) != "2STEP1"]
    last_w = max(i for i, a in enumerate(order) if str(a) == "2W3")
    order.insert(last_w + 1, Action(2, "STEP", 1))
    early = Schedule(**{**schedule.__dict__, "ranks": (schedule.ranks[0], tuple(order))})
    assert early != schedule
    validate(early)
    assert to_torch_csv(early) == to_torch_csv(schedule)


# ----- torch's own orders -------------------------------------------------------------------------
TORCH = {  # class name -> (stages per rank, nobubble's schedule with the same order, or None)
    "GPipe": (1, "gpipe"),
    "Interleaved1F1B": (2, "interleaved-1f1b"),
    "InterleavedZeroBubble": (2, None),
    "ZBVZeroBubble": (2, "zbv"),
    "DualPipeV": (2, "dualpipev"),
    "LoopedBFS": (2, "looped-bfs"),
}


def torch_csv(name: str, p: int, m: int, v: int, with_comms: bool = False) -> str:
    visualizer = pytest.importorskip("torch.distributed.pipelining._schedule_visualizer")
    rows = visualizer.get_schedule_ops(name, p, m, v, with_comms=with_comms)
    out = io.StringIO()
    csv.writer(out).writerows([["" if a is None else str(a) for a in row] for row in rows])
    return out.getvalue()


@pytest.mark.parametrize(("p", "m"), [(2, 4), (2, 6), (3, 6), (4, 8)])
@pytest.mark.parametrize("name", list(TORCH))
def test_torchs_orders_read_validate_and_simulate(name, p, m):
    v, ours = TORCH[name]
    text = torch_csv(name, p, m, v)
    if name == "DualPipeV":
        assert "OVERLAP_F_B" in text and ",," not in text
    schedule = from_torch_csv(text, name=name, num_steps=2)
    validate_torch_csv(schedule)
    assert (schedule.num_ranks, schedule.num_microbatches) == (p, m)
    result = simulate(schedule, CostModel(fwd=1.0, bwd=2.0, wgrad=1.0))
    assert 0 <= result.metrics.bubble_share < 1
    if ours is not None:
        assert schedule.ranks == build_schedule(ours, p, m, 2).ranks


def test_the_compute_comms_form_reads_as_the_compute_only_form():
    """torch's lowering adds SEND/RECV actions; nobubble derives its own transfers."""
    for name in ("Interleaved1F1B", "DualPipeV"):
        with_comms = from_torch_csv(torch_csv(name, 2, 4, 2, with_comms=True))
        assert "SEND_F" in torch_csv(name, 2, 4, 2, with_comms=True)
        assert with_comms == from_torch_csv(torch_csv(name, 2, 4, 2))


def test_torchs_1f1b_order_is_refused_naming_its_last_rank():
    """torch 2.13's Schedule1F1B.pipeline_order (what get_schedule_ops shows; torch's runtime
    runs 1F1B by other code) numbers the last rank's forwards from 1: 1F1 .. 1F4 for M=4."""
    schedule = from_torch_csv(torch_csv("1F1B", 2, 4, 1), name="torch-1f1b")
    with pytest.raises(TorchCsvError) as err:
        validate_torch_csv(schedule)
    message = str(err.value)
    assert message.startswith("torch CSV: rank 1, step 1 (cell '1B0', batch 0): ")
    assert "backward of micro-batch 0 before its forward" in message
    assert "[1B0]" in message  # the grid, the failing cell marked


# ----- errors -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0F0,0X0\n", r"rank 0, step 1, cell '0X0': expected <stage><KIND><micro-batch>"),
        ("0F0,0B\n", r"rank 0, step 1, cell '0B': B needs a micro-batch index"),
        ("0F0,(0F1;0B0)OVERLAP\n", r"composite kind 'OVERLAP' is not OVERLAP_F_B"),
        ("\n\n", r"no rows"),
        ("0REDUCE_GRAD\n", r"no forward or backward in any row"),
        ("0F0,0B0\n0F0,0B0\n", r"\(rank 0: 0; rank 1: 0\) fit no placement"),
    ],
)
def test_malformed_files_name_the_cell(text, message):
    with pytest.raises(TorchCsvError, match=message):
        from_torch_csv(text)


def test_a_bad_order_names_rank_step_and_cell_with_the_grid():
    text = "0F0,,0F1,0B0,0B1\n,1F0,1B1,1F1,1B0\n"
    with pytest.raises(TorchCsvError) as err:
        validate_torch_csv(from_torch_csv(text, name="bad", num_steps=2))
    first, *grid = str(err.value).splitlines()
    assert first.startswith("torch CSV: rank 1, step 2 (cell '1B1', batch 0): invalid schedule")
    assert first.endswith("backward of micro-batch 1 before its forward")
    assert "[1B1]" in grid[2]


# ----- the command line ---------------------------------------------------------------------------
def test_show_writes_and_every_command_reads_torch_csv(tmp_path, capsys):
    path = tmp_path / "dpv.csv"
    args = ["--schedule", "dualpipev", "--stages", "2", "--microbatches", "4", "--steps", "1"]
    assert main(["show", *args, "--format", "torch-csv"]) == 0
    path.write_text(capsys.readouterr().out)
    assert path.read_text() == to_torch_csv(build_schedule("dualpipev", 2, 4, 1))
    assert main(["show", "--from-torch-csv", str(path), "--steps", "2", "--format", "json"]) == 0
    shown = capsys.readouterr().out
    assert Schedule.from_json(__import__("json").loads(shown)).ranks == (
        build_schedule("dualpipev", 2, 4, 2).ranks
    )
    assert main(["simulate", "--from-torch-csv", str(path), "--steps", "1"]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[:3] == ["dpv", "4", "12.5"]
    assert main(["ledger", "--from-torch-csv", str(path), "--summary-only"]) == 0
    assert "crossed-update histogram: {0: 64}" in capsys.readouterr().out
    assert load_torch_csv(path).name == "dpv"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["show", "--schedule", "2bw", "--format", "torch-csv"], "asynchronous"),
        (["show", "--schedule", "1f1b,gpipe", "--format", "torch-csv"], "writes one schedule"),
        (["simulate", "--from-torch-csv", "nope.csv"], "does not exist"),
        (["show", "--from-torch-csv", "a.csv", "--from-json", "b.json"], "not both"),
    ],
)
def test_the_cli_refuses_in_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
