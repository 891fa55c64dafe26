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

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from nobubble.core.comm import check_communication
from nobubble.core.comm_ops import Batch
from nobubble.core.ir import STEP, Action, Schedule
from nobubble.engine import Interpreter, StageWorker
from nobubble.engine.tree import differentiable
from nobubble.runtime.distributed.data_parallel import GradReducer
from nobubble.runtime.distributed.join import (
    close,
    gather_records,
    gather_state,
    join,
    objects_group,
    staged,
)
from nobubble.runtime.distributed.staging import Arrival, HostStaged, stage_ops
from nobubble.runtime.distributed.transport import EVAL_TAG_BASE
from nobubble.runtime.distributed.tree_transport import (
    MAX_LEAVES,
    TRANSPORTS,
    Spec,
    TreeTransport,
    spec_of,
)
from nobubble.runtime.distributed.waits import Handle


@dataclass(frozen=True, kw_only=True)
class RankContext:
    """What a rank's runner reads of its pipeline: what was fixed when it was built, and live
    views of what changes as it runs (the batches fed, the drain points, the step count)."""

    rank: int  # the pipeline rank (pp coordinate)
    num_stages: int
    mesh: Any  # the (dp, pp) mesh of runtime/distributed/join.py
    meets: bool  # the stages meet before each step (global clipping, tied gradients)
    timeout: float
    ties: list[Any]
    all_reduces: bool  # a STEP waits for the dp all-reduce (replicated data parallelism)
    data_parallel: int
    bucket_mb: float
    microbatches: int
    record: bool  # every action's span
    clock: Any  # the spans' clock (None: the host's)
    strict_p2p: bool  # NCCL's completion rules on any backend
    fed: Callable[[], int]  # batches fed so far
    first_inputs: Callable[[], Any]  # the first stage's inputs of the first micro-batch held
    drains: Callable[[], Sequence[int]]  # steps after which the pipeline drains
    available: Callable[[Action], bool]  # whether an action's batch was fed
    on_step: Callable[[Action], None]  # a local stage completed a STEP


@dataclass(frozen=True)
class RankPosition:
    """Where this rank's runner stands (a failure message names it)."""

    position: int  # actions of this rank's order run so far
    current: Action | None  # the action being run, or last run (None before the first)
    waiting_for: int | None  # the pipeline rank of this replica a receive waits on
    posting_to: list[int]  # the global ranks of a batch of transfers that failed to post


class RankRunner:
    """Runs this rank's actions of the pipeline's schedule (the emulator's face, one rank):
    ``workers`` are its stages, one, or several in interleaved and V placements."""

    def __init__(
        self,
        context: RankContext,
        schedule: Schedule,
        workers: Sequence[StageWorker],
        start_step: int = 0,
    ) -> None:
        self.context, self.workers = context, list(workers)
        self.worker = self.workers[0]
        self.rank, self.num_stages = context.rank, context.num_stages
        self.schedule: Schedule = schedule
        self.placement = self.schedule.placement
        self.by_stage = {w.stage: w for w in self.workers}
        self.pointer = [0] * self.placement.num_ranks
        if start_step:
            self.pointer[self.rank] = self._after_step(start_step)
        # the global rank of each pipeline rank of this replica
        self.ranks: list[int] = context.mesh.pp_ranks
        self.transport: TreeTransport | None = None
        self.interpreter: Interpreter | None = None
        self.current: Action | None = None  # the action being run (failure messages name it)
        self.objects = objects_group()
        self.staged = staged()  # gloo: tensors go through host memory

    def _after_step(self, step: int) -> int:
        """The position after this rank's last STEP of ``step`` (one per local stage)."""
        order = self.schedule.ranks[self.rank]
        return 1 + max(i for i, a in enumerate(order) if a.kind == STEP and a.number == step)

    def _plan(self) -> list[Batch]:
        plans = check_communication(
            self.schedule,
            self.context.meets,
            self.context.drains(),
            data_parallel=self.context.all_reduces,
        )
        return plans[self.rank]

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
                inputs = worker._to_device(self.context.first_inputs())
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
                out_specs[stage] = spec_of(handed)
                dst = self.ranks[self.placement.rank_of(stage + 1)]
                dist.send_object_list([out_specs[stage]], dst=dst, group=self.objects)
        # spans recorded on the caller's clock, NCCL's completion rules on any backend
        context = self.context
        kind = TRANSPORTS[context.strict_p2p, self.staged]
        self.transport = kind(
            self._plan(),
            in_specs,
            out_specs,
            self.worker.device,
            self.num_stages,
            self.pointer[self.rank],
            context.timeout,
            context.ties,
            self.placement,
        )
        m = context.microbatches
        # a receive goes early only for a micro-batch fed (its message is in every replan)
        self.transport.fed = lambda message: message.number // m < context.fed()
        mesh, dp = context.mesh, context.data_parallel
        # data parallelism runs one stage per rank (Pipeline refuses more); a sharded stage
        # reduce-scatters inside each backward instead (distributed/fsdp.py)
        reducer = GradReducer(self.worker, dp, context.bucket_mb) if context.all_reduces else None
        self.transport.use_mesh(self.ranks, mesh.pp_group, reducer, mesh.dp_group)
        clock = {"clock": context.clock} if context.clock is not None else {}
        self.interpreter = Interpreter(
            self.workers,
            self.transport,
            self.num_stages,
            context.meets,
            record=context.record,
            **clock,
        )

    # ----- evaluation -----------------------------------------------------------------------------
    def evaluate(
        self, pieces: list[tuple[Any, Any]], outputs: bool = False
    ) -> list[torch.Tensor] | None:
        """Forwards of ``pieces`` stage to stage, at a drain point (nothing else is posted, so
        these blocking transfers cannot cross training's). Each boundary's structure travels
        as a small object first: an evaluation batch may be shaped unlike training's. The rank
        of the last stage returns the losses (the last stage's outputs with ``outputs``), the
        others None."""
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
                handed = worker.infer(inputs, y if stage == last else None, outputs)
                if stage == last:
                    losses.append(handed)
                elif self._remote(stage + 1):
                    self._send_evaluation(handed, i, stage + 1)
        return losses if last in self.by_stage else None

    def from_last_stage(self, value: int | None) -> int:
        """``value`` of the last stage's rank, on every rank of this replica (a broadcast over
        its pipeline group; the others pass None)."""
        holder = self.placement.rank_of(self.num_stages - 1)
        device = torch.device("cpu") if self.staged else self.worker.device
        box = torch.tensor([0 if value is None else value], dtype=torch.long, device=device)
        dist.broadcast(box, src=self.ranks[holder], group=self.context.mesh.pp_group)
        return int(box.item())

    def _send_evaluation(self, out: Any, i: int, stage: int) -> None:
        dst = self.ranks[self.placement.rank_of(stage)]
        spec = spec_of(out)
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
        handle.wait(self.context.timeout, what)

    # ----- what the caller reads -----------------------------------------------------------------
    def where(self) -> RankPosition:
        transport = self.transport
        return RankPosition(
            position=self.pointer[self.rank],
            current=self.current,
            waiting_for=transport.peer_of_last_wait if transport is not None else None,
            posting_to=list(transport.peers_of_failed_post) if transport is not None else [],
        )

    def comm_spans(self) -> list[tuple[str, Action, Any, Any]]:
        """Each transfer's (kind, action, start, end), recorded under ``record``."""
        return list(self.interpreter.comm) if self.interpreter is not None else []

    def allreduce_spans(self) -> dict[Any, Any]:
        """The data-parallel all-reduce's spans (empty without one)."""
        reducer = self.transport.reducer if self.transport is not None else None
        return dict(getattr(reducer, "spans", {}))

    def close_transport(self) -> None:
        """End the transport's own thread, if it has one (the strict one's stream)."""
        close_stream = getattr(self.transport, "close", None)
        if close_stream is not None:
            close_stream()

    # ----- running --------------------------------------------------------------------------------
    def _execute(self, action: Action) -> None:
        assert self.interpreter is not None
        self.current = action
        self.interpreter.execute(action)
        if action.kind == STEP:
            self.context.on_step(action)

    def advance(self) -> None:
        if self.transport is None:
            self._agree()
        order, i = self.schedule.ranks[self.rank], self.pointer[self.rank]
        while i < len(order) and self.context.available(order[i]):
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
        settle = getattr(self.context.clock, "settle", None)
        if settle is not None and self.interpreter is not None:
            settle(self.interpreter)  # a GPU's spans become seconds here, at a drain point


# what Pipeline(runtime="dist") reaches through this module (nobubble.api.steps.dist_runner)
__all__ = [
    "RankContext",
    "RankPosition",
    "RankRunner",
    "close",
    "gather_records",
    "gather_state",
    "join",
]
