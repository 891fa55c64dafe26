"""What a rank knows of its world before its run: its place (``RankEnv``, from the launcher's
environment), the check that every rank was started with the same configuration, and how a
rank's process ends once its run is done (``leave_process``)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any, NoReturn

import torch.distributed as dist

from nobubble.app.train.config import TrainConfig


@dataclass(frozen=True)
class RankEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @staticmethod
    def from_environ() -> RankEnv:
        try:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        except (KeyError, ValueError):
            raise ValueError(
                "--runtime dist inside a launcher needs RANK and WORLD_SIZE in the "
                "environment (torchrun sets them)"
            ) from None
        local = int(os.environ.get("LOCAL_RANK", rank))
        return RankEnv(rank, world, local, int(os.environ.get("LOCAL_WORLD_SIZE", world)))


def _config_hash(cfg: TrainConfig) -> str:
    return hashlib.sha256(json.dumps(cfg.fingerprint(), sort_keys=True).encode()).hexdigest()


def check_same_config(cfg: TrainConfig, world_size: int, group: dist.ProcessGroup | None) -> None:
    """Every rank must run the same numbers: compare hashes, then name what differs."""
    hashes: list[Any] = [None] * world_size
    dist.all_gather_object(hashes, _config_hash(cfg), group=group)
    differ = [r for r, h in enumerate(hashes) if h != hashes[0]]
    if not differ:
        return
    reference: list[Any] = [cfg.fingerprint()]
    dist.broadcast_object_list(reference, src=0, group=group)
    here = cfg.fingerprint()
    keys = sorted(k for k, v in here.items() if reference[0].get(k) != v)
    mine = ", ".join(f"{k}={here[k]!r} (rank 0: {reference[0].get(k)!r})" for k in keys)
    raise ValueError(
        f"ranks {differ} run a different configuration than rank 0 (config hash "
        f"mismatch{'; here ' + mine if mine else ''}): start every rank with the "
        "same flags"
    )


def leave_process(status: int = 0) -> NoReturn:
    """End a rank's process after its run, without interpreter finalization.

    The run's process groups are destroyed and their reference cycles collected before this
    (``shutdown``), but a gloo thread that outlives them, or a C++ thread object destroyed at
    exit, can still abort a finishing process with SIGABRT ("terminate called without an active
    exception": docs/runtime.md). A rank has nothing left for finalization to do: its run
    directory or result file is written and closed. Flush what is buffered and leave."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a reader that left, a closed stream
            stream.flush()
    os._exit(status)


__all__ = [
    "RankEnv",
    "check_same_config",
    "leave_process",
]
