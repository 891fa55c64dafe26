"""``nobubble train --runtime dist --stages P [--data-parallel D]`` on one machine: start P·D
processes, watch them.

The launcher fills the data cache once, picks (or checks) the rendezvous port, starts one
``python -m nobubble train`` process per stage and replica with torchrun's environment
variables (global rank dp·P + pp), and
watches them: when one exits with an error, the others get a few seconds to notice and are then
stopped (terminate, then kill), and the exit status is non-zero. A rank that hangs instead of
dying is caught by its peers after ``--dist-timeout`` seconds (the process group's timeout), so
every process is gone within ``--dist-timeout`` + 6 seconds. Multi-node runs use torchrun
itself (see docs/runtime.md).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from nobubble.app.train.checkpoint import (
    check_resumable,
    check_stream,
    check_work_left,
    read_manifest,
)
from nobubble.app.train.config import TrainConfig
from nobubble.app.train.trainer import RunResult, resolve_run_dir
from nobubble.core.errors import NobubbleError

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def check_port(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            raise ValueError(
                f"--master-port {port} is in use: pick another port, or 0 to let "
                "nobubble choose a free one"
            ) from None


def _stop(procs: list[subprocess.Popen[bytes]], grace: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            p.send_signal(signal.SIGCONT)  # a stopped (SIGSTOP) process must run to terminate
    deadline = time.monotonic() + grace
    for p in procs:
        while p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if p.poll() is None:
            p.kill()
            p.wait()


def rank_env(rank: int, world_size: int, port: int, **extra: str) -> dict[str, str]:
    """The environment of local rank ``rank``, as torchrun would set it, plus ``extra``."""
    return dict(
        os.environ,
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TOKENIZERS_PARALLELISM="false",
        **extra,
    )


def launch(cfg: TrainConfig, argv: list[str]) -> RunResult:
    """Run ``cfg`` on P × D local processes (``num_ranks`` × ``data_parallel``); ``argv`` are
    the user's train flags."""
    from nobubble.app.ranks.runtime import resolve_device
    from nobubble.app.train.assemble import load_data

    world = cfg.num_ranks * cfg.runtime.data_parallel
    resolve_device(cfg, 0, world)  # a missing GPU is refused here, before any process starts
    if cfg.launch.resume:  # so are a finished run and a checkpoint of another run (or global batch)
        manifest = read_manifest(Path(cfg.launch.resume))
        check_resumable(manifest, cfg, Path(cfg.launch.resume))
        check_work_left(manifest["step"], cfg.run.stop_at or cfg.run.steps, Path(cfg.launch.resume))
    port = cfg.launch.master_port or free_port()
    if cfg.launch.master_port:
        check_port(port)
    run_dir = resolve_run_dir(cfg)
    data = load_data(cfg)  # fill the cache once, before the ranks race for it
    if cfg.launch.resume:
        resumed = Path(cfg.launch.resume)
        check_stream(read_manifest(resumed), data.stream_id, resumed)
    args = [*argv, "--out", str(run_dir)] if not cfg.launch.resume else list(argv)
    procs = []
    for rank in range(world):
        env = rank_env(rank, world, port, NOBUBBLE_LAUNCHED="1")
        command = [sys.executable, "-m", "nobubble", "train", *args, "--runtime", "dist"]
        if rank != cfg.num_ranks - 1:  # the writer (the last stage of replica 0) shows progress
            command.append("--no-progress")
        procs.append(subprocess.Popen(command, env=env))
    failed = _watch(procs)
    if failed:
        rank, code = failed[0]
        why = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        others = "".join(f", then rank {r} (status {c})" for r, c in failed[1:])
        raise NobubbleError(
            f"rank {rank} {why}{others}; the other ranks were stopped. See the "
            f"messages above; resume with: nobubble train --resume {run_dir}"
        )
    summary = json.loads((Path(run_dir) / "summary.json").read_text())
    return RunResult(Path(run_dir), [], summary)


GRACE_S = 5.0  # after a failure, the others get this long to exit on their own


def _watch(procs: list[subprocess.Popen[bytes]]) -> list[tuple[int, int]]:
    """Wait for all ranks. On the first failure give the others ``GRACE_S`` to notice (a dead
    peer closes its connections; a hung one is caught by the process group's timeout), then
    kill what is left. Returns the failed (rank, status) pairs, the first cause first: a rank
    killed by a signal, else the earliest to fail."""
    try:
        while True:
            codes = [p.poll() for p in procs]
            if any(c not in (None, 0) for c in codes):
                deadline = time.monotonic() + GRACE_S
                while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                    time.sleep(0.05)
                final = [p.poll() for p in procs]
                _stop(procs, grace=1.0)
                failed = [(r, int(c)) for r, c in enumerate(final) if c not in (None, 0)]
                # a rank killed by a signal is the cause; the others failed because of it
                failed.sort(key=lambda rc: (rc[1] >= 0, codes[rc[0]] is None, rc[0]))
                return failed
            if all(c == 0 for c in codes):
                return []
            time.sleep(0.05)
    except KeyboardInterrupt:
        _stop(procs, grace=GRACE_S)
        raise
