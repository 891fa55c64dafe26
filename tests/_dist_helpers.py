"""Helpers of the multi-process tests: start the CLI as real processes, find them, compare runs."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# Set by torchrun and by nobubble's launcher; a test process must not leak them into a launcher.
RANK_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "NOBUBBLE_LAUNCHED",
)
# Keys of a metrics record that are measured (wall clock), not computed: they differ run to run.
MEASURED = ("elapsed_s", "train_s", "utilization", "bubble_share")
# Entries of a checkpoint part that are measurements of the process, not training state.
PART_MEASUREMENTS = ("peak_saved", "peak_activation_bytes")


@dataclass
class Finished:
    returncode: int
    stdout: str
    stderr: str
    seconds: float


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}
    env["TOKENIZERS_PARALLELISM"] = "false"
    env.update(extra)
    return env


def hand_started_rank(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The environment of one rank started by hand, as torchrun would set it."""
    return clean_env(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def train_command(*flags: str) -> list[str]:
    return [sys.executable, "-m", "nobubble", "train", *flags]


def run_train(*flags: str, env: dict[str, str] | None = None, timeout: float = 180) -> Finished:
    """``nobubble train FLAGS`` as a child process; a hang fails the test instead of CI."""
    start = time.monotonic()
    done = subprocess.run(
        train_command(*flags),
        env=env or clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return Finished(done.returncode, done.stdout, done.stderr, time.monotonic() - start)


def small_flags(corpus: Path, schedule: str, stages: int, **overrides: Any) -> list[str]:
    """The flags of a small real run (as in test_train.py), one torch thread per process."""
    values: dict[str, Any] = dict(
        schedule=schedule,
        stages=stages,
        data=corpus,
        vocab_size=512,
        seq_len=32,
        micro_batch_size=4,
        microbatches=2,
        steps=6,
        eval_every=3,
        eval_batches=2,
        clip=1.0,
        sample_tokens=0,
        threads=1,  # numbers are bitwise reproducible only at equal thread counts
    )
    values.update(overrides)
    flags = ["--no-progress"]
    for key, value in values.items():
        flags += ["--" + key.replace("_", "-"), str(value)]
    return flags


def emulate(flags: list[str], out: Path) -> Path:
    """The reference of a dist run: the same flags in the single-process emulator."""
    from nobubble.cli import main

    assert main(["train", *flags, "--runtime", "emulate", "--out", str(out)]) == 0
    return out


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def numbers(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The computed part of each record (loss, lr, grad norms, val loss, ...)."""
    return [{k: v for k, v in r.items() if k not in MEASURED} for r in records]


def load_parts(run_dir: Path, stages: int) -> list[dict[str, Any]]:
    """Every stage's checkpoint part (weights from its safetensors shard, the rest from its
    .pt), checked against the manifest."""
    from nobubble.app.train.checkpoint import load_part, read_manifest

    manifest = read_manifest(run_dir)
    return [load_part(run_dir, manifest, s) for s in range(stages)]


def assert_same_state(a: Any, b: Any, where: str = "part") -> None:
    """Recursive equality; tensors must be equal bit for bit (same dtype, shape and values)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{where}: tensor vs {type(b).__name__}"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{list(a.shape)}"
        assert torch.equal(a, b), f"{where}: max difference {(a - b).abs().max().item()}"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys differ"
        for key in a:
            if key not in PART_MEASUREMENTS:
                assert_same_state(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_state(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


# ----- processes ----------------------------------------------------------------------------------
def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:  # the process left, or is not ours to read
        return b""


def _alive(pid: str) -> bool:
    stat = _read(f"/proc/{pid}/stat")
    # the state follows the parenthesized command name; a zombie (Z) has already exited
    return bool(stat) and stat.rpartition(b")")[2].split()[0] not in (b"Z", b"X")


def processes_of(marker: str) -> list[int]:
    """Live processes whose command line contains ``marker`` (e.g. a run directory)."""
    needle = marker.encode()
    mine = os.getpid()
    return [
        int(entry)
        for entry in os.listdir("/proc")
        if entry.isdigit()
        and int(entry) != mine
        and needle in _read(f"/proc/{entry}/cmdline")
        and _alive(entry)
    ]


def launched_rank(marker: str, rank: int) -> int | None:
    """The pid of rank ``rank`` started by nobubble's launcher for the run ``marker``."""
    for pid in processes_of(marker):
        environ = _read(f"/proc/{pid}/environ").split(b"\0")
        if f"RANK={rank}".encode() in environ and b"NOBUBBLE_LAUNCHED=1" in environ:
            return pid
    return None


def kill_all(pids: list[int]) -> None:
    """Clean-up after a failed test: the processes this test started, by id."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # it left on its own meanwhile
            os.kill(pid, signal.SIGKILL)
