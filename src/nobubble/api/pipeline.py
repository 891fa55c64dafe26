"""``nobubble.Pipeline``: a list of stage modules trained under any schedule, a batch at a time.

The pipeline runs one schedule over its whole life, generated for a horizon of steps ahead of
the batches fed so far and regenerated longer when the feed gets close. Every generator is
prefix-stable (the actions before the first one that needs an unfed batch do not depend on the
horizon; checked for all five), and each regeneration checks that the actions already run are
the new schedule's first ones: an open-ended loop runs exactly the schedule of its total length.
``drain()`` regenerates the schedule with a drain point after the batches fed and runs it that
far, so every micro-batch in flight finishes; later batches continue that schedule, which is how
``nobubble train`` drains for evaluation and checkpoints (the weight versions continue: 2BW's
next batch still reads the version before the last update).

Losses are reported when the last stage's forward of a micro-batch runs; asynchronous schedules
finish their steps in later calls. Nothing is ever invented.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nobubble.api.arguments import (
    TorchOptimizer,
    adamw_matrices,
    check_stages,
    find_ties,
    fsdp_module,
    num_ranks_of,
    scaled_lr,
    target_device,
)
from nobubble.api.config import InitSpec, LossFn, PipelineConfig
from nobubble.api.evaluation import Evaluation
from nobubble.api.materializing import materialize, on_meta
from nobubble.api.pipeline_state import PipelineState
from nobubble.api.steps import FIRST_HORIZON, MicrobatchLoss, Observer, StepResult, dist_runner
from nobubble.core.ir import ScheduleError
from nobubble.engine import InProcessTransport, StageWorker
from nobubble.engine.blocks import wrap_blocks
from nobubble.engine.grad_fusion import fuse_grad_accumulation
from nobubble.engine.tree import Tree
from nobubble.optim import StageOptimizer, build_optimizer, optimizer_entry


class Pipeline(PipelineState, Evaluation):
    """Pipeline-parallel training of ``stages`` under a schedule.

    stages: the stage modules, in order; stage s's output is stage s+1's input (a tensor is
        passed as the one argument, a tuple as positional and a dict as keyword ones). One per
        rank, except for interleaved-1f1b (v per rank: v·P modules for P ranks) and zbv (2 per
        rank in a V: 2P modules).
    loss_fn: ``loss_fn(outputs, targets)``, the scalar loss of one micro-batch, on the last
        stage. The pipeline averages it over the micro-batches of a step.
    config: a ``PipelineConfig`` (nobubble.api.config), or keywords that build one, each the
        field of the spec that documents it (``PipelineConfig.keywords()`` lists them):

    - schedule (``ScheduleSpec``): schedule, one of ``nobubble.SCHEDULE_NAMES`` (gpipe, 1f1b,
      pipedream, 2bw, paci, interleaved-1f1b, zb-h1, zbv; both runtimes run all of them);
      microbatches (M per optimizer step), accum (``a`` of pipedream and paci), virtual_stages;
      or an order given whole: schedule= a synchronous ``Schedule``, from_torch_csv= or from_json=
      a file (its first batch runs at every step; its M and stages must be these).
    - optimizer (``OptimizerSpec``): optimizer (a registered name, e.g. adamw, muon, nadam, lion,
      or a callable returning a ``torch.optim.Optimizer`` for a stage's named parameters), lr,
      optimizer_options, lr_schedule, clip, clip_scope.
    - correction (``CorrectionSpec``, docs/semantics.md): correction (none, ef, predict,
      delay-lr, sync-warmup), ef_lambda, delay_lr_steps, sync_warmup.
    - runtime (``RuntimeSpec``): runtime ("emulate": every stage here; "dist": rank r's stages in
      process r, e.g. under torchrun, every process building the same stages and feeding the
      same batches), dist_timeout, backend, data_parallel, bucket_mb, shard.
    - compute (``ComputeSpec``): dtype, paci_recompute, fused_grad_accumulation,
      activation_checkpointing, selective_every, compile.
    - init (``InitSpec``): seed, init, weights, device, for stages on the meta device.
    - steps: the total number of steps, when known (the last drain keeps no weight version for a
      batch that will not come); None: open-ended.

    observe: what ``nobubble train`` watches while the pipeline runs (``Observer``: every
    action's span, the runtime's clock, NCCL's point-to-point rules, each step completed).
    """

    def __init__(
        self,
        stages: Sequence[nn.Module],
        loss_fn: LossFn,
        *,
        config: PipelineConfig | None = None,
        observe: Observer | None = None,
        **keywords: Any,
    ) -> None:
        self.config = config = PipelineConfig.build(config, **keywords)
        self.observe = observe or Observer()
        self.stages = check_stages(stages)
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable(outputs, targets), got {loss_fn!r}")
        self.loss_fn = loss_fn
        on_meta_device = {s for s, module in enumerate(self.stages) if on_meta(module)}
        _check_init_given(config.init, bool(on_meta_device))
        self._resolve(config)
        self._first_schedule()
        self._join()
        if on_meta_device & set(self.local):
            _materialize(self.stages, self.local, config.init, self.target)
        self.workers = [self._worker(s) for s in self.local]
        self.by_stage = {w.stage: w for w in self.workers}
        self._check_matrices_found()
        self.step_count = 0  # optimizer steps completed by every stage
        self.fed = 0  # batches fed
        self.batches: dict[int, tuple[Tree, Tree]] = {}  # micro-batch -> (inputs, targets)
        self.done: dict[int, int] = {}  # step -> stages that have taken it
        self._finished: dict[int, list[float]] = {}  # step -> gradient norm per stage
        self._reported = 0
        self.emulator = self._runner(0)

    def _resolve(self, config: PipelineConfig) -> None:
        """The counts and names the parts below read, from the configuration and the stages."""
        spec = config.schedule
        self.total_steps = config.steps
        self.runtime = config.runtime.runtime
        self.schedule_name = spec.name
        self.num_stages = len(self.stages)  # v·P: the schedule's stages
        spec.check_stages(self.num_stages)  # a given order's stages
        self.virtual_stages = spec.stages_per_rank
        self.num_ranks = num_ranks_of(spec.name, self.num_stages, spec.stages_per_rank)
        self.microbatches = spec.num_microbatches
        self.timeout = float(config.runtime.dist_timeout)
        self.data_parallel = config.runtime.data_parallel
        self.bucket_mb = float(config.runtime.bucket_mb)
        self.global_clip = config.global_clip
        self.ties = _check_ties(find_ties(self.stages), spec.info.synchronous, spec.name)
        # the stages meet before each step: for the global norm, or to add tied gradients
        self.meets = self.global_clip or bool(self.ties)

    def _first_schedule(self) -> None:
        """The first horizon; generating it checks (P, M) with the generator's errors."""
        self.drains: list[int] = []  # steps after which drain() was called
        try:
            self.schedule, self.ledger = self._generate(FIRST_HORIZON)
        except ScheduleError as err:
            raise ValueError(
                f"schedule={self.schedule_name!r} on {self.num_ranks} ranks with microbatches="
                f"{self.microbatches}: {err}"
            ) from None
        self.transport = InProcessTransport(self.num_stages)

    def _join(self) -> None:
        """This process's place: every stage (emulate), or its rank's on the (dp, pp) mesh."""
        runtime, where = self.config.runtime, self.schedule.placement
        if runtime.runtime == "dist" and self.ties and where.stages_per_rank > 1:
            a, name_a, b, name_b = self.ties[0]
            raise ValueError(
                f"{name_b} of stage {b} is tied to {name_a} of stage {a}: runtime='dist' adds "
                f"tied gradients between ranks of one stage each, not under "
                f"{self.schedule_name}'s {where.kind} placement; split with untie=True "
                "(--untie-embeddings), or use runtime='emulate'"
            )
        # "none" or "fsdp" (``Pipeline.shard`` is the method that cuts a batch)
        self.sharding = runtime.shard
        if runtime.shard == "fsdp":
            fsdp_module().check_ties(self.ties)
        self.target = target_device(self.config.init.device, runtime.runtime)
        self.mesh = (
            None
            if runtime.runtime == "emulate"
            else dist_runner().join(
                self.num_stages,
                self.stages,
                where,
                runtime.data_parallel,
                runtime.backend,
                device=self.target,
            )
        )
        # this process's pipeline rank (its pp coordinate) and its replica (dp coordinate)
        self.rank = None if self.mesh is None else self.mesh.pp_rank
        self.dp_rank = 0 if self.mesh is None else self.mesh.dp_rank
        # the stages run here: all of them, or the rank's (one, or v in pipeline order)
        everything = list(range(self.num_stages))
        self.local = everything if self.rank is None else list(where.stages_of(self.rank))
        # per local stage, the layers whose backward adds into .grad (fused_grad_accumulation)
        self.fused_layers: dict[int, list[str]] = {}
        # per local stage, the blocks checkpointed or compiled (activation_checkpointing, compile)
        self.wrapped_blocks: dict[int, list[str]] = {}

    def _worker(self, s: int) -> StageWorker:
        """Stage ``s``'s worker: its optimizer (over FSDP2's shards with shard="fsdp"), its
        step's settings, and its place in the schedule."""
        config, module = self.config, self.stages[s]
        if config.compute.fused_grad_accumulation:
            self.fused_layers[s] = fuse_grad_accumulation(module)
        compute = config.compute
        self.wrapped_blocks[s] = wrap_blocks(
            module, compute.activation_checkpointing, compute.selective_every, compute.compile, s
        )
        # FSDP2 shards the stage now: its optimizer is built over the sharded parameters
        fsdp = (
            None
            if self.sharding == "none"
            else fsdp_module().shard_stage(module, self.mesh, self.timeout, s)
        )
        stage_opt, lr_fn = _stage_optimizer(config, module, s, fsdp)
        worker = StageWorker(
            module,
            self.schedule,
            self.ledger.stages[s],
            stage_opt,  # type: ignore[arg-type]
            batch_fn=self._batch,
            lr_fn=lr_fn,
            loss_fn=self.loss_fn if s == self.num_stages - 1 else None,
            sharded=fsdp,
            **config.worker_options(),  # the step's settings, made afresh per stage
        )
        worker.ties = list(self.ties)
        return worker

    def _check_matrices_found(self) -> None:
        optimizer = self.config.optimizer.optimizer
        if not isinstance(optimizer, str) or self.rank is not None:
            return
        routed = [getattr(w.optimizer, "routing", None) for w in self.workers]
        matrix = optimizer_entry(optimizer).matrix is not None
        if matrix and not any(r and r.muon for r in routed):
            raise ValueError(
                f"optimizer={optimizer!r} found no 2-D hidden matrix in any stage (embeddings and "
                "output heads go to AdamW): its matrix update would touch nothing; use "
                "optimizer='adamw'"
            )


def _check_init_given(init: InitSpec, any_on_meta: bool) -> None:
    given = init.given
    if given and not any_on_meta:
        raise ValueError(
            f"{given[0]}= gives values to stages built on the meta device, and no stage is: "
            f"build the model under torch.device('meta') before nobubble.split, or drop "
            f"{given[0]}="
        )


def _materialize(
    stages: list[Any], local: list[int], init: InitSpec, target: torch.device | None
) -> None:
    """Give the local stages on the meta device their tensors (``nobubble.materialize``)."""
    if not init.given:
        raise ValueError(
            f"stage {local[0]} is on the meta device: give seed= (the seed the model "
            "would be built with, after torch.manual_seed), init= (your init of the whole "
            "model) or weights= (a safetensors file or folder)"
        )
    where_to = target if target is not None else torch.device("cpu")
    weights = Path(os.fspath(init.weights)) if init.weights is not None else None
    materialize(stages, local, seed=init.seed, init=init.init, weights=weights, device=where_to)


def _check_ties(ties: list[Any], synchronous: bool, schedule: str) -> list[Any]:
    if ties and not synchronous:
        a, name_a, b, name_b = ties[0]
        raise ValueError(
            f"{name_b} of stage {b} is tied to {name_a} of stage {a}; {schedule} would "
            "update the two copies at different times: split with untie=True "
            "(--untie-embeddings) to train them as two parameters, or use a synchronous "
            "schedule (gpipe, 1f1b), which adds their gradients before each step"
        )
    return ties


def _stage_optimizer(
    config: PipelineConfig, module: Any, s: int, fsdp: Any
) -> tuple[StageOptimizer | TorchOptimizer, Any]:
    """Stage ``s``'s optimizer and its learning rate by step (None: a user's optimizer keeps
    its own, scaled by ``lr_schedule``)."""
    spec = config.optimizer
    named = list(module.named_parameters())
    if callable(spec.optimizer):
        built = spec.optimizer(named)
        if not isinstance(built, torch.optim.Optimizer):
            raise TypeError(
                f"the optimizer callable returned {type(built).__name__} for stage {s}: "
                "it must return a torch.optim.Optimizer over the parameters it was given"
            )
        return TorchOptimizer(built), spec.lr_schedule
    stage_opt = build_optimizer(
        spec.optim_config(), named, adamw_names=adamw_matrices(module), require_muon=False
    )
    if fsdp is not None:
        stage_opt = fsdp_module().shard_optimizer(fsdp, stage_opt)
    return stage_opt, scaled_lr(spec.lr, spec.lr_schedule)


__all__ = ["MicrobatchLoss", "Observer", "Pipeline", "PipelineConfig", "StepResult"]
