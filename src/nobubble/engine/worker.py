"""The stage worker: one stage's module, its weight versions, gradients and optimizer step.

It knows nothing about other stages or transports: the interpreter hands it inputs and ships its
outputs. Forward reads the weight version the ledger names; backward accumulates the averaged
gradient into the master parameters' ``.grad``; step applies the batch (clip, delay correction,
optimizer) and creates the next version.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypedDict

import torch
from torch import nn

from nobubble.core.ir import Schedule
from nobubble.core.ledger import StageLedger
from nobubble.engine.blocks import block_calls
from nobubble.engine.saved import Pending, Saved
from nobubble.engine.ties import Tie
from nobubble.engine.tree import (
    BoundarySpec,
    Tree,
)
from nobubble.engine.worker_backward import WorkerBackward
from nobubble.optim import (
    DelayCorrection,
    StageOptimizer,
)

Batch = tuple[Tree, Tree]  # (inputs of stage 0, targets of the loss)
LossFn = Callable[[Any, Any], torch.Tensor]


class WorkerOptions(TypedDict):
    """A worker's step settings, as ``PipelineConfig.worker_options`` makes them per stage."""

    correction: DelayCorrection
    clip_norm: float | None
    autocast_dtype: torch.dtype | None
    recompute: bool


class StageWorker(WorkerBackward):
    """One stage: ``module`` is stage ``ledger.stage`` of ``schedule.num_stages``.

    The module is called with its input (a tensor, or a tuple / dict of tensors: see
    ``engine/tree``); the first stage's input is the batch's, the others' the previous stage's
    output. The last stage's output goes through ``loss_fn(output, targets)``, which returns the
    scalar loss of the micro-batch.
    """

    def __init__(
        self,
        module: nn.Module,
        schedule: Schedule,
        ledger: StageLedger,
        optimizer: StageOptimizer,
        correction: DelayCorrection,
        batch_fn: Callable[[int], Batch],
        lr_fn: Callable[[int], float] | None,
        clip_norm: float | None = None,
        autocast_dtype: torch.dtype | None = None,
        recompute: bool = False,
        *,
        loss_fn: LossFn | None = None,
        sharded: Any = None,
    ) -> None:
        self.module, self.schedule, self.ledger = module, schedule, ledger
        self.stage, self.num_stages = ledger.stage, schedule.num_stages
        self.is_first, self.is_last = self.stage == 0, self.stage == self.num_stages - 1
        if self.is_last and loss_fn is None:
            raise ValueError(f"stage {self.stage} is the last stage: it needs a loss_fn")
        self.loss_fn = loss_fn
        self.optimizer, self.correction = optimizer, correction
        self.batch_fn, self.lr_fn, self.clip_norm = batch_fn, lr_fn, clip_norm
        self.autocast_dtype, self.recompute = autocast_dtype, recompute
        self.named = list(module.named_parameters())
        self.master: dict[str, torch.Tensor] = dict(self.named)
        if not self.named:
            raise ValueError(
                f"stage {self.stage} has no parameters: a pipeline stage must own weights to "
                "train; move a split point so that every stage holds at least one layer"
            )
        # the stage's declared device: inputs, state and buffers must all live there
        self.device = self.named[0][1].device
        # a stage sharded over its dp group (distributed/fsdp.py's FSDPStage): its parameters
        # are DTensor shards; it gathers the weights each action reads and reduce-scatters the
        # gradients each backward makes
        self.sharded = sharded
        # checkpointed blocks: a step stashes the weights of rebuilds to come (engine/blocks.py;
        # a sharded stage's blocks read gathered leaves, refused there with plain paci)
        self.checkpointed = block_calls(module) if sharded is None else []
        self.versions = self._new_versions(schedule, ledger)
        self.saved: dict[int, Saved] = {}
        self.pending: dict[int, Pending] = {}  # split backward: I ran, W not yet
        self.backwards_in_batch = 0
        # data parallelism: the GradReducer whose all-reduce the batch's last backward
        # launches (it binds itself here; None: launched where the plan puts it)
        self.reducer: Any = None
        # micro-batch -> loss (last stage only), kept as a device tensor until a drain point reads
        # it: a float() per micro-batch would stall a GPU's queue once per micro-batch
        self.losses: dict[int, torch.Tensor] = {}
        self.peak_saved = 0
        self.peak_activation_bytes = 0
        # the most bytes of weights stashed for checkpointed blocks' rebuilds (plain paci)
        self.peak_stash_bytes = 0
        self.grad_norms: dict[int, float] = {}  # step -> gradient norm before clipping
        self.in_spec: BoundarySpec | None = None  # agreed at the first micro-batch
        self.forwards = 0  # forwards run in this schedule (they run in micro-batch order)
        # tied parameters across stages, (stage a, name a, stage b, name b) with a < b: the
        # same pipeline-wide list on every stage; the step adds the two gradients (see share)
        self.ties: list[Tie] = []
        self.out_spec: BoundarySpec | None = None

    def use_schedule(self, schedule: Schedule, ledger: StageLedger, fresh: bool) -> None:
        """Run on from here under ``schedule``: a longer horizon of the same pipeline whose
        actions so far are those already run (``fresh=False``), or, at a drain point, a new
        segment numbered from 0 again (``fresh=True``)."""
        assert ledger.stage == self.stage, (ledger.stage, self.stage)
        if fresh:
            assert not self.saved and self.backwards_in_batch == 0, "a new segment mid-batch"
            peak = self.versions.peak_live  # the most over the whole run, segments included
            self.versions = self._new_versions(schedule, ledger)
            self.versions.peak_live = peak
            self.forwards = 0
        else:
            self.versions.extend(schedule, ledger)
        self.schedule, self.ledger = schedule, ledger

    def pop_losses(self, micro_batches: Iterable[int]) -> list[float]:
        """The losses of ``micro_batches`` as floats (one host sync for all of them)."""
        values = torch.stack([self.losses.pop(m) for m in micro_batches]).float().cpu()
        return values.tolist()


__all__ = [
    "Batch",
    "LossFn",
    "StageWorker",
    "WorkerOptions",
]
