"""``Pipeline(runtime="dist")``: this process runs one stage, its rank's, over torch.distributed.

Every rank builds the same ``Pipeline`` and feeds it the same batches; rank r runs stage r's
actions in its order, posting exactly the ``comm`` plan of the schedule (checked to complete
under NCCL's rules) through ``TreeTransport``, the runtime's transport for boundaries that are a
tensor or a tuple or dict of tensors. A rank runs an action once its batch was fed (as the
emulator does), so a ``step`` call returns without waiting on batches not fed yet.

Boundary shapes are agreed once, at the first batch: rank 0 runs its stage on micro-batch 0 and
sends the structure, shapes and dtypes of its output to rank 1, which runs its stage on zeros of
that shape, and so on down the pipeline (one forward per stage, no gradient).

With ``data_parallel=D`` the world is D replicas of the pipeline on a ``(dp, pp)`` DeviceMesh:
"rank" above means the pipeline rank (the stage, the pp coordinate), point-to-point goes to the
global ranks of this replica's stages, and before each STEP the stage's gradients are averaged
over its dp group (``data_parallel.GradReducer``, launched from inside the last backward). Each
replica feeds its own batch (``Pipeline.shard`` cuts it from a global one).
"""

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
from torch.utils import _pytree as pytree

from nobubble.core.comm import check_communication
from nobubble.core.comm_ops import GATHER, Batch
from nobubble.core.ir import STEP, Action, F, Schedule
from nobubble.core.placement import Placement, one_per_rank
from nobubble.engine import Interpreter, StageWorker
from nobubble.engine.tree import differentiable, pack_grads, tensor_leaves, unpack_grads
from nobubble.engine.worker import Tie, TieMeeting, tied_square
from nobubble.runtime.distributed.data_parallel import GradReducer
from nobubble.runtime.distributed.staging import Arrival, HostStaged, stage_ops
from nobubble.runtime.distributed.transport import (
    EVAL_TAG_BASE,
    DistTransport,
    Handle,
    StrictTransport,
    shutdown,
)

Spec = tuple[str, list[tuple[tuple[int, ...], torch.dtype]]]  # treespec, leaf shapes and dtypes
MAX_LEAVES = 1024  # evaluation tags: one per boundary leaf of a micro-batch


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


def _objects_group() -> Any:
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


def _spec(value: Any) -> Spec:
    flat, treespec = pytree.tree_flatten(value)
    return pytree.treespec_dumps(treespec), [(tuple(t.shape), t.dtype) for t in flat]


class TreeTransport(DistTransport):
    """``DistTransport`` for boundaries of several tensors: a message is the list of its leaves,
    one point-to-point operation each, all in the batch the plan puts it in. ``in_specs`` are
    the boundaries this rank's stages receive from other ranks (by receiving stage),
    ``out_specs`` those they send to other ranks (by sending stage; their gradients come back
    with the floating leaves). A receive the plan posts before its consumer's turn keeps its
    leaves in ``leaves_in`` until the consumer takes them."""

    def __init__(
        self,
        batches: Sequence[Batch],
        in_specs: dict[int, Spec],
        out_specs: dict[int, Spec],
        device: torch.device,
        num_stages: int,
        start_position: int,
        timeout_s: float,
        ties: Sequence[Tie] = (),
        placement: Placement | None = None,
    ) -> None:
        super().__init__(
            batches, (), torch.float32, device, num_stages, start_position, timeout_s, placement
        )
        self.in_specs, self.out_specs = in_specs, out_specs
        self.ties = list(ties)  # the pipeline's tied pairs (exec/worker.py), for ``gather``
        self.tied_shares: dict[int, tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}
        self.leaves_out: dict[Action, list[torch.Tensor]] = {}  # handed over, not posted yet
        self.leaves_in: dict[Action, tuple[Handle, list[torch.Tensor]]] = {}  # receives posted
        self.in_trees = {s: pytree.treespec_loads(spec[0]) for s, spec in in_specs.items()}
        # the gradients coming back are those of the sending stage's floating output leaves
        self.grad_leaves = {
            s: [(shape, dtype) for shape, dtype in spec[1] if dtype.is_floating_point]
            for s, spec in out_specs.items()
        }

    def replan(self, batches: Sequence[Batch]) -> None:
        """A longer (or drained) schedule: the batches not posted yet come from its plan."""
        self.batches = list(batches)
        self.cursor = next(
            (k for k, b in enumerate(self.batches) if b.position >= self.position),
            len(self.batches),
        )

    def send(self, producer: Action, tensor: Any, dst_stage: int) -> None:
        leaves = tensor_leaves(tensor) if producer.kind == F else unpack_grads(tensor)
        self.leaves_out[producer] = [t.contiguous() for t in leaves]

    def _recv_buffers(self, message: Action) -> list[torch.Tensor]:
        if message.kind == F:  # stage s's output, the input of stage s+1 (on this rank)
            leaves = self.in_specs[message.stage + 1][1]
        else:  # the gradient of stage s's input, for stage s-1's output
            leaves = self.grad_leaves[message.stage - 1]
        return [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in leaves]

    def _sent_tensors(self, message: Action) -> list[torch.Tensor]:
        handed = self.leaves_out.pop(message, None)
        assert handed is not None, f"plan sends {message}; nothing handed over"
        return handed

    def _keep_received(self, message: Action, handle: Handle, buffers: list[torch.Tensor]) -> None:
        self.leaves_in[message] = (handle, buffers)

    def flush(self) -> None:
        assert not self.leaves_out, f"handed over but not posted: {sorted(self.leaves_out)}"
        super().flush()

    def recv(self, producer: Action, dst_stage: int) -> Any:
        handle, leaves = self.leaves_in.pop(producer)
        self.peer_of_last_wait = peer = self.placement.rank_of(producer.stage)
        handle.wait(self.timeout_s, f"the receive of {producer} from rank {peer}")
        self.peer_of_last_wait = None
        self._received(producer)
        if producer.kind == F:
            return pytree.tree_unflatten(leaves, self.in_trees[dst_stage])
        return pack_grads(leaves)

    def contribute(self, step: int, stage: int, value: Any) -> None:
        if isinstance(value, tuple):  # tied parameters: (squared norm without them, their grads)
            self.tied_shares[step] = value
        else:
            super().contribute(step, stage, value)

    def gather(self, step: int, stage: int) -> TieMeeting:
        """The step's meeting with tied parameters, at the plan's gather (nothing else is in
        flight there): each pair's two ranks swap their gradients, the lower one computes the
        square of the sum, and every rank gathers every stage's norm and the pairs' squares.
        The arithmetic is the emulator's, so the result is bitwise the same."""
        batch = self._next_batch(self.position)
        assert batch is not None and batch.ops[0].kind == GATHER, f"plan has no gather at {step}"
        assert batch.ops[0].message.number == step, f"plan gathers {batch.ops[0]}, not step {step}"
        self.cursor += 1
        square, mine = self.tied_shares.pop(step)
        if self.reducer is not None:  # the averaged gradients' share (DistTransport._share)
            square, mine = self.reducer.share()
        grads = {(stage, name): g for name, g in mine.items()}
        ops = []
        for a, name_a, b, name_b in self.ties:
            if stage in (a, b):
                own, peer, other = (name_a, b, (b, name_b))
                if stage == b:
                    own, peer, other = name_b, a, (a, name_a)
                grads[other] = torch.empty_like(mine[own])
                to = self.ranks[peer]
                ops.append(dist.P2POp(dist.isend, mine[own].contiguous(), to, tag=0))
                ops.append(dist.P2POp(dist.irecv, grads[other], to, tag=0))
        if ops:
            self._launch(ops).wait(self.timeout_s, f"the tied gradients of step {step}")
        mine_squares = [square.detach().to(self.device, torch.float64).reshape(1)]
        for a, name_a, b, name_b in self.ties:
            pair = tied_square(grads[a, name_a] + grads[b, name_b]) if stage == a else None
            zero = torch.zeros(1, dtype=torch.float64, device=self.device)
            mine_squares.append(zero if pair is None else pair.to(self.device).reshape(1))
        handle, parts = self._all_gather(torch.cat(mine_squares))
        handle.wait(self.timeout_s, f"the gradient-norm gather of step {step}")
        pair_squares = {
            k: parts[a][1 + k] for k, (a, _, b, _) in enumerate(self.ties) if stage not in (a, b)
        }
        return TieMeeting([part[:1] for part in parts], grads, pair_squares)


class StrictTreeTransport(TreeTransport, StrictTransport):
    """``TreeTransport`` under NCCL's one-stream completion rule, on any backend."""


class StagedTreeTransport(HostStaged, TreeTransport):
    """``TreeTransport`` on gloo: every tensor through host memory (``staging.py``)."""


class StrictStagedTreeTransport(HostStaged, StrictTreeTransport):
    """``StrictTreeTransport`` on gloo: every tensor through host memory."""


TRANSPORTS = {  # (strict, staged) -> the runner's transport
    (False, False): TreeTransport,
    (True, False): StrictTreeTransport,
    (False, True): StagedTreeTransport,
    (True, True): StrictStagedTreeTransport,
}


class RankRunner:
    """Runs this rank's actions of the pipeline's schedule (the emulator's face, one rank):
    ``workers`` are its stages, one, or several in interleaved and V placements."""

    def __init__(self, pipe: Any, workers: Sequence[StageWorker], start_step: int = 0) -> None:
        self.pipe, self.workers = pipe, list(workers)
        self.worker = self.workers[0]
        self.rank, self.num_stages = pipe.rank, pipe.num_stages
        self.schedule: Schedule = pipe.schedule
        self.placement = self.schedule.placement
        self.by_stage = {w.stage: w for w in self.workers}
        self.pointer = [0] * self.placement.num_ranks
        if start_step:
            self.pointer[self.rank] = self._after_step(start_step)
        # the global rank of each pipeline rank of this replica
        self.ranks: list[int] = pipe.mesh.pp_ranks
        self.transport: TreeTransport | None = None
        self.interpreter: Interpreter | None = None
        self.current: Action | None = None  # the action being run (failure messages name it)
        self.objects = _objects_group()
        self.staged = staged()  # gloo: tensors go through host memory

    def _after_step(self, step: int) -> int:
        """The position after this rank's last STEP of ``step`` (one per local stage)."""
        order = self.schedule.ranks[self.rank]
        return 1 + max(i for i, a in enumerate(order) if a.kind == STEP and a.number == step)

    def _plan(self) -> list[Batch]:
        plans = check_communication(
            self.schedule,
            self.pipe.meets,
            self.pipe.drains,
            data_parallel=self._all_reduces,
        )
        return plans[self.rank]

    @property
    def _all_reduces(self) -> bool:
        """Whether a STEP waits for the dp all-reduce (replicated data parallelism; a sharded
        stage reduce-scatters inside each backward instead, distributed/fsdp.py)."""
        return self.pipe.data_parallel > 1 and self.pipe.sharding == "none"

    def set_schedule(self, schedule: Schedule) -> None:
        self.schedule = schedule
        if self.transport is not None:
            self.transport.replan(self._plan())

    def _remote(self, stage: int) -> bool:
        return self.placement.rank_of(stage) != self.rank

    # ----- shapes, once -------------------------------------------------------------------------
    def _agree(self) -> None:
        """Agree on the boundary specs down the pipeline (module docstring), stage by stage:
        this rank's stages in pipeline order, a hop to a stage of its own without a message.
        Then build the transport."""
        in_specs: dict[int, Spec] = {}
        out_specs: dict[int, Spec] = {}
        handed: Any = None  # the previous local stage's output
        for stage, worker in sorted(self.by_stage.items()):
            if stage == 0:
                inputs = worker._to_device(self.pipe.batches[min(self.pipe.batches)][0])
            elif not self._remote(stage - 1):
                inputs = handed
            else:
                box: list[Any] = [None]
                src = self.ranks[self.placement.rank_of(stage - 1)]
                dist.recv_object_list(box, src=src, group=self.objects)
                in_specs[stage] = spec = box[0]
                flat = [
                    torch.zeros(shape, dtype=dtype, device=worker.device)
                    for shape, dtype in spec[1]
                ]
                inputs = pytree.tree_unflatten(flat, pytree.treespec_loads(spec[0]))
            if stage == self.num_stages - 1:
                continue
            handed = worker.infer(inputs)  # no gradient; a sharded stage gathers its weights
            if not differentiable(handed):
                raise TypeError(f"stage {stage} output holds no floating tensor to train through")
            if self._remote(stage + 1):
                out_specs[stage] = _spec(handed)
                dst = self.ranks[self.placement.rank_of(stage + 1)]
                dist.send_object_list([out_specs[stage]], dst=dst, group=self.objects)
        # nobubble train's runtime sets these before the first step: spans recorded on its
        # clock, and NCCL's completion rules on any backend (--strict-p2p)
        options = self.pipe.runner_options
        kind = TRANSPORTS[bool(options.get("strict")), self.staged]
        self.transport = kind(
            self._plan(),
            in_specs,
            out_specs,
            self.worker.device,
            self.num_stages,
            self.pointer[self.rank],
            self.pipe.timeout,
            self.pipe.ties,
            self.placement,
        )
        m = self.pipe.microbatches
        # a receive goes early only for a micro-batch fed (its message is in every replan)
        self.transport.fed = lambda message: message.number // m < self.pipe.fed
        mesh, dp = self.pipe.mesh, self.pipe.data_parallel
        # data parallelism runs one stage per rank (Pipeline refuses more)
        reducer = GradReducer(self.worker, dp, self.pipe.bucket_mb) if self._all_reduces else None
        self.transport.use_mesh(self.ranks, mesh.pp_group, reducer, mesh.dp_group)
        clock = {"clock": options["clock"]} if "clock" in options else {}
        self.interpreter = Interpreter(
            self.workers,
            self.transport,
            self.num_stages,
            self.pipe.meets,
            record=bool(options.get("record")),
            **clock,
        )

    # ----- evaluation -----------------------------------------------------------------------------
    def evaluate(self, pieces: list[tuple[Any, Any]]) -> list[torch.Tensor] | None:
        """Forwards of ``pieces`` stage to stage, at a drain point (nothing else is posted, so
        these blocking transfers cannot cross training's). Each boundary's structure travels
        as a small object first: an evaluation batch may be shaped unlike training's. The rank
        of the last stage returns the losses, the others None."""
        last = self.num_stages - 1
        losses = []
        for i, (x, y) in enumerate(pieces):
            handed: Any = None
            for stage, worker in sorted(self.by_stage.items()):
                tag = EVAL_TAG_BASE + (i * self.num_stages + stage) * MAX_LEAVES
                if stage == 0:
                    inputs = x
                elif not self._remote(stage - 1):
                    inputs = handed
                else:
                    src = self.ranks[self.placement.rank_of(stage - 1)]
                    box: list[Any] = [None]
                    dist.recv_object_list(box, src=src, group=self.objects)
                    treespec, leaves = box[0]
                    flat = [torch.empty(sh, dtype=dt, device=worker.device) for sh, dt in leaves]
                    ops = [dist.P2POp(dist.irecv, t, src, tag=tag + k) for k, t in enumerate(flat)]
                    what = f"the evaluation input {i} of stage {stage} from rank {src}"
                    self._exchange(ops, what)
                    inputs = pytree.tree_unflatten(flat, pytree.treespec_loads(treespec))
                handed = worker.infer(inputs, y if stage == last else None)
                if stage == last:
                    losses.append(handed)
                elif self._remote(stage + 1):
                    self._send_evaluation(handed, i, stage + 1)
        return losses if last in self.by_stage else None

    def _send_evaluation(self, out: Any, i: int, stage: int) -> None:
        dst = self.ranks[self.placement.rank_of(stage)]
        spec = _spec(out)
        if len(spec[1]) > MAX_LEAVES:
            raise ValueError(f"stage {stage - 1} output has more than {MAX_LEAVES} tensors")
        dist.send_object_list([spec], dst=dst, group=self.objects)
        tag = EVAL_TAG_BASE + (i * self.num_stages + stage) * MAX_LEAVES
        flat_out = [t.contiguous() for t in pytree.tree_leaves(out)]
        ops = [dist.P2POp(dist.isend, t, dst, tag=tag + k) for k, t in enumerate(flat_out)]
        self._exchange(ops, f"the evaluation output {i} of stage {stage - 1} to rank {dst}")

    def _exchange(self, ops: list[dist.P2POp], what: str) -> None:
        """Post ``ops`` one by one (evaluation traffic: tagged, at a drain point) and wait for
        them; on gloo through host memory."""
        arrivals: list[Arrival] = []
        if self.staged:
            ops, arrivals = stage_ops(ops, HostStaged.copy_always)
        works = [op.op(op.tensor, op.peer, op.group, op.tag) for op in ops]
        handle = Handle(works, not self.staged and self.worker.device.type == "cuda")
        handle.arrivals += arrivals
        handle.wait(self.pipe.timeout, what)

    # ----- running --------------------------------------------------------------------------------
    def _execute(self, action: Action) -> None:
        assert self.interpreter is not None
        self.current = action
        self.interpreter.execute(action)
        if action.kind == STEP:
            self.pipe._on_step(action)

    def advance(self) -> None:
        if self.transport is None:
            self._agree()
        order, i = self.schedule.ranks[self.rank], self.pointer[self.rank]
        while i < len(order) and self.pipe._available(order[i]):
            self._execute(order[i])
            i += 1
            self.pointer[self.rank] = i

    def run(self, until_step: int) -> None:
        """Run through this rank's STEPs ``until_step`` (a drain point), then finish the sends."""
        if self.transport is None:
            self._agree()
        assert self.transport is not None
        order, i = self.schedule.ranks[self.rank], self.pointer[self.rank]
        stop = self._after_step(until_step)
        while i < stop:
            self._execute(order[i])
            i += 1
            self.pointer[self.rank] = i
        self.transport.flush()
