"""The multi-process runtime when things go wrong: a killed or hung rank stops the run within
``--dist-timeout`` and the run resumes from its last checkpoint onto the uninterrupted run's
numbers; ranks with different configs, a wrong world size, a port in use or too many stages are
refused in seconds with one clear line; a finished rank leaves nothing for interpreter exit.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _dist_helpers import (
    assert_same_state,
    clean_env,
    emulate,
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

DIST_TIMEOUT = 20.0
# 25 steps after the first checkpoint (step 5): about a second of training on the 2-core
# machine, to land the signal in (test_dist_data_parallel.py leaves 5); the resume and the
# emulated reference train every step, so a longer run is only slower
LONG_STEPS = 30


# ----- 1. faults ----------------------------------------------------------------------------------
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


# ----- 2. bad inputs fail fast --------------------------------------------------------------------
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


# ----- 3. teardown --------------------------------------------------------------------------------
RANK_SCRIPT = """
import gc, json, sys, weakref
from nobubble.app.train.config import TrainConfig
from nobubble.runtime.distributed import transport
from nobubble.app.ranks.runtime import run_rank

run_rank(TrainConfig.of(**json.loads(sys.argv[1])))
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
