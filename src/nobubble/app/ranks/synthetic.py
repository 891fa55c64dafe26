"""Synthetic runs: every forward and backward is a fixed-duration wait, not compute.

They run the real runtime pieces (interpreter, torch.distributed transport, one process per
stage) with a stand-in worker, so the measured makespan isolates the runtime's own overhead and
can be checked against the simulator's prediction for the same schedule and durations. Waits do
not use the CPU, so P = 8 processes run fine on 2 cores.

With ``--data-parallel D`` the world is D replicas (a (dp, pp) DeviceMesh, as in
``Pipeline(data_parallel=D)``): each stage holds a stand-in gradient of ``--grad-mb`` MB that
the real ``GradReducer`` all-reduces over its dp group before every step, where the
communication plan puts it. The prediction's all-reduce cost is measured the same way as the
hop latency: a calibration before the run (``_allreduce_time``), a property of the machine.

Entry of one rank:
``python -m nobubble.app.ranks.synthetic --schedule S --stages P ... --result F``
with torchrun's environment variables; ``run_synthetic`` launches all ranks and collects.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nobubble.app.ranks.launch import _watch, free_port, rank_env
from nobubble.app.ranks.rank_env import leave_process
from nobubble.core.comm import check_communication
from nobubble.core.ir import Schedule
from nobubble.core.schedules import build_schedule
from nobubble.core.validate import validate
from nobubble.engine import Interpreter
from nobubble.runtime.distributed.transport import DistTransport
from nobubble.runtime.distributed.waits import shutdown

TOKEN = (1,)  # the payload each transfer carries: one float


class WaitWorker:
    """Stands in for StageWorker: sleeps instead of computing, keeps the same bookkeeping."""

    def __init__(
        self, schedule: Schedule, stage: int, fwd_s: float, bwd_s: float, grad_numel: int = 1
    ) -> None:
        self.schedule, self.stage = schedule, stage
        self.fwd_s, self.bwd_s = fwd_s, bwd_s
        self.first, self.last = stage == 0, stage == schedule.num_stages - 1
        self.backwards_in_batch = 0
        weight = torch.nn.Parameter(torch.zeros(grad_numel))
        weight.grad = torch.ones(grad_numel)  # what the dp all-reduce averages
        self.named = [("weight", weight)]

    def forward(self, m: int, received: torch.Tensor | None) -> torch.Tensor | None:
        time.sleep(self.fwd_s)
        return None if self.last else torch.zeros(TOKEN)

    def backward(self, m: int, grad_out: torch.Tensor | None) -> torch.Tensor | None:
        time.sleep(self.bwd_s)
        self.backwards_in_batch += 1
        return None if self.first else torch.zeros(TOKEN)

    @property
    def batch_complete(self) -> bool:
        return self.backwards_in_batch == self.schedule.num_microbatches

    def grad_sq_norm(self) -> torch.Tensor:
        return torch.zeros(())

    def share(self) -> torch.Tensor:
        return self.grad_sq_norm()

    def step(self, step: int, total_sq_norm: torch.Tensor | None = None) -> None:
        self.backwards_in_batch = 0


def _hop_latency(rank: int, rounds: int = 20, idle_s: float = 0.02) -> float:
    """Median one-way latency of one message from rank 0 to rank 1 (seconds), with rank 1
    blocked in its receive for ``idle_s`` first, as a pipeline stage waiting for its input is.

    On this kind of virtual machine that wake-up costs milliseconds, ten times a tight
    ping-pong; it is a property of the machine, so the prediction should include it.
    """
    times = []
    for i in range(rounds):
        dist.barrier()
        if rank == 0:
            time.sleep(idle_s)
            dist.send(torch.tensor([time.time()], dtype=torch.float64), 1, tag=i)
        elif rank == 1:
            sent = torch.zeros(1, dtype=torch.float64)
            dist.recv(sent, 0, tag=i)
            times.append(time.time() - float(sent))
    out = [sorted(times)[len(times) // 2] if times else 0.0]
    dist.broadcast_object_list(out, src=1)
    return float(out[0])


def _allreduce_time(tensor: torch.Tensor, group: Any, rounds: int = 10) -> float:
    """Median seconds of one all-reduce of ``tensor`` over ``group``, its ranks aligned."""
    times = []
    for _ in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(tensor, group=group)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def rank_main(args: argparse.Namespace) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from nobubble.runtime.distributed.data_parallel import GradReducer

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    D = args.data_parallel
    P = world // D
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    mesh = init_device_mesh("cpu", (D, P), mesh_dim_names=("dp", "pp"))
    stage, dp = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    schedule = build_schedule(args.schedule, P, args.microbatches, args.steps, args.accum)
    validate(schedule)
    latency = _hop_latency(rank) if world > 1 else 0.0
    numel = max(1, int(args.grad_mb * 2**20) // 4)  # float32 elements
    worker = WaitWorker(schedule, stage, args.fwd, args.bwd, numel)
    allreduce = _allreduce_time(torch.ones(numel), mesh.get_group("dp")) if D > 1 else 0.0
    batches = check_communication(schedule, data_parallel=D > 1)[stage]
    transport = DistTransport(batches, TOKEN, torch.float32, torch.device("cpu"), P)
    reducer = GradReducer(worker, D, args.grad_mb + 1) if D > 1 else None  # one bucket
    pp_ranks = [int(r) for r in mesh.mesh[dp].tolist()]
    transport.use_mesh(pp_ranks, mesh.get_group("pp"), reducer, mesh.get_group("dp"))
    interp = Interpreter([worker], transport, P, clock=time.time)  # type: ignore[list-item]
    dist.barrier()
    for action in schedule.ranks[stage]:
        interp.execute(action)
    transport.flush()
    spans = [(str(a), s, e) for a, s, e in interp.spans]
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, spans)
    if rank == 0:
        t0 = min(s for lane in gathered for _, s, _ in lane)
        t1 = max(e for lane in gathered for _, _, e in lane)
        Path(args.result).write_text(
            json.dumps(
                {
                    "makespan_s": t1 - t0,
                    "latency_s": latency,
                    "allreduce_s": allreduce,
                    "spans": gathered,
                }
            )
        )
    del interp, transport, worker
    shutdown()


def run_synthetic(
    schedule: str,
    stages: int,
    microbatches: int,
    steps: int,
    fwd_s: float,
    bwd_s: float,
    accum: int | None = None,
    data_parallel: int = 1,
    grad_mb: float = 0.0,
) -> dict[str, Any]:
    """Launch one synthetic run on ``stages`` × ``data_parallel`` local processes and return
    rank 0's result."""
    import tempfile

    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        command = [
            sys.executable,
            "-m",
            "nobubble.app.ranks.synthetic",
            "--schedule",
            schedule,
            "--microbatches",
            str(microbatches),
            "--steps",
            str(steps),
            "--fwd",
            str(fwd_s),
            "--bwd",
            str(bwd_s),
            "--result",
            str(result),
            "--data-parallel",
            str(data_parallel),
            "--grad-mb",
            str(grad_mb),
        ]
        if accum is not None:
            command += ["--accum", str(accum)]
        procs = []
        world = stages * data_parallel
        for rank in range(world):
            procs.append(subprocess.Popen(command, env=rank_env(rank, world, port)))
        failed = _watch(procs)
        if failed:
            raise RuntimeError(
                f"synthetic run {schedule} P={stages}: rank {failed[0][0]} "
                f"failed with status {failed[0][1]}"
            )
        out: dict[str, Any] = json.loads(result.read_text())
    return out


def compare_with_simulator(
    schedules: list[str],
    stages: int,
    microbatches: int,
    steps: int,
    fwd_s: float,
    bwd_s: float,
    accum: int | None = None,
    rounds: int = 3,
    data_parallel: int = 1,
    grad_mb: float = 0.0,
) -> list[dict[str, Any]]:
    """Measured makespan (median of ``rounds``, alternating schedules) vs the simulator's.

    The prediction uses the same durations and, as a second figure, the measured one-way
    latency of a hop into a waiting stage (``_hop_latency``); with ``data_parallel`` > 1 both
    include the dp all-reduce of ``grad_mb`` MB per step and stage (``_allreduce_time``).
    """
    from statistics import median

    from nobubble.core.sim import CostModel, simulate

    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in schedules}
    for _ in range(rounds):
        for name in schedules:
            runs[name].append(
                run_synthetic(
                    name,
                    stages,
                    microbatches,
                    steps,
                    fwd_s,
                    bwd_s,
                    accum if name in ("pipedream", "paci") else None,
                    data_parallel,
                    grad_mb,
                )
            )
    rows = []
    for name, results in runs.items():
        schedule = build_schedule(
            name, stages, microbatches, steps, accum if name in ("pipedream", "paci") else None
        )
        measured = median(r["makespan_s"] for r in results)
        latency = median(r["latency_s"] for r in results)
        reduce_s = median(r["allreduce_s"] for r in results)
        cost = CostModel(fwd=fwd_s, bwd=bwd_s, allreduce=reduce_s)
        predicted = simulate(schedule, cost).metrics.makespan
        with_latency = simulate(
            schedule, CostModel(fwd=fwd_s, bwd=bwd_s, latency=latency, allreduce=reduce_s)
        )
        rows.append(
            {
                "schedule": name,
                "stages": stages,
                "microbatches": schedule.num_microbatches,
                "steps": steps,
                "data_parallel": data_parallel,
                "allreduce_ms": reduce_s * 1e3,
                "step_measured_s": measured / steps,
                "step_predicted_s": with_latency.metrics.makespan / steps,
                "measured_s": measured,
                "predicted_s": predicted,
                "predicted_with_latency_s": with_latency.metrics.makespan,
                "latency_ms": latency * 1e3,
                "error": measured / predicted - 1.0,
                "error_with_latency": measured / with_latency.metrics.makespan - 1.0,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m nobubble.app.ranks.synthetic")
    p.add_argument("--schedule", required=True)
    p.add_argument("--microbatches", type=int, required=True)
    p.add_argument("--accum", type=int, default=None)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--fwd", type=float, required=True)
    p.add_argument("--bwd", type=float, required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--data-parallel", type=int, default=1)
    p.add_argument("--grad-mb", type=float, default=0.0)
    rank_main(p.parse_args(argv))


if __name__ == "__main__":
    main()
    leave_process(0)  # no interpreter finalization (rank_env.leave_process)
