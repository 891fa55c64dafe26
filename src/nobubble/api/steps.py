"""The step loop of ``Pipeline`` (``StepLoop``, the base it is built on): micro-batches cut from
a step's batch (and a replica's rows from a global one), the schedule generated ahead of the
feed, the emulator or this rank's runner advanced, drains, and what a step returns
(``StepResult``, ``MicrobatchLoss``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from nobubble.core.ir import STEP, Action, Schedule
from nobubble.core.ledger import Ledger, build_ledger
from nobubble.core.validate import validate
from nobubble.engine import InProcessTransport, StageWorker
from nobubble.engine.tree import Tree
from nobubble.runtime.emulator import Emulator, rank_interpreters

FIRST_HORIZON = 16  # steps the schedule is first generated for (and at least ahead of the feed)


MARGIN = 2  # steps the horizon keeps ahead of the batches fed (1 suffices: tested for all)


@dataclass(frozen=True)
class MicrobatchLoss:
    """The loss of one micro-batch, as its last-stage forward computed it."""

    step: int  # the optimizer step (1-based, over the pipeline's life) its gradient goes into
    microbatch: int  # index over the pipeline's life
    value: float
    version: int  # updates the last stage had applied to the weights its forward read


@dataclass
class StepResult:
    """What one ``Pipeline.step`` (or ``drain``) call finished."""

    losses: list[MicrobatchLoss] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)  # steps every local stage completed
    grad_norms: dict[int, list[float]] = field(default_factory=dict)  # step -> norm per stage
    in_flight: int = 0  # micro-batches fed whose loss has not been reported yet

    @property
    def loss(self) -> float | None:
        """The mean of ``losses``, or None when no micro-batch finished in this call."""
        return sum(x.value for x in self.losses) / len(self.losses) if self.losses else None


@dataclass(frozen=True)
class Observer:
    """What a caller watches while the pipeline runs (``nobubble train`` does).

    record: every action's span (``Interpreter.spans``). clock: the spans' clock under
    runtime="dist" (None: the host's); one with ``settle(recorder)`` (a GPU's events) has its
    marks turned into seconds at each drain. strict_p2p: run point-to-point under NCCL's completion
    rules on any backend. on_step: called with each step number a local stage completes.
    """

    record: bool = False
    clock: Any = None
    strict_p2p: bool = False
    on_step: Callable[[int], None] | None = None


def dist_runner() -> Any:
    """The multi-process runner (runtime/distributed), imported only when asked for."""
    from nobubble.runtime.distributed import runner

    return runner


def shard_tree(value: Tree, m: int, d: int, r: int) -> Tree:
    if d == 1:
        return value
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 or value.shape[0] % (m * d):
            raise ValueError(
                f"a batch of {value.shape[0] if value.dim() else 'no'} rows does not split into "
                f"{m} micro-batches of {d} replicas: pass a global batch whose dim 0 is a "
                f"multiple of microbatches × data_parallel = {m * d}"
            )
        rows = value.shape[0] // (m * d)
        # (M·D·b, ...) -> (M, D, b, ...): micro-batch, replica, row
        return value.reshape(m, d, rows, *value.shape[1:])[:, r].reshape(m * rows, *value.shape[1:])
    if isinstance(value, dict):
        return {k: shard_tree(v, m, d, r) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return type(value)(shard_tree(v, m, d, r) for v in value)
    raise TypeError(
        f"a batch is a tensor, or a tuple or dict of tensors, not {type(value).__name__}"
    )


def split_tree(value: Tree, m: int, label: str) -> list[Tree]:
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 or value.shape[0] % m:
            size = "a scalar" if value.dim() == 0 else f"batch dimension {value.shape[0]}"
            raise ValueError(
                f"{label} has {size}, which does not split into the pipeline's {m} micro-batches: "
                f"pass a batch whose dim 0 is a multiple of {m}"
            )
        return list(value.chunk(m)) if m > 1 else [value]
    if isinstance(value, dict):
        split = {k: split_tree(v, m, f"{label}[{k!r}]") for k, v in value.items()}
        return [{k: v[i] for k, v in split.items()} for i in range(m)]
    if isinstance(value, tuple | list):
        split_l = [split_tree(v, m, f"{label}[{j}]") for j, v in enumerate(value)]
        return [type(value)(v[i] for v in split_l) for i in range(m)]
    raise TypeError(
        f"{label} is a {type(value).__name__}: pass a tensor, or a tuple or dict of tensors"
    )


class StepLoop:
    """Feeding, running and draining a ``Pipeline`` (the class that builds the parts below):
    the schedule generated a horizon ahead of the batches fed and regenerated longer (checked
    prefix-stable), the emulator or this rank's runner advanced as batches arrive, drain
    points, and the step results."""

    # built by Pipeline.__init__
    config: Any  # the PipelineConfig
    observe: Observer
    stages: list[nn.Module]
    total_steps: int | None
    schedule_name: str
    num_stages: int
    virtual_stages: int
    num_ranks: int
    microbatches: int
    meets: bool
    drains: list[int]
    schedule: Schedule
    ledger: Ledger
    transport: InProcessTransport
    data_parallel: int
    mesh: Any
    rank: int | None
    dp_rank: int
    local: list[int]
    workers: list[StageWorker]
    by_stage: dict[int, StageWorker]
    step_count: int
    fed: int
    batches: dict[int, tuple[Tree, Tree]]
    done: dict[int, int]
    _finished: dict[int, list[float]]
    _reported: int
    ties: list[Any]
    timeout: float
    bucket_mb: float
    sharding: str
    emulator: Any  # the Emulator, or this rank's RankRunner

    # ----- schedules ---------------------------------------------------------------------------
    def _generate(self, steps: int) -> tuple[Schedule, Ledger]:
        if self.total_steps is not None:
            steps = min(steps, self.total_steps)
        schedule = self.config.generate(
            self.num_ranks, steps, max_actions=None, drain_at=self.drains
        )
        validate(schedule)
        return schedule, build_ledger(schedule)

    def _runner(self, start_step: int) -> Any:
        """What runs the actions: the emulator (every rank here), or this rank's runner."""
        if self.rank is not None:
            runner = dist_runner()
            return runner.RankRunner(
                self._rank_context(runner), self.schedule, self.workers, start_step
            )
        return self._emulator(start_step)

    def _rank_context(self, runner: Any) -> Any:
        """What this rank's runner reads of the pipeline (runner.RankContext)."""
        assert self.rank is not None
        return runner.RankContext(
            rank=self.rank,
            num_stages=self.num_stages,
            mesh=self.mesh,
            meets=self.meets,
            timeout=self.timeout,
            ties=list(self.ties),
            all_reduces=self.data_parallel > 1 and self.sharding == "none",
            data_parallel=self.data_parallel,
            bucket_mb=self.bucket_mb,
            microbatches=self.microbatches,
            record=self.observe.record,
            clock=self.observe.clock,
            strict_p2p=self.observe.strict_p2p,
            fed=lambda: self.fed,
            first_inputs=lambda: self.batches[min(self.batches)][0],
            drains=lambda: self.drains,
            available=self._available,
            on_step=self._on_step,
        )

    def _available(self, action: Action) -> bool:
        """An action runs once its batch was fed."""
        m = self.microbatches
        batch = action.number - 1 if action.kind == STEP else action.number // m
        return batch < self.fed

    def _emulator(self, start_step: int) -> Emulator:
        interpreters = rank_interpreters(
            self.schedule, self.workers, self.transport, self.meets, record=self.observe.record
        )
        emulator = Emulator(self.schedule, interpreters, self.transport, start_step=start_step)
        emulator.available = self._available
        emulator.on_step = self._on_step
        return emulator

    def _regenerate(self, steps: int) -> None:
        """Go on under the schedule of ``steps`` steps (longer, or cut at the feed)."""
        schedule, ledger = self._generate(steps)
        done = self.emulator.pointer
        for r in range(len(done)):
            if schedule.ranks[r][: done[r]] != self.schedule.ranks[r][: done[r]]:
                raise RuntimeError(
                    f"the {steps}-step {self.schedule_name} schedule does not begin with the "
                    f"actions rank {r} already ran: its generator is not prefix-stable"
                )
        for worker in self.workers:
            worker.use_schedule(schedule, ledger.stages[worker.stage], fresh=False)
        self.schedule, self.ledger = schedule, ledger
        self.emulator.set_schedule(schedule)

    # ----- feeding -----------------------------------------------------------------------------
    def shard(self, batch: Tree) -> Tree:
        """This replica's part of a global batch (inputs or targets) of M micro-batches of
        D·b rows each: micro-batch m of replica r is rows r·b .. r·b+b-1 of global micro-batch
        m. With data_parallel=1, the batch itself."""
        return shard_tree(batch, self.microbatches, self.data_parallel, self.dp_rank)

    def _batch(self, m: int) -> tuple[Tree, Tree]:
        return self.batches[m]

    def step(self, inputs: Tree, targets: Tree) -> StepResult:
        """Feed one optimizer step's batch and run every action it makes possible.

        ``inputs`` (the first stage's) and ``targets`` (``loss_fn``'s) are split into the
        pipeline's M micro-batches along dim 0; a tuple or dict is split leaf by leaf.
        """
        m = self.microbatches
        if self.total_steps is not None and self.fed >= self.total_steps:
            raise RuntimeError(
                f"the pipeline was built for steps={self.total_steps}, all fed: build it with "
                "more steps, or steps=None for an open-ended loop"
            )
        pieces = list(
            zip(split_tree(inputs, m, "inputs"), split_tree(targets, m, "targets"), strict=True)
        )
        if self.fed + 1 + MARGIN > self.schedule.num_steps and self.fed < self.total_or_inf:
            self._regenerate(max(2 * self.schedule.num_steps, self.fed + FIRST_HORIZON))
        for i, piece in enumerate(pieces):
            self.batches[self.fed * m + i] = piece
        self.fed += 1
        self.emulator.advance()
        return self._result()

    def drain(self) -> StepResult:
        """Finish every micro-batch in flight: the schedule drains after the batches fed.

        Afterwards every stage holds the same number of updates and nothing is in flight: the
        point for evaluation and checkpoints.
        """
        if self.fed and self.step_count < self.fed:
            # the schedule drains after step `fed` and goes on past it, so a version that a
            # later batch reads (2BW's) is kept as the uninterrupted schedule keeps it
            self.drains.append(self.fed)
            self._regenerate(max(self.schedule.num_steps, self.fed + FIRST_HORIZON))
            self.emulator.run(self.fed)
        assert not self.in_flight
        return self._result()

    def _on_step(self, action: Action) -> None:
        if self.observe.on_step is not None:
            self.observe.on_step(action.number)
        done = self.done
        done[action.number] = done.get(action.number, 0) + 1
        if done[action.number] == len(self.workers):
            del done[action.number]
            self.step_count = action.number
            norms = [w.grad_norms.pop(action.number) for w in self.workers]
            self._finished[action.number] = norms

    def _result(self) -> StepResult:
        first = self.by_stage.get(0)
        last = self.by_stage.get(self.num_stages - 1)
        # a micro-batch's data is read by stage 0's forward and the last stage's F (and B when
        # recomputing): drop it once both have run (a middle rank reads none)
        done = min([w.forwards for w in (first, last) if w is not None], default=self.fed * 10**9)
        for m in [m for m in self.batches if m < done and (last is None or m not in last.saved)]:
            del self.batches[m]
        finished = sorted(last.losses) if last is not None else []
        losses: list[MicrobatchLoss] = []
        if last is not None and finished:
            values = last.pop_losses(finished)
            versions = self.ledger.stages[-1].fwd_version
            for m, value in zip(finished, values, strict=True):
                step = m // self.microbatches + 1
                losses.append(MicrobatchLoss(step, m, value, versions[m]))
        self._reported += len(losses)
        steps, self._finished = self._finished, {}
        finished_mb = self._reported if last is not None else self.step_count * self.microbatches
        in_flight = self.fed * self.microbatches - finished_mb
        return StepResult(losses, list(steps), steps, in_flight)

    def spans(self) -> list[tuple[Action, Any, Any]]:
        """Every action this process ran with its start and end, rank by rank in order
        (recorded under ``Observer(record=True)``; empty otherwise)."""
        interpreters = getattr(self.emulator, "interpreters", None)
        if interpreters is None:  # this rank's runner: one interpreter, once it has started
            interpreters = [i for i in [self.emulator.interpreter] if i is not None]
        return [span for interpreter in interpreters for span in interpreter.spans]

    def where(self) -> Any:
        """With runtime="dist": where this rank stands (``RankPosition``: its position in its
        order, the action it runs, the peer a receive waits on); None under the emulator."""
        return self.emulator.where() if self.rank is not None else None

    def comm_spans(self) -> list[tuple[str, Action, Any, Any]]:
        """With runtime="dist": this rank's transfers (kind, action, start, end), recorded
        under ``Observer(record=True)``; empty otherwise."""
        return self.emulator.comm_spans() if self.rank is not None else []

    def allreduce_spans(self) -> dict[int, Any]:
        """With runtime="dist" and data parallelism: each step's all-reduce span."""
        return self.emulator.allreduce_spans() if self.rank is not None else {}

    def close_transport(self) -> None:
        """With runtime="dist": end the transport's own thread (the strict one's), also after
        a failure; ``close`` then leaves the process group."""
        if self.rank is not None:
            self.emulator.close_transport()

    def close(self) -> None:
        """With runtime="dist": leave the process group (every rank, after the last step)."""
        if self.rank is not None:
            dist_runner().close()

    # ----- state -------------------------------------------------------------------------------
    @property
    def total_or_inf(self) -> float:
        return math.inf if self.total_steps is None else self.total_steps

    @property
    def in_flight(self) -> bool:
        """Whether some batch fed has not been stepped by every stage yet."""
        return self.step_count < self.fed

    def _check_drained(self, what: str) -> None:
        if self.in_flight:
            raise RuntimeError(
                f"{what} needs a drained pipeline (every stage at the same version, nothing in "
                "flight): call pipeline.drain() first"
            )

    @property
    def versions(self) -> Ledger:
        """The version ledger: which version every forward, backward and step used (of the
        schedule as far as generated; the micro-batches fed so far are final)."""
        return self.ledger


__all__ = [
    "FIRST_HORIZON",
    "MARGIN",
    "MicrobatchLoss",
    "Observer",
    "StepLoop",
    "StepResult",
    "dist_runner",
    "shard_tree",
    "split_tree",
]
