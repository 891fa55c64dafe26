"""A schedule given as an order (a torch CSV or nobubble JSON file, or a ``Schedule``) trains.

The oracle is plain gradient accumulation on the unsplit model (tests/_api_reference.py), as for
the named synchronous schedules; the orders come from ``nobubble show`` and from torch's own
generator (``get_schedule_ops``, no process group). The dist run is compared with the emulator's
run of the named schedule, bit for bit.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

import pytest

import nobubble
from _api_reference import M, Problem, adamw, assert_bitwise, plain_accumulation, weights
from _dist_helpers import assert_same_state, emulate, load_parts, numbers, run_train, small_flags
from nobubble.app.train.checkpoint import CheckpointError, check_resumable
from nobubble.app.train.config import TrainConfig
from nobubble.app.train.metrics import read_metrics
from nobubble.cli import main
from nobubble.core.schedules import build_schedule
from nobubble.core.torch_csv import to_torch_csv
from test_api import SEQ

STEPS = 18  # past the first horizon (16 steps): the order is repeated further on the way


def show_csv(tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, *args: str) -> Path:
    flags = ["--schedule", name, *args, "--microbatches", str(M), "--steps", "1"]
    assert main(["show", *flags, "--format", "torch-csv"]) == 0
    path = tmp_path / f"{name}.csv"
    path.write_text(capsys.readouterr().out)
    return path


def train(problem: Problem, stages_n: int, **source: object) -> tuple[list[float], dict]:
    model = problem.make_model()
    pipe = nobubble.Pipeline(
        problem.cut(model, stages_n), problem.loss_fn, microbatches=M, optimizer=adamw, **source
    )
    losses: dict[int, float] = {}
    for j in range(STEPS):
        losses.update({x.microbatch: x.value for x in pipe.step(*problem.batch(j)).losses})
    losses.update({x.microbatch: x.value for x in pipe.drain().losses})
    return [losses[m] for m in range(STEPS * M)], weights(pipe.stages)


@pytest.mark.parametrize(
    ("name", "args", "stages_n"),
    [
        ("1f1b", ["--stages", "4"], 4),
        ("zb-h1", ["--stages", "4"], 4),  # a split backward: I and W
        ("interleaved-1f1b", ["--stages", "2", "--virtual-stages", "2"], 4),  # a loop
        ("zbv", ["--stages", "2"], 4),  # a V, split backward
    ],
)
def test_a_shown_torch_csv_trains_like_plain_accumulation(tmp_path, capsys, name, args, stages_n):
    path = show_csv(tmp_path, capsys, name, *args)
    losses, trained = train(SEQ, stages_n, from_torch_csv=str(path))
    ref_losses, ref_weights = plain_accumulation(SEQ, STEPS)
    assert losses == ref_losses
    assert_bitwise(trained, ref_weights)


def test_a_torch_generated_order_nobubble_has_no_generator_for_trains(tmp_path):
    """torch's InterleavedZeroBubble (2 ranks, 2 stages each in a loop, split backward)."""
    visualizer = pytest.importorskip("torch.distributed.pipelining._schedule_visualizer")
    rows = visualizer.get_schedule_ops("InterleavedZeroBubble", 2, M, 2)
    out = io.StringIO()
    csv.writer(out).writerows([["" if a is None else str(a) for a in row] for row in rows])
    path = tmp_path / "izb.csv"
    path.write_text(out.getvalue())
    losses, trained = train(SEQ, 4, from_torch_csv=str(path))
    ref_losses, ref_weights = plain_accumulation(SEQ, STEPS)
    assert losses == ref_losses
    assert_bitwise(trained, ref_weights)


def test_a_schedule_object_and_a_json_file_train_the_same(tmp_path):
    order = build_schedule("zb-h1", 2, M, 3)  # three batches: the first is what repeats
    order.save_json(tmp_path / "zb.json")
    ref_losses, ref_weights = plain_accumulation(SEQ, STEPS)
    for source in ({"schedule": order}, {"from_json": str(tmp_path / "zb.json")}):
        losses, trained = train(SEQ, 2, **source)
        assert losses == ref_losses
        assert_bitwise(trained, ref_weights)


# ----- refusals, before any work --------------------------------------------------------------
def test_an_order_of_other_m_ranks_or_stages_is_refused_naming_both(tmp_path, capsys):
    path = str(show_csv(tmp_path, capsys, "1f1b", "--stages", "2"))  # P=2, M=4
    model = SEQ.make_model()
    with pytest.raises(ValueError, match=r"runs M=4 .* microbatches=2: set microbatches=4"):
        nobubble.Pipeline(SEQ.cut(model, 2), SEQ.loss_fn, from_torch_csv=path, microbatches=2)
    with pytest.raises(ValueError, match=r"runs 2 stages .* but 3 stage modules were given"):
        nobubble.Pipeline(SEQ.cut(model, 3), SEQ.loss_fn, from_torch_csv=path, microbatches=M)
    with pytest.raises(ValueError, match=r"holds 2 ranks .* the run has 3 .*: set --stages 2"):
        TrainConfig.of(from_torch_csv=path, num_ranks=3, microbatches=M)
    with pytest.raises(ValueError, match=r"places 1 stage\(s\) per rank, but virtual_stages=2"):
        TrainConfig.of(from_torch_csv=path, num_ranks=2, microbatches=M, virtual_stages=2)
    with pytest.raises(ValueError, match=r"schedule='zbv' and from_torch_csv=.* two schedules"):
        TrainConfig.of(from_torch_csv=path, schedule="zbv", num_ranks=2, microbatches=M)


def test_an_asynchronous_order_is_refused(tmp_path):
    build_schedule("2bw", 2, M, 2).save_json(tmp_path / "2bw.json")
    with pytest.raises(ValueError, match=r"from_json=.*2bw.json' is asynchronous .* by its name"):
        TrainConfig.of(from_json=str(tmp_path / "2bw.json"), num_ranks=2, microbatches=M)
    paci = build_schedule("paci", 2, M, 2)  # weight rules "current", steps inside a batch
    with pytest.raises(ValueError, match=r"not one flushed batch per step"):
        nobubble.Pipeline(SEQ.cut(SEQ.make_model(), 2), SEQ.loss_fn, schedule=paci, microbatches=M)


def test_a_file_that_fails_validation_names_rank_step_and_cell(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("0F0,,0F1,0B0,0B1\n,1F0,1B1,1F1,1B0\n")
    with pytest.raises(ValueError) as err:
        TrainConfig.of(from_torch_csv=str(path), num_ranks=2, microbatches=2)
    assert str(err.value).startswith("torch CSV: rank 1, step 2 (cell '1B1', batch 0)")
    assert "[1B1]" in str(err.value)  # the grid around it
    flags = ["--from-torch-csv", str(path), "--stages", "2", "--microbatches", "2"]
    assert main(["train", *flags]) == 2  # the command line refuses it before any work


def test_a_run_resumes_only_the_same_order_from_wherever_the_file_is(corpus, tmp_path):
    """The fingerprint holds the order's hash, not the file's path: a copy elsewhere resumes,
    another order under the same name is refused before any work."""
    first = tmp_path / "1f1b.csv"
    first.write_text(to_torch_csv(build_schedule("1f1b", 2, 2, 1)))
    flags = small_flags(corpus, "1f1b", 2, steps=4, eval_every=2, checkpoint_every=2)
    at = flags.index("--schedule")
    flags[at : at + 2] = ["--from-torch-csv", str(first)]
    run = tmp_path / "run"
    assert main(["train", *flags, "--stop-at", "2", "--out", str(run)]) == 0
    other = tmp_path / "other" / "1f1b.csv"  # gpipe's order under the same name
    other.parent.mkdir()
    other.write_text(to_torch_csv(build_schedule("gpipe", 2, 2, 1)))
    config = TrainConfig.of(from_torch_csv=str(first), num_ranks=2, microbatches=2)
    with pytest.raises(CheckpointError, match="schedule_order"):
        check_resumable(
            {"fingerprint": config.fingerprint()},
            config.replace(from_torch_csv=str(other)),
            tmp_path,
        )
    assert main(["train", "--resume", str(run), "--from-torch-csv", str(other)]) == 2
    moved = first.rename(tmp_path / "moved.csv")
    assert main(["train", "--resume", str(run), "--from-torch-csv", str(moved)]) == 0
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4]


# ----- the distributed runtime ----------------------------------------------------------------
def test_dist_trains_a_torch_csv_as_the_emulator_trains_the_named_schedule(corpus, tmp_path):
    """2 gloo processes run the file's zb-h1 order; the emulator runs --schedule zb-h1."""
    path = tmp_path / "zb.csv"
    path.write_text(to_torch_csv(build_schedule("zb-h1", 2, 2, 1)))
    flags = small_flags(corpus, "zb-h1", 2, steps=2, eval_every=2, dist_timeout=30)
    emu = emulate(flags, tmp_path / "emulated")
    at = flags.index("--schedule")
    flags[at : at + 2] = ["--from-torch-csv", str(path)]
    done = run_train(*flags, "--runtime", "dist", "--out", str(tmp_path / "dist"))
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "dist"
    assert numbers(read_metrics(run)) == numbers(read_metrics(emu))
    for stage, (d, e) in enumerate(zip(load_parts(run, 2), load_parts(emu, 2), strict=True)):
        assert_same_state(d["module"], e["module"], f"stage{stage}.module")
