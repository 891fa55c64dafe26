"""The multi-process runtime as users run it: ``nobubble train --runtime dist`` in real processes.

The emulator is the reference: one process, same flags. A dist run must reproduce its numbers
bit for bit (same torch thread count) and write a measured timeline. Faults, bad inputs and
teardown: tests/test_dist_faults.py.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from _dist_helpers import (
    MEASURED,
    assert_same_state,
    emulate,
    load_parts,
    numbers,
    run_train,
    small_flags,
)
from nobubble.app.train.metrics import read_metrics

STEPS, MICROBATCHES = 6, 2  # the defaults of small_flags


def launch(flags: list[str], out: Path) -> Path:
    done = run_train(*flags, "--runtime", "dist", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def dist_run(corpus, tmp_path_factory):
    """``dist_run(schedule, stages)``: a finished small dist run, started once per module."""
    runs: dict[tuple[str, int, bool], Path] = {}

    def get(schedule: str, stages: int, strict: bool = False) -> Path:
        if (schedule, stages, strict) not in runs:
            out = tmp_path_factory.mktemp(f"dist-{schedule}-{stages}") / "run"
            flags = flags_for(corpus, schedule, stages)
            if strict:
                flags += ["--strict-p2p", "true"]
            runs[schedule, stages, strict] = launch(flags, out)
        return runs[schedule, stages, strict]

    return get


def flags_for(corpus: Path, schedule: str, stages: int) -> list[str]:
    # as many micro-batches as stages at P > 2, so every stage is busy in the steady state
    microbatches = MICROBATCHES if stages == 2 else stages
    return small_flags(corpus, schedule, stages, microbatches=microbatches, dist_timeout=30)


# ----- 1. the dist runtime computes what the emulator computes -----------------------------------
def assert_equivalent(dist_dir: Path, emu_dir: Path, stages: int) -> None:
    dist_records, emu_records = read_metrics(dist_dir), read_metrics(emu_dir)
    assert [r["step"] for r in dist_records] == list(range(1, STEPS + 1))
    assert numbers(dist_records) == numbers(emu_records)  # floats from JSON: bit for bit
    for d, e in zip(dist_records, emu_records, strict=True):
        assert set(d) - set(e) <= set(MEASURED), "the dist runtime adds only measured keys"
    for stage, (d, e) in enumerate(
        zip(load_parts(dist_dir, stages), load_parts(emu_dir, stages), strict=True)
    ):
        assert_same_state(d["module"], e["module"], f"stage{stage}.module")
        assert_same_state(d, e, f"stage{stage}")  # optimizer, correction, weight versions too


@pytest.fixture(scope="module")
def emulated(corpus, tmp_path_factory):
    """``emulated(schedule, stages)``: the emulator's run of ``flags_for``, once per module (the
    production transport and the NCCL-rules transport are both compared with it)."""
    runs: dict[tuple[str, int], Path] = {}

    def get(schedule: str, stages: int) -> Path:
        if (schedule, stages) not in runs:
            out = tmp_path_factory.mktemp(f"emulated-{schedule}-{stages}") / "run"
            runs[schedule, stages] = emulate(flags_for(corpus, schedule, stages), out)
        return runs[schedule, stages]

    return get


# Through the CLI, one synchronous, one delayed and one accumulating schedule: metrics,
# validation and every checkpoint part (optimizer, correction, weight versions). Every schedule
# at P = 2, 3 and 4, under both transports, runs through the same runner in
# tests/test_api_dist.py, one launch per P.
@pytest.mark.parametrize("schedule", ["1f1b", "2bw", "paci"])
def test_dist_matches_the_emulator_bitwise(dist_run, emulated, schedule):
    assert_equivalent(dist_run(schedule, 2), emulated(schedule, 2), stages=2)


@pytest.mark.slow
def test_dist_matches_the_emulator_bitwise_on_four_stages(dist_run, emulated):
    assert_equivalent(dist_run("paci", 4), emulated("paci", 4), stages=4)


@pytest.mark.slow
def test_dist_paci_with_fewer_microbatches_than_stages_matches_the_emulator(corpus, tmp_path):
    """P=5, M=2 (M < P - 2): gloo's receives posted ahead of their consumers each wait alone.
    Posted as one batch, the wait for one of them waited for all, among them a gradient that
    needs this rank's own forward first: every rank hung (P=8, M=4 in docs/benchmarks.md)."""
    flags = small_flags(
        corpus, "paci", 5, microbatches=2, steps=3, model="tiny-deep", dist_timeout=30
    )
    dist_dir = launch(flags, tmp_path / "dist")
    emu_dir = emulate(flags, tmp_path / "emu")
    assert numbers(read_metrics(dist_dir)) == numbers(read_metrics(emu_dir))


@pytest.mark.parametrize(
    ("schedule", "strict"), [("zbv", "true"), ("zbv", "false"), ("dualpipev", "true")]
)
def test_dist_runs_a_v_two_stages_per_rank_as_the_emulator_does(corpus, tmp_path, schedule, strict):
    """zbv (and dualpipev, the other V) on 2 ranks (4 stages in a V: rank 0 holds the first
    and the last stage, so it writes the metrics) at M = 2P, under NCCL's rules and under
    gloo's eager posting: each rank posts its receives in the sender's order, validation crosses
    the V, each rank writes its 2 checkpoint parts, and the metrics (val_loss included), all 4
    parts and the closing text sample (drawn on rank 0, which holds the last stage, and sent to
    rank 1) are bitwise the emulator's."""
    flags = small_flags(
        corpus,
        schedule,
        2,
        microbatches=4,
        steps=4,
        eval_every=2,
        dist_timeout=30,
        sample_tokens=12,
    )
    emu = emulate(flags, tmp_path / "emulated")
    run = launch([*flags, "--strict-p2p", strict], tmp_path / "dist")
    dist_records, emu_records = read_metrics(run), read_metrics(emu)
    assert [r["step"] for r in dist_records] == [1, 2, 3, 4]
    assert numbers(dist_records) == numbers(emu_records)
    assert [len(r["grad_norm"]) for r in dist_records] == [4] * 4  # one norm per stage
    assert "val_loss" in dist_records[1] and "val_loss" in dist_records[3]
    for stage, (d, e) in enumerate(zip(load_parts(run, 4), load_parts(emu, 4), strict=True)):
        assert d["stage"] == stage
        assert_same_state(d, e, f"stage{stage}")
    assert (run / "sample.txt").read_text() == (emu / "sample.txt").read_text()


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "stages"), [("1f1b", 2), ("paci", 3), ("pipedream", 4)])
def test_dist_under_nccl_rules_matches_the_emulator_bitwise(dist_run, emulated, schedule, stages):
    """--strict-p2p: one stream per rank, a batch starts when the previous one completed, tags
    ignored (NCCL's rules, enforced on gloo). An order NCCL deadlocks on would hang here and
    fail by the timeout; the numbers must still be the emulator's, drain points (validation,
    checkpoints) included. Every schedule at P = 2, 3 and 4 runs under these rules in
    tests/test_api_dist.py, through the same runner, one launch per P."""
    assert_equivalent(dist_run(schedule, stages, strict=True), emulated(schedule, stages), stages)


def test_dist_trains_a_tied_hugging_face_llama_as_the_emulator_does(corpus, tmp_path):
    """``--model hf:CONFIG --runtime dist``: a SmolLM2-style Llama whose input and output
    embeddings are tied, over 3 ranks (the pair swaps gradients, the middle rank gets their
    square), under --strict-p2p with global clipping: the emulator's numbers, validation and
    checkpoints included, the tied copies bitwise equal, and the same closing text sample,
    drawn through the three ranks' stages."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )
    config.save_pretrained(tmp_path / "model")
    model = f"hf:{tmp_path / 'model' / 'config.json'}"
    flags = small_flags(
        corpus, "1f1b", 3, microbatches=3, dist_timeout=30, model=model, sample_tokens=12
    )
    dist_dir = launch([*flags, "--strict-p2p", "true"], tmp_path / "dist")
    emu_dir = emulate(flags, tmp_path / "emulated")
    assert_equivalent(dist_dir, emu_dir, stages=3)
    assert (dist_dir / "sample.txt").read_text() == (emu_dir / "sample.txt").read_text()
    assert all("val_loss" in r for r in read_metrics(dist_dir) if r["step"] % 3 == 0)
    first, last = (part["module"] for part in load_parts(dist_dir, 3)[::2])
    assert torch.equal(first["model.embed_tokens.weight"], last["lm_head.weight"])


@pytest.mark.slow
def test_dist_paci_with_activation_checkpointing_resumes_as_the_emulator_trains(corpus, tmp_path):
    """``--schedule paci --activation-checkpointing full`` (no --paci-recompute) over 3 ranks,
    stopped at the checkpoint of step 3 and resumed: the emulator's uninterrupted run with
    checkpointing bit for bit (metrics and every part), whose numbers are those without
    checkpointing. Stage 0 holds micro-batches of two batches, so steps land between forwards
    and their backwards (the rebuilds read the stash)."""
    flags = small_flags(corpus, "paci", 3, checkpoint_every=3, dist_timeout=30)
    checkpointed = [*flags, "--activation-checkpointing", "full"]
    out = launch([*checkpointed, "--stop-at", "3"], tmp_path / "dist")
    resumed = run_train(
        "--resume", str(out), "--runtime", "dist", "--threads", "1", "--no-progress"
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["peak_inflight"][0] > MICROBATCHES
    assert_equivalent(out, emulate(checkpointed, tmp_path / "emulated"), stages=3)
    assert numbers(read_metrics(out)) == numbers(read_metrics(emulate(flags, tmp_path / "plain")))


# ----- 2. the run directory of a dist run --------------------------------------------------------
def x_events(trace: dict, pid: int) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == pid]


def test_dist_run_directory_holds_a_measured_timeline(dist_run):
    run, stages = dist_run("1f1b", 2), 2
    trace = json.loads((run / "trace.json").read_text())
    names = {
        e["pid"]: e["args"]["name"]
        for e in trace["traceEvents"]
        if e["ph"] == "M" and e["name"] == "process_name"
    }
    assert names == {0: "compute", 1: "communication"}
    compute = x_events(trace, 0)
    assert {e["tid"] for e in compute} == set(range(stages))
    for tid in range(stages):
        lane = sorted((e for e in compute if e["tid"] == tid), key=lambda e: e["ts"])
        assert Counter(e["cat"] for e in lane) == {
            "F": STEPS * MICROBATCHES,
            "B": STEPS * MICROBATCHES,
            "STEP": STEPS,
        }
        assert all(e["args"]["stage"] == tid and e["dur"] >= 0 for e in lane)
        for a, b in itertools.pairwise(lane):  # one process computes one action at a time
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3, (a["name"], b["name"])
    comm = x_events(trace, 1)
    assert {e["tid"] for e in comm} == set(range(stages))
    for tid in range(stages):  # 1f1b clips globally: every stage all-reduces once per step
        assert Counter(e["cat"] for e in comm if e["tid"] == tid)["ALLREDUCE"] >= STEPS

    summary = json.loads((run / "summary.json").read_text())
    assert summary["runtime"] == "dist" and summary["backend"] == "gloo"
    util = summary["utilization"]
    assert len(util) == stages and all(0 < u <= 1 for u in util)
    # utilization recomputed from the trace: busy time per stage over the whole span
    t0 = min(e["ts"] for e in compute)
    t1 = max(e["ts"] + e["dur"] for e in compute)
    busy = [sum(e["dur"] for e in compute if e["tid"] == tid) for tid in range(stages)]
    assert util == pytest.approx([b / (t1 - t0) for b in busy], rel=1e-6)
    assert summary["bubble_share"] == pytest.approx(1 - sum(util) / stages)
    steady = summary["steady_utilization"]
    assert len(steady) == stages and all(0 < u <= 1 for u in steady)
    assert summary["tokens_per_s"] > 0

    drain_points = json.loads((run / "config.json").read_text())["resolved"]["drain_points"]
    assert drain_points == [3, 6]
    for record in read_metrics(run):
        drained = record["step"] in drain_points
        assert ("val_loss" in record) == drained
        assert ("utilization" in record) == drained == ("bubble_share" in record)
        if drained:
            assert len(record["utilization"]) == stages
            assert all(0 < u <= 1 for u in record["utilization"])
            assert 0 <= record["bubble_share"] < 1
    png = (run / "timeline.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000
    assert json.loads((run / "ledger.json").read_text())["summary"]


def test_dist_trace_shows_only_communication_that_happens(dist_run):
    run, stages = dist_run("paci", 2), 2
    comm = x_events(json.loads((run / "trace.json").read_text()), 1)
    # paci clips per stage (no all-reduce); stage 0 only sends activations and receives
    # gradients, the last stage the reverse
    allowed = {0: {"SEND_F", "RECV_B"}, stages - 1: {"RECV_F", "SEND_B"}}
    for tid, kinds in allowed.items():
        assert {e["cat"] for e in comm if e["tid"] == tid} <= kinds
