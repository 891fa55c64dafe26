"""Joining the process group of ``Pipeline(runtime="dist")``: the (dp, pp) mesh, the stages a rank
does not run released, and the collectives of whole objects (merged state, shard records,
leaving)."""

from __future__ import annotations

import os
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from nobubble.core.placement import Placement, one_per_rank
from nobubble.runtime.distributed.waits import shutdown


@dataclass(frozen=True)
class Mesh:
    """This process's place on the (dp, pp) device mesh: it is pipeline rank ``pp_rank`` of
    replica ``dp_rank``; ``pp_ranks[r]`` is the global rank of pipeline rank r of its replica.
    With one replica ``device_mesh`` is the 1-D ("pp",) mesh and ``dp_group`` None."""

    pp_rank: int
    dp_rank: int
    pp_ranks: list[int]
    pp_group: Any
    dp_group: Any
    device_mesh: Any


def join(
    num_stages: int,
    stages: Sequence[nn.Module],
    placement: Placement | None = None,
    data_parallel: int = 1,
    backend: str | None = None,
    device: torch.device | None = None,
) -> Mesh:
    """Join (or start, from torchrun's environment) the process group and lay the world out
    as a ``(data_parallel, ranks)`` DeviceMesh with dims ("dp", "pp"); pipeline rank r runs the
    stages ``placement`` gives it (default: stage r). The world must hold one process per
    pipeline rank and replica. ``backend`` starts the group with that backend (None: NCCL for
    stages on a GPU, else gloo), or must be the backend of the group already started. The
    device is that of the rank's first stage, or ``device`` while that stage is still on meta."""
    where = placement or one_per_rank(num_stages)
    ranks = where.num_ranks
    world_needed = ranks * data_parallel
    how = f"{num_stages} stages" + ("" if ranks == num_stages else f" on {ranks} ranks")
    how += "" if data_parallel == 1 else f" × data_parallel={data_parallel}"
    if not dist.is_initialized():
        missing = [
            k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ
        ]
        if missing:
            raise ValueError(
                f"runtime='dist' needs a process group: start the script with torchrun "
                f"(--nproc-per-node {world_needed}) or set {', '.join(missing)}"
            )
        world_env = int(os.environ["WORLD_SIZE"])
        if world_env != world_needed:  # before the rendezvous, which would wait for no one
            raise ValueError(_world_error(world_env, world_needed, how))
        first = where.stages_of(int(os.environ["RANK"]) % ranks)[0]
        device = _device_of(stages[first], device)
        if backend == "nccl" and device.type != "cuda":
            raise ValueError(
                f"backend='nccl' moves GPU tensors only, but this rank's stage {first} is on "
                f"{device}: move it to a GPU, or use backend='gloo'"
            )
        backend = backend or ("nccl" if device.type == "cuda" else "gloo")
        dist.init_process_group(backend, timeout=timedelta(seconds=600))
    elif backend is not None and dist.get_backend() != backend:
        raise ValueError(
            f"backend={backend!r}, but the process group was started with "
            f"{dist.get_backend()!r}: leave backend=None to use the group as started, or start "
            f"it with {backend!r}"
        )
    world = dist.get_world_size()
    if world != world_needed:
        raise ValueError(_world_error(world, world_needed, how))
    device = _device_of(stages[where.stages_of(dist.get_rank() % ranks)[0]], device)
    # gloo moves host memory (stages on a GPU included: staging.py), so its mesh is the CPU's
    mesh_device = "cpu" if staged() else device.type
    if data_parallel == 1:  # one replica: no dp groups (each gloo group runs its own threads)
        flat = init_device_mesh(mesh_device, (ranks,), mesh_dim_names=("pp",))
        return Mesh(
            flat.get_local_rank("pp"), 0, list(range(ranks)), flat.get_group("pp"), None, flat
        )
    mesh = init_device_mesh(mesh_device, (data_parallel, ranks), mesh_dim_names=("dp", "pp"))
    dp_rank, pp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
    pp_ranks = [int(r) for r in mesh.mesh[dp_rank].tolist()]
    return Mesh(pp_rank, dp_rank, pp_ranks, mesh.get_group("pp"), mesh.get_group("dp"), mesh)


def _device_of(stage: nn.Module, fallback: torch.device | None) -> torch.device:
    found = next(stage.parameters()).device
    if found.type != "meta":
        return found
    return fallback if fallback is not None else torch.device("cpu")


def _world_error(world: int, needed: int, how: str) -> str:
    return (
        f"runtime='dist' runs one process per pipeline rank and replica: the world holds "
        f"{world} processes for {how}; start {needed} processes (torchrun --nproc-per-node "
        f"{needed})"
    )


def release_others(stages: list[torch.nn.Module], keep: int | Collection[int]) -> None:
    """Free the weights of the stages other ranks run, keeping every tensor of the stages in
    ``keep`` (this rank's: one stage index, or several), also where other stages share it (a
    Hugging Face model's stages share its rotary tables, for one)."""
    own = {keep} if isinstance(keep, int) else set(keep)
    kept = {id(t) for s in own for t in [*stages[s].parameters(), *stages[s].buffers()]}
    for s, stage in enumerate(stages):
        if s in own:
            continue
        for module in stage.modules():
            for name, p in module._parameters.items():
                if p is not None and id(p) not in kept:
                    module._parameters[name] = torch.nn.Parameter(
                        p.to("meta"), requires_grad=p.requires_grad
                    )
            for name, b in module._buffers.items():
                if b is not None and id(b) not in kept:
                    module._buffers[name] = b.to("meta")


def staged() -> bool:
    """Whether this process group moves host memory only (gloo): then every tensor goes through
    the host (``staging.py``; a no-op for tensors already there)."""
    return bool(dist.get_backend() == "gloo")


def objects_group() -> Any:
    """Pickled objects travel over gloo (on NCCL they would cross the GPU)."""
    return None if staged() else dist.new_group(backend="gloo")


def gather_state(state: dict[str, torch.Tensor], group: Any = None) -> dict[str, torch.Tensor]:
    """Every stage's ``state`` merged, gathered over the replica's ``group``."""
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, {k: v.cpu() for k, v in state.items()}, group=group)
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        merged.update(part)
    return merged


def gather_records(records: list[Any], group: Any = None) -> list[Any]:
    """Every rank's small ``records`` (lists of JSON-like dicts), concatenated in rank order."""
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, records, group=group)
    return [record for part in parts for record in part]


def close() -> None:
    """Leave the process group (call it on every rank after the last step)."""
    if dist.is_initialized():
        shutdown()
