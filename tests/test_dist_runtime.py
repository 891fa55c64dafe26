"""The multi-process runtime as users run it: ``nobubble train --runtime dist`` in real processes.

The emulator is the reference: one process, same flags. A dist run must reproduce its numbers
bit for bit (same torch thread count), write a measured timeline, stop every rank within
``--dist-timeout`` when one dies, resume from the last checkpoint onto the uninterrupted run's
numbers, and refuse bad inputs in seconds with one clear line.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from _dist_helpers import (
    MEASURED,
    assert_same_state,
    clean_env,
    free_port,
    hand_started_rank,
    kill_all,
    launched_rank,
    load_parts,
    numbers,
    processes_of,
    run_train,
    small_flags,
    train_command,
)
from nobubble.app.train.metrics import read_metrics
from nobubble.cli import main
from nobubble.data import fetch_shakespeare

STEPS, MICROBATCHES = 6, 2  # the defaults of small_flags
DIST_TIMEOUT = 20.0
LONG_STEPS = 100


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A 200 kB slice of the default corpus (real text; BPE trains on it in well under 1 s)."""
    path = tmp_path_factory.mktemp("corpus") / "plays.txt"
    path.write_text(fetch_shakespeare().read_text()[:200_000])
    return path


def emulate(flags: list[str], out: Path) -> Path:
    """The reference: the same flags in the single-process emulator."""
    assert main(["train", *flags, "--runtime", "emulate", "--out", str(out)]) == 0
    return out


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


@pytest.mark.parametrize("strict", ["true", "false"])
def test_dist_runs_zbv_two_stages_per_rank_as_the_emulator_does(corpus, tmp_path, strict):
    """zbv on 2 ranks (4 stages in a V: rank 0 holds the first and the last stage, so it
    writes the metrics) at M = 2P, under NCCL's rules and under gloo's eager posting: each rank
    posts its receives in the sender's order, validation crosses the V, each rank writes its 2
    checkpoint parts, and the metrics (val_loss included) and all 4 parts are bitwise the
    emulator's."""
    flags = small_flags(corpus, "zbv", 2, microbatches=4, steps=4, eval_every=2, dist_timeout=30)
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
    checkpoints included, and the tied copies bitwise equal."""
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
    flags = small_flags(corpus, "1f1b", 3, microbatches=3, dist_timeout=30, model=model)
    dist_dir = launch([*flags, "--strict-p2p", "true"], tmp_path / "dist")
    emu_dir = emulate(flags, tmp_path / "emulated")
    assert_equivalent(dist_dir, emu_dir, stages=3)
    assert all("val_loss" in r for r in read_metrics(dist_dir) if r["step"] % 3 == 0)
    first, last = (part["module"] for part in load_parts(dist_dir, 3)[::2])
    assert torch.equal(first["model.embed_tokens.weight"], last["lm_head.weight"])


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


# ----- 3. faults ----------------------------------------------------------------------------------
def long_run(corpus: Path, tmp_path: Path, dist_timeout: float) -> tuple[list[str], Path]:
    """A run long enough to be hit after its first checkpoint (step 5) and before its end."""
    flags = small_flags(
        corpus,
        "paci",
        2,
        steps=LONG_STEPS,
        eval_every=5,
        checkpoint_every=5,
        dist_timeout=dist_timeout,
    )
    return flags, tmp_path / "run"


def hit_rank_after_first_checkpoint(
    flags: list[str], out: Path, rank: int, sig: signal.Signals, bound: float
) -> tuple[int, float, str]:
    """Launch, send ``sig`` to rank ``rank`` once a complete checkpoint exists, and wait for the
    launcher; returns its exit status, the seconds it took after the signal, and its stderr."""
    log = (out.parent / "launcher.err").open("w+")
    launcher = subprocess.Popen(
        train_command(*flags, "--runtime", "dist", "--out", str(out)),
        env=clean_env(),
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    manifest = out / "checkpoint" / "manifest.json"
    victim, deadline = None, time.monotonic() + 120
    try:
        while launcher.poll() is None and time.monotonic() < deadline:
            victim = victim or launched_rank(str(out), rank)
            if victim is not None and manifest.exists():
                os.kill(victim, sig)
                break
            time.sleep(0.005)
        else:
            pytest.fail(f"no checkpoint with rank {rank} alive (launcher status {launcher.poll()})")
        hit = time.monotonic()
        code = launcher.wait(timeout=bound + 30)
        seconds = time.monotonic() - hit
    finally:
        if launcher.poll() is None:
            kill_all([launcher.pid, *processes_of(str(out))])
    log.seek(0)
    return code, seconds, log.read()


def assert_stopped(out: Path, code: int, stderr: str) -> None:
    assert code == 1, stderr[-3000:]
    assert processes_of(str(out)) == [], "a rank outlived its launcher"
    assert f"--resume {out}" in stderr
    assert not (out / "summary.json").exists(), "the run finished before the fault"


@pytest.mark.slow
def test_killed_rank_stops_the_run_and_resume_reproduces_it(corpus, tmp_path):
    flags, out = long_run(corpus, tmp_path, DIST_TIMEOUT)
    code, seconds, stderr = hit_rank_after_first_checkpoint(
        flags, out, rank=1, sig=signal.SIGKILL, bound=DIST_TIMEOUT
    )
    print(
        f"\nlauncher exited {seconds:.2f} s after rank 1 was killed (--dist-timeout "
        f"{DIST_TIMEOUT:g})"
    )
    assert_stopped(out, code, stderr)
    assert seconds < DIST_TIMEOUT + 10
    cut = json.loads((out / "checkpoint" / "manifest.json").read_text())["step"]
    assert 5 <= cut < LONG_STEPS and cut % 5 == 0

    resume = ["--resume", str(out), "--steps", str(LONG_STEPS), "--threads", "1"]
    resumed = run_train("--runtime", "dist", *resume, "--no-progress")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    print(f"resumed from the checkpoint of step {cut} in {resumed.seconds:.2f} s")
    reference = emulate(flags, tmp_path / "uninterrupted")
    records = read_metrics(out)
    assert [r["step"] for r in records] == list(range(1, LONG_STEPS + 1))
    assert numbers(records) == numbers(read_metrics(reference))
    for d, e in zip(load_parts(out, 2), load_parts(reference, 2), strict=True):
        assert_same_state(d, e)
    # last, so the resume is checked either way: the launcher must name the rank that died,
    # not a peer that failed because of it
    launcher_line = stderr.strip().splitlines()[-1]
    assert "rank 1 was killed by signal 9" in launcher_line, launcher_line


@pytest.mark.slow
def test_hung_rank_is_found_by_the_timeout_and_stopped(corpus, tmp_path):
    """A stopped (SIGSTOP) rank never closes its connections: only the timeout finds it."""
    timeout = 4.0
    flags, out = long_run(corpus, tmp_path, timeout)
    code, seconds, stderr = hit_rank_after_first_checkpoint(
        flags, out, rank=1, sig=signal.SIGSTOP, bound=3 * timeout
    )
    print(f"\nlauncher exited {seconds:.2f} s after rank 1 hung (--dist-timeout {timeout:g})")
    assert_stopped(out, code, stderr)
    assert "waiting for rank 1" in stderr, stderr[-3000:]
    assert "rank 0 exited with status 1" in stderr, stderr[-3000:]
    # the peer's receive times out (T), the launcher waits for the rest (T), then
    # terminates and, after a 5 s grace, kills them
    assert timeout <= seconds < 2 * timeout + 5 + 10


def test_ranks_with_different_configs_refuse_to_train(corpus, tmp_path):
    """No fault flag exists; two hand-started ranks disagreeing on --lr are the failing rank."""
    port, out = free_port(), tmp_path / "run"
    procs, logs = [], []
    start = time.monotonic()
    for rank, lr in ((0, "0.003"), (1, "0.001")):
        env = hand_started_rank(rank, 2, port)
        flags = small_flags(corpus, "paci", 2, lr=lr, dist_timeout=DIST_TIMEOUT)
        logs.append((tmp_path / f"rank{rank}.err").open("w+"))
        procs.append(
            subprocess.Popen(
                train_command(*flags, "--runtime", "dist", "--out", str(out)),
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=logs[-1],
            )
        )
    try:
        codes = [p.wait(timeout=DIST_TIMEOUT + 30) for p in procs]
        seconds = time.monotonic() - start
    finally:
        kill_all([p.pid for p in procs if p.poll() is None])
    print(f"\nboth ranks exited {seconds:.2f} s after start (config hash mismatch)")
    for rank, (code, log) in enumerate(zip(codes, logs, strict=True)):
        log.seek(0)
        stderr = log.read()
        assert code == 1, stderr[-3000:]
        assert f"rank {rank} (dp 0, pp {rank}: stage {rank}) failed during setup" in stderr
        assert "ranks [1] run a different configuration than rank 0" in stderr
        assert "config hash mismatch" in stderr
    assert seconds < DIST_TIMEOUT, "the mismatch must be found at once, not by a timeout"
    assert not (out / "metrics.jsonl").exists()


# ----- 4. bad inputs fail fast --------------------------------------------------------------------
@pytest.fixture
def busy_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


def test_world_size_that_differs_from_stages_is_refused(corpus, tmp_path):
    env = clean_env(
        RANK="0",
        WORLD_SIZE="3",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )
    done = run_train(
        *small_flags(corpus, "paci", 2),
        "--runtime",
        "dist",
        "--out",
        str(tmp_path / "never"),
        env=env,
        timeout=60,
    )
    assert_refused(done, "world size 3 does not match --stages 2", tmp_path / "never")


def test_master_port_in_use_is_refused(corpus, tmp_path, busy_port):
    done = run_train(
        *small_flags(corpus, "paci", 2),
        "--runtime",
        "dist",
        "--master-port",
        str(busy_port),
        "--out",
        str(tmp_path / "never"),
        timeout=60,
    )
    assert_refused(done, f"--master-port {busy_port} is in use", tmp_path / "never")


def test_more_stages_than_layers_is_refused(corpus, tmp_path):
    done = run_train(
        *small_flags(corpus, "paci", 9),
        "--runtime",
        "dist",
        "--out",
        str(tmp_path / "never"),
        timeout=60,
    )
    assert_refused(done, "--stages 9 is more than the 4 layers of model 'tiny'", tmp_path / "never")


def assert_refused(done, message: str, out: Path) -> None:
    print(f"\nrefused in {done.seconds:.2f} s: {message}")
    assert done.returncode == 2, done.stderr[-3000:]
    assert message in done.stderr
    assert "Traceback" not in done.stderr
    assert done.seconds < 30  # an interpreter start and an import of torch, nothing more
    assert not out.exists()


# ----- 5. teardown --------------------------------------------------------------------------------
RANK_SCRIPT = """
import gc, json, sys, weakref
from nobubble.app.train.config import TrainConfig
from nobubble.runtime.distributed import transport
from nobubble.app.ranks.runtime import run_rank

run_rank(TrainConfig(**json.loads(sys.argv[1])))
alive = [weakref.ref(o) for o in gc.get_objects() if isinstance(o, transport.DistTransport)]
print(json.dumps({"transports": sum(r() is not None for r in alive), "garbage": gc.collect()}))
"""


def test_a_finished_rank_leaves_no_communication_state_for_interpreter_exit(corpus, tmp_path):
    """The cause of the rare SIGABRT at exit (docs/runtime.md): the run's transport, work handles
    and process groups sat in reference cycles, freed by whichever cyclic collection came next,
    possibly during interpreter finalization. Now nothing is left once run_rank returns."""
    config = {
        "schedule": "1f1b",
        "stages": 2,
        "data": str(corpus),
        "vocab_size": 512,
        "seq_len": 32,
        "micro_batch_size": 4,
        "microbatches": 2,
        "steps": 2,
        "eval_every": 2,
        "eval_batches": 1,
        "sample_tokens": 0,
        "threads": 1,
        "runtime": "dist",
        "progress": False,
        "out": str(tmp_path / "run"),
    }
    port = free_port()
    procs = []
    for rank in range(2):
        env = hand_started_rank(rank, 2, port)
        command = [sys.executable, "-c", RANK_SCRIPT, json.dumps(config)]
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True))
    try:
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        kill_all([p.pid for p in procs if p.poll() is None])
    for rank, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"rank {rank} exited with {proc.returncode}"
        left = json.loads(out.strip().splitlines()[-1])
        assert left == {"transports": 0, "garbage": 0}, f"rank {rank}: {left}"
