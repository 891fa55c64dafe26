"""``nobubble train --runtime dist --data-parallel D`` as users run it, in real processes.

One run of P=2 stages × D=2 replicas (under NCCL's stream rules, ``--strict-p2p``) is the
reference of this module: the emulator with micro-batches twice as large trains the same model
(the replicas' average adds the same gradients in another order, see test_data_parallel.py:
losses within 1e-6 relative; gradient norms and checkpoint contents within 1e-5, because over
the run AdamW turns last-bit differences of near-zero gradient entries, such as the embedding
rows of rare tokens, into lr-sized steps of either sign), the same flags through two torchrun
"nodes" give its numbers bit for bit, and a run whose dp-1 rank is killed mid-run resumes onto
them bit for bit. Its checkpoint resumes at another D with the same global batch, and bad inputs
are refused before any write.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from _dist_helpers import (
    assert_same_state,
    clean_env,
    free_port,
    kill_all,
    load_parts,
    numbers,
    processes_of,
    run_train,
    small_flags,
)
from nobubble.app.train.metrics import read_metrics
from nobubble.cli import main
from test_dist_faults import assert_stopped, hit_rank_after_first_checkpoint

STAGES, REPLICAS, STEPS, EVERY = 2, 2, 10, 5
DIST_TIMEOUT = 20.0
RTOL = 1e-6  # losses
RTOL_STATE = 1e-5  # gradient norms, weights and optimizer state (module docstring)
# AdamW's second moment averages squared gradients, so its relative error is twice theirs (on
# 2026-12-03's AVX2-only machine it read 1.3e-5 for 1e-5; earlier machines held 1e-5)
SQUARED_STATE = ("exp_avg_sq",)


def dp_flags(corpus: Path, micro_batch_size: int = 2, data_parallel: int = REPLICAS) -> list[str]:
    return [
        *small_flags(
            corpus,
            "paci",
            STAGES,
            micro_batch_size=micro_batch_size,
            steps=STEPS,
            eval_every=EVERY,
            checkpoint_every=EVERY,
            dist_timeout=DIST_TIMEOUT,
        ),
        "--data-parallel",
        str(data_parallel),
    ]


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> Path:
    """The single-node run: the launcher starts P·D = 4 processes."""
    out = tmp_path_factory.mktemp("dp") / "run"
    done = run_train(
        *dp_flags(corpus), "--runtime", "dist", "--strict-p2p", "true", "--out", str(out)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def emulated(corpus, tmp_path_factory) -> Path:
    """One replica in one process, micro-batches of D·b sequences."""
    out = tmp_path_factory.mktemp("emulated") / "run"
    flags = dp_flags(corpus, micro_batch_size=2 * REPLICAS, data_parallel=1)
    assert main(["train", *flags, "--runtime", "emulate", "--out", str(out)]) == 0
    return out


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def assert_close(a, b, where: str, rtol: float = RTOL_STATE) -> None:
    """Records or checkpoint parts: numbers within ``rtol`` relative (tensors in norm); the
    losses of records within RTOL."""
    if isinstance(a, torch.Tensor):
        if a.is_floating_point():
            assert relative_error(a, b) <= rtol, (where, relative_error(a, b))
        else:
            assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), (where, sorted(set(a) ^ set(b)))
        for key in a:
            if key not in ("peak_saved", "peak_activation_bytes"):  # per replica: half the rows
                tight = key in ("loss", "val_loss")
                tol = RTOL if tight else 2 * rtol if key in SQUARED_STATE else rtol
                assert_close(a[key], b[key], f"{where}.{key}", tol)
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_close(x, y, f"{where}[{i}]", rtol)
    elif isinstance(a, float):
        assert abs(a - b) <= rtol * abs(b), (where, a, b)
    else:
        assert a == b, (where, a, b)


def test_two_replicas_train_as_the_emulator_with_twice_the_micro_batch(reference, emulated):
    ours, theirs = numbers(read_metrics(reference)), numbers(read_metrics(emulated))
    assert [r["step"] for r in ours] == list(range(1, STEPS + 1))
    assert_close(ours, theirs, "metrics")  # loss (the replicas' mean), grad norms, val loss, lr
    for stage in range(STAGES):  # one part per stage, written by dp rank 0
        assert_close(load_parts(reference, STAGES)[stage], load_parts(emulated, STAGES)[stage], "")
    assert sorted(p.name for p in (reference / "checkpoint").iterdir()) == [
        "manifest.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "stage0.json",
        "stage0.pt",
        "stage1.json",
        "stage1.pt",
    ]
    summary = json.loads((reference / "summary.json").read_text())
    assert summary["data_parallel"] == REPLICAS and summary["allreduce_s"] > 0
    assert 0 <= summary["allreduce_overlap"] <= 1
    config = json.loads((reference / "config.json").read_text())
    assert config["resolved"]["world_size"] == STAGES * REPLICAS


def test_a_checkpoint_resumes_at_another_d_with_the_same_global_batch(
    reference, emulated, corpus, tmp_path
):
    """The checkpoint of step 5 (D=2, b=2) resumed by one replica with b=4: the emulator's
    numbers, within the tolerance of the average's order."""
    cut = STEPS - EVERY
    first = tmp_path / "first"  # the checkpoint of step 15, from a run stopped there
    flags = dp_flags(corpus)
    done = run_train(*flags, "--runtime", "dist", "--stop-at", str(cut), "--out", str(first))
    assert done.returncode == 0, done.stderr[-3000:]
    resume = ["--resume", str(first), "--data-parallel", "1", "--micro-batch-size", "4"]
    assert main(["train", *resume, "--runtime", "emulate", "--no-progress"]) == 0
    records = numbers(read_metrics(first))
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert_close(records, numbers(read_metrics(emulated)), "metrics")
    for stage in range(STAGES):
        assert_close(load_parts(first, STAGES)[stage], load_parts(emulated, STAGES)[stage], "")


def test_sharded_replicas_train_as_the_emulator_and_resume_from_their_gathered_checkpoint(
    emulated, corpus, tmp_path
):
    """--shard fsdp: each stage's parameters, gradients and AdamW state sharded over its two
    replicas (FSDP2). Stopped at step 5 and resumed (each replica cutting its shards from the
    checkpoint gathered per stage), the run gives the emulator's numbers with micro-batches
    twice as large, within the replicated runs' tolerances; its checkpoint has the replicated
    format, and the sample is drawn through the sharded stages (Pipeline.generate)."""
    out = tmp_path / "sharded"
    flags = [*dp_flags(corpus), "--shard", "fsdp", "--runtime", "dist", "--strict-p2p", "true"]
    first = run_train(*flags, "--sample-tokens", "8", "--stop-at", str(EVERY), "--out", str(out))
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_train("--resume", str(out), "--runtime", "dist", "--no-progress")
    assert second.returncode == 0, second.stderr[-3000:]
    records = numbers(read_metrics(out))
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert_close(records, numbers(read_metrics(emulated)), "metrics")
    for stage in range(STAGES):
        assert_close(load_parts(out, STAGES)[stage], load_parts(emulated, STAGES)[stage], "")
    assert (out / "sample.txt").read_text().strip()
    config = json.loads((out / "config.json").read_text())
    assert config["config"]["shard"] == "fsdp"


# ----- bad inputs: refused before any process starts or any file is written ---------------------
def listing(folder: Path) -> list[tuple[str, int]]:
    return sorted((str(p), p.stat().st_mtime_ns) for p in folder.rglob("*"))


def test_a_resume_whose_global_batch_differs_is_refused_and_writes_nothing(reference, capsys):
    before = listing(reference)
    code = main(["train", "--resume", str(reference), "--data-parallel", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert code != 0
    assert "global micro-batches of 4 sequences" in err, err
    assert "use --micro-batch-size 4 at --data-parallel 1" in err, err
    assert listing(reference) == before


def test_data_parallel_below_one_and_with_the_emulator_are_refused(corpus, tmp_path, capsys):
    out = tmp_path / "never"
    for flags, message in (
        # the API's refusals, one text each (nobubble.api.config.RuntimeSpec)
        (["--data-parallel", "0", "--runtime", "dist"], "data_parallel=0 is not allowed"),
        (["--data-parallel", "2", "--runtime", "emulate"], "data_parallel=2 needs runtime='dist'"),
    ):
        code = main(["train", *dp_flags(corpus)[:-2], *flags, "--out", str(out)])
        err = capsys.readouterr().err
        assert code != 0 and message in err, err
        assert not out.exists()


def test_a_world_that_is_not_p_times_d_is_refused(corpus, tmp_path):
    env = clean_env(
        RANK="0",
        WORLD_SIZE="3",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )
    out = tmp_path / "never"
    done = run_train(*dp_flags(corpus), "--runtime", "dist", "--out", str(out), env=env, timeout=60)
    assert done.returncode != 0
    assert "world size 3 does not match --stages 2 × --data-parallel 2 = 4" in done.stderr
    assert not out.exists()


# ----- two torchrun nodes, and a killed rank of a replica ----------------------------------------
def torchrun_node(node: int, port: int, flags: list[str], out: Path) -> subprocess.Popen[str]:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--node-rank",
        str(node),
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--monitor-interval",
        "0.2",
        "-m",
        "nobubble",
        "train",
        *flags,
        "--runtime",
        "dist",
        "--out",
        str(out),
    ]
    return subprocess.Popen(
        command, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.mark.slow
def test_two_torchrun_nodes_give_the_single_node_numbers(reference, corpus, tmp_path):
    out, port = tmp_path / "run", free_port()
    nodes = [torchrun_node(n, port, dp_flags(corpus), out) for n in (0, 1)]
    try:
        printed, errors = zip(*(node.communicate(timeout=240) for node in nodes), strict=True)
    finally:
        kill_all([n.pid for n in nodes if n.poll() is None])
    assert all(n.returncode == 0 for n in nodes), "\n".join(e[-2000:] for e in errors)
    # the last rank (rank 1, on node 0) prints the summary before its process leaves without
    # interpreter finalization (rank_env.leave_process): flushed, not lost
    assert f"run directory: {out}" in printed[0] and "last_loss" in printed[0], printed
    assert numbers(read_metrics(out)) == numbers(read_metrics(reference))  # bit for bit
    for ours, theirs in zip(load_parts(out, STAGES), load_parts(reference, STAGES), strict=True):
        assert_same_state(ours, theirs)


@pytest.mark.slow
def test_a_killed_rank_of_a_replica_stops_every_rank_and_resume_reproduces_the_run(
    reference, corpus, tmp_path
):
    out, victim = tmp_path / "run", STAGES * REPLICAS - 1  # rank 3: dp 1, pp 1
    started = time.monotonic()
    code, seconds, stderr = hit_rank_after_first_checkpoint(
        dp_flags(corpus), out, rank=victim, sig=signal.SIGKILL, bound=DIST_TIMEOUT
    )
    print(f"\nlauncher exited {seconds:.2f} s after rank {victim} (dp 1, pp 1) was killed")
    assert_stopped(out, code, stderr)
    assert seconds < DIST_TIMEOUT + 10
    assert f"rank {victim} was killed by signal 9" in stderr.strip().splitlines()[-1], stderr
    # its peers name themselves and the rank they waited for by (dp, pp) coordinates
    assert "(dp 1, pp 1: stage 1)" in stderr, stderr[-3000:]
    cut = json.loads((out / "checkpoint" / "manifest.json").read_text())["step"]
    assert EVERY <= cut < STEPS
    resumed = run_train("--runtime", "dist", "--resume", str(out), "--no-progress")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    print(f"resumed from step {cut}; {time.monotonic() - started:.1f} s in all")
    assert numbers(read_metrics(out)) == numbers(read_metrics(reference))
    for ours, theirs in zip(load_parts(out, STAGES), load_parts(reference, STAGES), strict=True):
        assert_same_state(ours, theirs)
    assert processes_of(str(out)) == []


@pytest.mark.slow
def test_a_hung_rank_of_a_replica_is_found_by_the_timeout_and_every_rank_stops(corpus, tmp_path):
    """A stopped (SIGSTOP) rank closes no connection: its pp neighbour's receive and its dp
    peer's all-reduce find it by --dist-timeout, and the launcher stops the rest."""
    timeout, out, victim = 4.0, tmp_path / "run", 2  # rank 2: dp 1, pp 0
    flags = [*dp_flags(corpus), "--dist-timeout", str(timeout)]
    code, seconds, stderr = hit_rank_after_first_checkpoint(
        flags, out, rank=victim, sig=signal.SIGSTOP, bound=3 * timeout
    )
    print(f"\nlauncher exited {seconds:.2f} s after rank {victim} (dp 1, pp 0) hung")
    print("\n".join(line for line in stderr.splitlines() if "nobubble" in line))
    assert_stopped(out, code, stderr)
    # a peer names it by its coordinates: as the rank it waited for, its dp all-reduce peer or
    # one of a meeting's ranks (it prints nothing itself: it is stopped)
    named = [line.split(" failed ", 1)[-1] for line in stderr.splitlines() if " failed " in line]
    assert any("2 (dp 1, pp 0: stage 0)" in why for why in named), stderr[-3000:]
    assert timeout <= seconds < 2 * timeout + 5 + 10


def test_a_failure_at_a_meeting_names_every_rank_it_waited_for_by_its_coordinates(
    monkeypatch, capsys
):
    """A collective (the checkpoint's barrier, the metrics' gather) does not say which member
    is missing, so the line lists them all, each as ``rank (dp, pp: stages)``: a peer killed
    while the others meet is named as one killed between two transfers is."""
    from types import SimpleNamespace

    from nobubble.app.ranks import runtime
    from nobubble.app.train.config import TrainConfig

    def leave(code: int) -> None:
        raise SystemExit(code)

    monkeypatch.setattr(runtime.os, "_exit", leave)
    cfg = TrainConfig.of(num_ranks=STAGES, data_parallel=REPLICAS, runtime="dist")
    run = SimpleNamespace(meeting=("writing the checkpoint of step 5", [0, 2, 3]), run_dir=None)
    with pytest.raises(SystemExit):
        runtime._fail(SimpleNamespace(rank=1), cfg, run, RuntimeError("Connection closed by peer"))
    assert (
        "nobubble: rank 1 (dp 0, pp 1: stage 1) failed while writing the checkpoint of step 5, "
        "waiting for ranks 0 (dp 0, pp 0: stage 0), 2 (dp 1, pp 0: stage 0), "
        "3 (dp 1, pp 1: stage 1): RuntimeError: Connection closed by peer; "
    ) in capsys.readouterr().err


def test_a_send_refused_by_a_dead_peer_names_that_peer_by_its_coordinates(monkeypatch, capsys):
    """gloo refuses to post a send to a peer whose connection closed (a killed rank): the
    transport keeps the batch's ranks and the failure line names them, as a receive names the
    rank it waited for."""
    from types import SimpleNamespace

    from nobubble.app.ranks import runtime
    from nobubble.app.train.config import TrainConfig
    from nobubble.core.ir import Action, F
    from nobubble.runtime.distributed import transport
    from nobubble.runtime.distributed.runner import RankRunner

    def refuse(ops: list) -> None:
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(transport.dist, "batch_isend_irecv", refuse)
    stub = SimpleNamespace(on_cuda=False, peer_of_last_wait=None)
    with pytest.raises(RuntimeError, match="Connection closed"):
        transport.DistTransport._launch(stub, [SimpleNamespace(peer=3)])  # type: ignore[arg-type]
    assert stub.peers_of_failed_post == [3]

    def leave(code: int) -> None:
        raise SystemExit(code)

    monkeypatch.setattr(runtime.os, "_exit", leave)
    cfg = TrainConfig.of(num_ranks=STAGES, data_parallel=REPLICAS, runtime="dist")
    # where the rank's runner stands, read from its transport as RankRunner.where reads it
    runner = SimpleNamespace(transport=stub, pointer=[26], rank=0, current=Action(0, F, 11))
    run = SimpleNamespace(
        meeting=None,
        run_dir=None,
        pipe=object(),
        where=lambda: RankRunner.where(runner),  # type: ignore[arg-type]
        dp=1,
        pp=0,
    )
    with pytest.raises(SystemExit):
        runtime._fail(SimpleNamespace(rank=2), cfg, run, RuntimeError("Connection closed by peer"))
    assert (
        "nobubble: rank 2 (dp 1, pp 0: stage 0) failed at position 26 (0F11), posting its "
        "transfers with rank 3 (dp 1, pp 1: stage 1): RuntimeError: Connection closed by peer"
    ) in capsys.readouterr().err
