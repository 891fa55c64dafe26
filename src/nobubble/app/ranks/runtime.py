"""One rank of the multi-process runtime of ``nobubble train``, on the public API.

Each process builds the same plan (schedule, ledger, split) from the same config, and runs its
own stage through ``nobubble.Pipeline(runtime="dist")``: the interpreter the emulator uses, the
checked communication plan, fed batch by batch and drained at the evaluation points. Drain
points are where ranks meet: validation through the pipeline (``Pipeline.evaluate``), the
gathering of per-step figures and spans for the run directory (written by the last rank, which
holds the loss), and checkpoints (each rank writes its part; the manifest is written once all
exist).

With ``--data-parallel D`` the world is D replicas of the pipeline (global rank = dp·P + pp, the
layout of ``init_device_mesh((D, P), ("dp", "pp"))``): replica r reads the r-th slice of every
global micro-batch, the ranks of dp 0 write the checkpoint (one part per stage: the replicas
hold the same weights), and the writer, the last stage of replica 0, averages the replicas'
losses into the metrics.
"""

from __future__ import annotations

import logging
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nobubble.app.ranks.rank_env import RankEnv
from nobubble.app.ranks.rank_run import RankRun
from nobubble.app.train.checkpoint import (
    read_manifest,
)
from nobubble.app.train.config import TrainConfig
from nobubble.app.train.trainer import (
    RunResult,
)
from nobubble.core.ir import STEP
from nobubble.runtime.distributed.waits import shutdown

log = logging.getLogger(__name__)


def resolve_device(
    cfg: TrainConfig, local_rank: int, local_world_size: int
) -> tuple[torch.device, str]:
    """This rank's device and the process group's backend, or a ValueError naming the fix."""
    cuda = torch.cuda.is_available()
    kind = cfg.launch.device if cfg.launch.device != "auto" else ("cuda" if cuda else "cpu")
    if kind == "cuda" and not cuda:
        raise ValueError(
            f"--device cuda, but torch {torch.__version__} sees no GPU: install a "
            "CUDA build of torch on a machine with GPUs, or use --device cpu"
        )
    backend = (
        cfg.launch.backend
        if cfg.launch.backend != "auto"
        else ("nccl" if kind == "cuda" else "gloo")
    )
    if backend == "nccl" and kind != "cuda":
        raise ValueError(
            "--backend nccl moves GPU tensors only: use --device cuda, or --backend gloo on CPUs"
        )
    if kind == "cpu":
        return torch.device("cpu"), backend
    count = torch.cuda.device_count()
    if backend == "gloo":  # a debugging mode: ranks share the GPUs, tensors go through the host
        return torch.device("cuda", local_rank % count), backend
    if local_world_size > count:
        raise ValueError(
            f"{local_world_size} ranks on this machine need {local_world_size} "
            f"GPUs, but {count} are visible (NCCL refuses two ranks on one GPU): use --stages "
            f"{count} (or fewer), more machines, --device cpu, or --backend gloo to share the "
            "GPUs between ranks (to debug: every transfer goes through host memory)"
        )
    return torch.device("cuda", local_rank), backend


def run_rank(cfg: TrainConfig) -> RunResult | None:
    """Entry point of one process (torchrun or ``nobubble train --runtime dist``)."""
    env = RankEnv.from_environ()
    world = cfg.num_ranks * cfg.runtime.data_parallel
    if env.world_size != world:
        layout = f"--stages {cfg.num_ranks}"
        if cfg.runtime.data_parallel > 1:
            layout += f" × --data-parallel {cfg.runtime.data_parallel} = {world}"
        raise ValueError(
            f"world size {env.world_size} does not match {layout}: launch {world} processes "
            f"(torchrun --nproc-per-node {world}, or --nnodes N with {world} in all) or set "
            f"--stages and --data-parallel so that their product is {env.world_size}"
        )
    device, backend = resolve_device(cfg, env.local_rank, env.local_world_size)
    threads = cfg.launch.threads or max(1, (os.cpu_count() or 1) // env.local_world_size)
    torch.set_num_threads(threads)
    timeout = cfg.runtime.dist_timeout
    if device.type == "cuda":  # CUDA events, autocast and new tensors default to this GPU
        torch.cuda.set_device(device)
    if backend == "nccl":
        # our host-side waits give up after --dist-timeout and name the peer; NCCL's watchdog,
        # which aborts the process without saying why, must not fire first
        timeout += 60
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
    run: RankRun | None = None
    try:
        run = RankRun(cfg, env, device)
        result = run.run()
    except Exception as err:  # any failure: name the rank, the action, the resume point
        _fail(env, cfg, run, err)
    # The run sits in reference cycles (the interpreter's dispatch table holds its bound
    # methods): drop it, so that shutdown() frees its transport now, not at interpreter exit.
    _close(run)
    run = None
    shutdown()
    return result


def _close(run: RankRun | None) -> None:
    if run is not None and getattr(run, "pipe", None) is not None:
        run.pipe.close_transport()  # a strict stream's thread ends here, not at interpreter exit


def _coordinates(cfg: TrainConfig, rank: int, run: RankRun | None = None) -> str:
    """``3 (dp 1, pp 1: stage 1)``: a global rank, its place on the (dp, pp) mesh and the
    stages it runs (several in interleaved and V placements, once the plan is known)."""
    dp, pp = divmod(rank, cfg.num_ranks)
    plan = getattr(run, "plan", None)
    local = plan.placement.stages_of(pp) if plan is not None else (pp,)
    stages = f"stage {local[0]}" if len(local) == 1 else "stages " + ", ".join(map(str, local))
    return f"{rank} (dp {dp}, pp {pp}: {stages})"


def _position(run: RankRun | None) -> Any:
    """Where the rank's runner stands, once the pipeline is built (``RankPosition``)."""
    return run.where() if run is not None and getattr(run, "pipe", None) is not None else None


def _fail(env: RankEnv, cfg: TrainConfig, run: RankRun | None, err: Exception) -> None:
    where = "during setup"
    if run is not None and getattr(run, "meeting", None) is not None:
        assert run.meeting is not None
        what, ranks = run.meeting
        names = ", ".join(_coordinates(cfg, r, run) for r in ranks)
        where = f"while {what}, waiting for rank{'s' if len(ranks) > 1 else ''} {names}"
    elif run is not None and (at := _position(run)) is not None and at.current is not None:
        peer, posted = at.waiting_for, at.posting_to  # a stage of this replica; global ranks
        waiting = ""
        if peer is not None:
            waiting = f", waiting for rank {_coordinates(cfg, run.dp * cfg.num_ranks + peer, run)}"
        elif posted:
            names = ", ".join(_coordinates(cfg, r, run) for r in posted)
            waiting = f", posting its transfers with rank{'s' if len(posted) > 1 else ''} {names}"
        elif cfg.runtime.data_parallel > 1 and (
            at.current.kind == STEP or cfg.runtime.shard != "none"
        ):
            peers = [
                d * cfg.num_ranks + run.pp for d in range(cfg.runtime.data_parallel) if d != run.dp
            ]
            names = ", ".join(_coordinates(cfg, r, run) for r in peers)
            what = (
                "all-reduce" if cfg.runtime.shard == "none" else "collectives of the sharded stage"
            )
            waiting = f", in the dp {what} with rank{'s' if len(peers) > 1 else ''} {names}"
        where = f"at position {at.position} ({at.current}){waiting}"
    run_dir = run.run_dir if run is not None else (cfg.launch.resume or cfg.launch.out)
    try:
        step = read_manifest(Path(str(run_dir)))["step"] if run_dir else None
    except ValueError:
        step = None
    resume = (
        f"resume from the checkpoint of step {step}: nobubble train --resume {run_dir}"
        if step
        else "no checkpoint was written yet: start the run again"
    )
    log.debug("rank %d failed", env.rank, exc_info=err)  # the traceback, with -v
    print(
        f"nobubble: rank {_coordinates(cfg, env.rank, run)} failed {where}: "
        f"{type(err).__name__}: {err}; {resume}",
        file=sys.stderr,
        flush=True,
    )
    # Peers may be dead or blocked: no collective clean-up, leave now with a failure status.
    os._exit(1)


__all__ = [
    "resolve_device",
    "run_rank",
]
