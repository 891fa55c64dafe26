"""One rank of a ``torch.distributed.pipelining`` run on nobubble's model, data and optimizer.

The baselines of ``nobubble bench runtime``: the same ``TrainConfig`` gives the same model, the
same stage split (assemble's make_plan/make_stages), the same micro-batches (the M micro-batches
of batch j are concatenated, and the schedule's split along the batch dimension gives them back
exactly), the same optimizer, lr schedule and global clipping; only the pipeline engine is
torch's. Each torch schedule runs beside the nobubble schedule with its placement and split
(``TORCH_SCHEDULES``): ``ScheduleGPipe`` and ``Schedule1F1B`` one stage per rank;
``ScheduleInterleaved1F1B`` and ``ScheduleInterleavedZeroBubble`` v stages per rank in a loop
(rank r holds r, r+P, ...), cut as nobubble's ``interleaved-1f1b`` cuts, and ``ScheduleLoopedBFS``
as ``looped-bfs``; ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` two per rank in a V (rank r
holds r and 2P-1-r), cut as ``zbv`` and ``dualpipev`` (torch runs DualPipeV's overlapped pairs one
action after the other, as nobubble does). A rank's stages each get their
own ``PipelineStage`` and their own optimizer, as nobubble's workers do.

The last stage returns logits because torch's schedules apply the loss themselves (``loss_fn =
lm_loss``); torch averages the micro-batch gradients by dividing by M after the backwards
(``scale_grads=True``). Gradient clipping is global, as nobubble's for synchronous schedules:
every stage's squared norm, added in stage order in float64 (``sum_over_stages``).

Timing mirrors nobubble's runtime: one barrier before the first step, then each rank notes the
wall time after each of its optimizer steps; a step ends when its last rank is done; throughput
is tokens over the steady window (the first ``max(1, steps // 10)`` steps are warm-up).

Run ``python -m nobubble.app.ranks.torch_peer --schedule torch-1f1b --result FILE <train flags>``
under torchrun-style environment variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), one
process per rank; ``launch_peer`` starts them on one machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle
from torch.distributed.pipelining.stage import _PipelineStageBase

from nobubble.app.ranks.launch import _watch, free_port, rank_env
from nobubble.app.ranks.peer_stage import ActivationMeter, PeerStage, Span, TimedStage
from nobubble.app.ranks.rank_env import leave_process
from nobubble.app.train.assemble import load_data, make_model, make_plan
from nobubble.app.train.config import TrainConfig
from nobubble.core.errors import NobubbleError
from nobubble.core.host_memory import tune_host_allocator
from nobubble.core.ir import STEP, Action
from nobubble.core.placement import Placement
from nobubble.core.schedules import SCHEDULES
from nobubble.core.sim.metrics import measured_utilization
from nobubble.data import TokenData
from nobubble.optim import (
    build_optimizer,
    clip_coefficient,
    grad_sq_norm,
    lr_at,
    scale_grads_,
    sum_over_stages,
)
from nobubble.runtime.distributed.join import release_others
from nobubble.runtime.distributed.waits import shutdown

# torch schedule -> (its class, the nobubble schedule whose placement, split and checks it takes).
# The zero-bubble ones split each backward into input and weight gradients (torch's
# PipelineStage does that itself). ScheduleInterleavedZeroBubble with one stage per rank is
# zb-h1's order (torch-zb-h1); at v >= 2 it has no nobubble twin, so torch-interleaved-zb takes
# interleaved-1f1b's loop placement and split.
TORCH_SCHEDULES: dict[str, tuple[type[PipelineScheduleSingle | PipelineScheduleMulti], str]] = {
    "torch-gpipe": (ScheduleGPipe, "gpipe"),
    "torch-1f1b": (Schedule1F1B, "1f1b"),
    "torch-zb-h1": (ScheduleInterleavedZeroBubble, "zb-h1"),
    "torch-interleaved-1f1b": (ScheduleInterleaved1F1B, "interleaved-1f1b"),
    "torch-interleaved-zb": (ScheduleInterleavedZeroBubble, "interleaved-1f1b"),
    "torch-zbv": (ScheduleZBVZeroBubble, "zbv"),
    "torch-dualpipev": (ScheduleDualPipeV, "dualpipev"),
    "torch-looped-bfs": (ScheduleLoopedBFS, "looped-bfs"),
}


def peer_config(cfg: TrainConfig, schedule: str, virtual_stages: int | None = None) -> TrainConfig:
    """``cfg`` with the nobubble schedule whose placement and split ``schedule`` takes (sets
    global clipping and the stages per rank); its checks of (P, M, v) run here, named for the
    torch schedule, before any process starts. ``virtual_stages``: v of the loop placements
    (None: ``cfg``'s, else 2); ZBV always holds 2 stages per rank, the others 1."""
    if schedule not in TORCH_SCHEDULES:
        raise ValueError(
            f"--schedule {schedule!r} is not a torch.distributed.pipelining schedule; valid: "
            f"{', '.join(TORCH_SCHEDULES)}"
        )
    cls, name = TORCH_SCHEDULES[schedule]
    loop = SCHEDULES[name].placement == "loop"
    virtual = (virtual_stages or cfg.schedule.virtual_stages) if loop else None
    try:
        # runtime "emulate": torch's engine runs the peer, so nobubble's multi-process runtime
        # and what it cannot run yet (several stages per rank) do not apply
        return cfg.replace(schedule=name, virtual_stages=virtual, runtime="emulate")
    except ValueError as err:
        raise ValueError(
            f"{schedule} (torch's {cls.__name__}, placed and cut as nobubble's {name}): {err}"
        ) from None


def peer_placement(cfg: TrainConfig) -> Placement:
    """Which stages each rank holds: the placement of ``cfg.schedule.name``, as torch maps them
    (``generate_stage_to_rank_mapping``: "loop" for the interleaved classes, "v" for ZBV)."""
    info = SCHEDULES[cfg.schedule.name]
    return Placement(info.placement, cfg.num_ranks, cfg.model_stages // cfg.num_ranks)


def batch_of(data: TokenData, j: int, m: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch j as one tensor pair (M*B, T): micro-batches jM..jM+M-1, concatenated in order."""
    pairs = [data.train_microbatch(j * m + i, b) for i in range(m)]
    return torch.cat([x for x, _ in pairs]), torch.cat([y for _, y in pairs])  # (M*B, T) each


class PeerRun:
    """This rank's stages under a torch schedule; the process group must be initialized."""

    def __init__(self, cfg: TrainConfig, schedule: str, device: torch.device) -> None:
        self.cfg = peer_config(cfg, schedule)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if self.world != cfg.num_ranks:
            raise ValueError(
                f"world size {self.world} does not match --stages {cfg.num_ranks}: start "
                f"{cfg.num_ranks} processes or set --stages {self.world}"
            )
        self.device = device
        self.data = load_data(self.cfg)
        plan = make_plan(self.cfg, self.data.vocab_size)
        autocast = torch.bfloat16 if cfg.compute.dtype == "bf16" else None
        stages = make_model(plan).stages
        if any(getattr(stage, "tied_parameters", None) for stage in stages):
            raise ValueError(
                f"--model {cfg.model.model} ties its input and output embeddings across stages, "
                "and torch's schedules would update the two copies apart: add --untie-embeddings"
            )
        self.num_stages = len(stages)  # v·P
        self.mine = peer_placement(self.cfg).stages_of(self.rank)
        # moved first: the meter tells weights from activations by storage
        own = nn.ModuleList([stages[s].to(device) for s in self.mine])
        release_others([own, *(m for s, m in enumerate(stages) if s not in self.mine)], 0)
        self.meter = ActivationMeter(list(own.parameters()))
        last = self.num_stages - 1
        self.modules = [PeerStage(stages[s], s == last, self.meter, autocast) for s in self.mine]
        self.optim_cfg = self.cfg.optim_config()
        # one optimizer per stage module, as nobubble's workers have
        self.optimizers = [
            build_optimizer(self.optim_cfg, list(m.named_parameters())) for m in self.modules
        ]
        self.spans: list[Span] = []  # this rank's compute, all its stages (CPU only)
        spans = self.spans if device.type == "cpu" else []
        self.pipe = [
            TimedStage(m, s, self.num_stages, device, spans=spans)
            for s, m in zip(self.mine, self.modules, strict=True)
        ]
        pipe: list[_PipelineStageBase] = list(self.pipe)
        cls = TORCH_SCHEDULES[schedule][0]
        self.m = self.cfg.num_microbatches
        # the shared meter's: any of the rank's modules counts alike
        loss = self.pipe[-1].loss_in_span(self.modules[-1].loss)
        if issubclass(cls, PipelineScheduleMulti):
            self.schedule: PipelineScheduleSingle | PipelineScheduleMulti = cls(
                pipe, self.m, loss_fn=loss
            )
        else:
            self.schedule = cls(pipe[0], self.m, loss_fn=loss)
        self.losses: list[float] = []  # mean loss per step (the rank of the last stage)

    @property
    def module(self) -> PeerStage:
        """The rank's only stage (one stage per rank)."""
        assert len(self.modules) == 1, f"rank {self.rank} holds stages {self.mine}"
        return self.modules[0]

    def run_batch(self, j: int) -> None:
        """Forwards and backwards of batch j: the averaged gradient lands in ``.grad``."""
        x, y = batch_of(self.data, j, self.m, self.cfg.run.micro_batch_size)
        for stage in self.pipe:
            stage.first = j * self.m
        args = (x.to(self.device),) if 0 in self.mine else ()
        if self.num_stages - 1 in self.mine:  # rank P-1, or rank 0 under a V
            losses: list[torch.Tensor] = []
            self.schedule.step(*args, target=y.to(self.device), losses=losses, return_outputs=False)
            self.losses.append(sum(float(v.detach()) for v in losses) / len(losses))
        else:
            self.schedule.step(*args, return_outputs=False)

    def apply(self, j: int) -> None:
        """Step j+1 of every stage here: global clipping (sync schedules), lr schedule and
        optimizer, as nobubble's workers. The global norm adds every stage's square in stage
        order in float64, as nobubble does, so every rank computes the same bits."""
        shares = torch.zeros(self.num_stages, dtype=torch.float64, device=self.device)
        for s, module in zip(self.mine, self.modules, strict=True):
            shares[s] = grad_sq_norm(list(module.parameters())).to(self.device, torch.float64)
        dist.all_reduce(shares)  # one nonzero term per entry: exact
        norm = math.sqrt(float(sum_over_stages(list(shares))))
        if not math.isfinite(norm):
            raise FloatingPointError(f"rank {self.rank}, step {j + 1}: non-finite gradients")
        for s, module, optimizer in zip(self.mine, self.modules, self.optimizers, strict=True):
            start = time.time()  # the STEP span, as nobubble's: after the norm's all-reduce
            params = list(module.parameters())
            if self.optim_cfg.clip_norm is not None:
                scale_grads_(params, clip_coefficient(norm, self.optim_cfg.clip_norm))
            optimizer.set_lr(lr_at(j, self.cfg.run.steps, self.optim_cfg))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if self.device.type == "cpu":
                self.spans.append((Action(s, STEP, j + 1), start, time.time()))

    def train(self) -> list[float]:
        """All steps; the wall time at which this rank finished each, from a common start."""
        dist.barrier()
        t0, ends = time.time(), []
        for j in range(self.cfg.run.steps):
            self.run_batch(j)
            self.apply(j)
            ends.append(time.time() - t0)
            if j == 0:
                self.meter.reset()
        return ends


def result_of(run: PeerRun, schedule: str, gathered: list[Any]) -> dict:
    """The figures of the run from every rank's step end times, activation peaks (per rank,
    all its stages) and losses (only the rank of the last stage has them)."""
    cfg = run.cfg
    ends, peaks = [g[0] for g in gathered], [g[1] for g in gathered]
    losses = next(g[2] for g in gathered if g[2])
    lanes = [[(Action.parse(a), s, e) for a, s, e in g[3]] for g in gathered]
    util = measured_utilization(lanes) if all(lanes) else None
    end = [max(e[j] for e in ends) for j in range(cfg.run.steps)]  # a step ends on its last rank
    warm = max(1, cfg.run.steps // 10)  # the same steady window as nobubble's run_summary
    window = end[-1] - end[warm - 1]
    tokens = (cfg.run.steps - warm) * cfg.tokens_per_step
    return {
        "schedule": schedule,
        "stages": cfg.num_ranks,
        "stages_per_rank": cfg.model_stages // cfg.num_ranks,
        "microbatches": run.m,
        "steps": cfg.run.steps,
        "warmup_steps": warm,
        "tokens_per_step": cfg.tokens_per_step,
        "tokens_per_s": tokens / window if window > 0 else None,
        "step_times_s": [b - a for a, b in zip([0.0, *end[:-1]], end, strict=True)],
        "losses": losses,
        # measured over the whole run from compute spans, as nobubble's summary (CPU only)
        "steady_utilization": util["steady_utilization"] if util else None,
        "steady_bubble_share": util["steady_bubble_share"] if util else None,
        "peak_inflight": [p[0] for p in peaks],
        "peak_activation_bytes": [p[1] for p in peaks],
        "backend": dist.get_backend(),
        "threads": torch.get_num_threads(),
    }


def run_peer(cfg: TrainConfig, schedule: str, result: Path) -> None:
    """Entry of one process: train ``cfg.run.steps`` steps; rank 0 writes ``result``."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    # torch as its users run it: glibc's own thresholds, unless NOBUBBLE_MALLOC=tuned
    tune_host_allocator(default="default")
    torch.set_num_threads(cfg.launch.threads or max(1, (os.cpu_count() or 1) // world))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if cuda else "gloo", timeout=timedelta(seconds=cfg.runtime.dist_timeout)
    )
    run: PeerRun | None = None
    try:
        run = PeerRun(cfg, schedule, device)
        ends = run.train()
        meter = run.meter
        spans = [(str(a), s, e) for a, s, e in run.spans]
        mine = (ends, (meter.peak_inflight, meter.peak_bytes), run.losses, spans)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            out = result_of(run, schedule, gathered)
            result.write_text(json.dumps(out, indent=1) + "\n")
    finally:
        run = None  # torch's stages and schedule go before the process groups
        shutdown()


def launch_peer(
    train_argv: list[str],
    schedule: str,
    result: Path,
    stages: int,
    log: Path,
    malloc: str = "default",
) -> dict[str, Any]:
    """Run the peer on ``stages`` local processes, output appended to ``log``; its result.
    ``malloc``: the ranks' ``NOBUBBLE_MALLOC`` (glibc's own thresholds, or tuned).

    As ``nobubble train --runtime dist`` does: a free port, one process per rank, and when one
    fails the others are stopped (``launch._watch``).
    """
    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with log.open("ab") as sink:
            for rank in range(stages):
                env = rank_env(rank, stages, port, NOBUBBLE_MALLOC=malloc)
                command = [
                    sys.executable,
                    "-m",
                    "nobubble.app.ranks.torch_peer",
                    "--schedule",
                    schedule,
                    "--result",
                    str(result),
                    *train_argv,
                ]
                procs.append(subprocess.Popen(command, env=env, stdout=sink, stderr=sink))
            failed = _watch(procs)
    finally:  # also on an interrupt: no rank outlives the launcher
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if failed:
        rank, code = failed[0]
        raise NobubbleError(
            f"{schedule}: rank {rank} exited with status {code}; the other ranks were stopped. "
            f"Its output is in {log}"
        )
    return dict(json.loads(result.read_text()))


def main(argv: list[str] | None = None) -> int:
    from nobubble.app.train.flags import build_train_parser, config_from_args

    outer = argparse.ArgumentParser(prog="python -m nobubble.app.ranks.torch_peer", add_help=False)
    outer.add_argument("--schedule", required=True, choices=list(TORCH_SCHEDULES))
    outer.add_argument("--result", required=True, type=Path, help="JSON file (rank 0)")
    args, rest = outer.parse_known_args(argv)
    # the train flags are parsed under the nobubble schedule the torch one is placed and cut as,
    # so that the flags that apply to it only (--virtual-stages) parse
    twin = TORCH_SCHEDULES[args.schedule][1]
    train_args = build_train_parser().parse_args(["--schedule", twin, *rest])
    cfg = peer_config(config_from_args(train_args), args.schedule)
    run_peer(cfg, args.schedule, args.result)
    return 0


if __name__ == "__main__":
    leave_process(main())  # no interpreter finalization (rank_env.leave_process)
