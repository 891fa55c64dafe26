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

import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nobubble.api.arguments import (
    DTYPES,
    RUNTIMES,
    LossFn,
    OptimizerFactory,
    TorchOptimizer,
    adamw_matrices,
    check_backend,
    check_correction,
    check_data_parallel,
    check_stages,
    find_ties,
    fsdp_module,
    num_ranks_of,
    scaled_lr,
    target_device,
)
from nobubble.api.evaluation import Evaluation
from nobubble.api.materializing import materialize, on_meta
from nobubble.api.pipeline_state import PipelineState
from nobubble.api.steps import FIRST_HORIZON, MicrobatchLoss, StepResult, dist_runner
from nobubble.core.ir import ScheduleError
from nobubble.core.schedules import (
    check_trainable,
    resolve_microbatches,
    resolve_virtual_stages,
    schedule_info,
)
from nobubble.engine import InProcessTransport, StageWorker
from nobubble.engine.grad_fusion import check_fusable, fuse_grad_accumulation
from nobubble.engine.tree import Tree
from nobubble.optim import (
    OptimConfig,
    StageOptimizer,
    build_optimizer,
    make_correction,
)
from nobubble.optim.config import OPTIMIZERS


class Pipeline(PipelineState, Evaluation):
    """Pipeline-parallel training of ``stages`` under ``schedule``.

    Arguments (keywords after ``loss_fn``):
        stages: the stage modules, in order; stage s's output is stage s+1's input (a tensor
            is passed as the one argument, a tuple as positional and a dict as keyword ones).
            One per rank, except for interleaved-1f1b (v per rank: v·P modules for P ranks)
            and zbv (2 per rank in a V: 2P modules).
        loss_fn: ``loss_fn(outputs, targets)``, the scalar loss of one micro-batch, on the last
            stage. The pipeline averages it over the micro-batches of a step.
        schedule: one of ``nobubble.SCHEDULES`` (gpipe, 1f1b, pipedream, 2bw, paci, and the
            synchronous interleaved-1f1b, zb-h1 and zbv; both runtimes run all of them).
        virtual_stages: interleaved-1f1b's stages per rank, v (default 2; zbv's is 2).
        microbatches: micro-batches per optimizer step, M. ``accum`` sets the accumulation
            factor of pipedream and paci instead (their M; default 1 and M).
        optimizer: a name (adamw, muon, nadam, lion; muon routes the 2-D hidden matrices to Muon
            and embeddings, output heads and 1-D tensors to AdamW) or a callable that receives
            one stage's ``named_parameters()`` list and returns a ``torch.optim.Optimizer``,
            used as returned.
        lr: the learning rate of a named optimizer, or ``lr(step)`` giving it at each step
            index 0, 1, ...; ``optimizer_options`` sets the rest of
            ``nobubble.optim.OptimConfig`` (weight_decay, betas, momentum, ...).
        lr_schedule: ``factor(step)`` multiplying the learning rate at step index 0, 1, ...;
            None keeps it constant.
        clip: the largest gradient norm; None: no clipping. ``clip_scope``: "global" (the
            whole model's norm, over all stages together), "stage" (each stage's own), or
            "auto": global for the synchronous schedules, per stage for the asynchronous ones,
            whose stages do not step together.
        correction: a delay correction of the asynchronous schedules (docs/semantics.md):
            "none"; "ef" (error feedback with ``ef_lambda``, scaled by each stage's delay);
            "predict" (delayed forwards read their version extrapolated along its last update
            by the delay); "delay-lr" (each stage's lr damped by (1 + delay) ** -(1 - k /
            ``delay_lr_steps``) over the first ``delay_lr_steps`` steps); or "sync-warmup" (the
            first ``sync_warmup`` steps flushed).
        dtype: "fp32", or "bf16" for bf16 autocast with fp32 master weights.
        recompute: paci only: keep the stage input and recompute the forward at backward.
        fused_grad_accumulation: each local stage's stock ``nn.Linear`` and ``nn.Embedding``
            layers add their weight gradient into ``.grad`` inside the backward's own kernel
            (``addmm_``, ``index_add_``, as Megatron-LM's gradient-accumulation fusion), so a
            backward never holds a fresh gradient of a weight beside the accumulated one (their
            class becomes ``FusedGradLinear`` / ``FusedGradEmbedding``; parameters and state dicts
            are unchanged). Results differ from autograd's accumulation in the last bits. Not
            with a split backward (zb-h1, zbv) or data_parallel >= 2.
        runtime: "emulate" runs every stage in this process; "dist" runs rank r's stages in
            the process of rank r (start P processes, e.g. with torchrun; each builds the same
            stages and feeds the same batches, and only its own stages are used: stage r, or
            interleaved-1f1b's r, r+P, ... and zbv's r and 2P-1-r).
        timeout: seconds a "dist" rank waits for a peer before it reports which one it waited
            for.
        backend: with runtime="dist", the process group's backend when the pipeline starts it:
            "nccl", or "gloo" (None: NCCL for stages on a GPU, else gloo). gloo with stages on a
            GPU moves every tensor through host memory, so several ranks can share one GPU, to
            debug (NCCL refuses two ranks on one GPU; docs/runtime.md). A group already started
            is used as it is, and must have this backend.
        data_parallel: with runtime="dist", D replicas of the pipeline: the world is P·D
            processes on a DeviceMesh with dims ("dp", "pp"), and before each of its steps a
            stage averages its gradients over its D replicas (a bucketed all-reduce of
            ``bucket_mb`` MB buckets). Each process feeds its replica's batch: ``shard`` cuts it
            from a global batch, so that D replicas with micro-batches of b train as one
            pipeline with micro-batches of D·b (up to the order of the average's additions).
        shard: with data_parallel=D >= 2, "fsdp" shards each stage's parameters, gradients and
            optimizer state across its D replicas with torch's FSDP2 (``fully_shard``): each
            action gathers the weights it reads and each backward reduce-scatters its
            gradients (docs/runtime.md); "none" (default) replicates them. Optimizers: adamw,
            nadam, lion, muon (Newton-Schulz on the gathered matrix) or a callable, which gets
            the DTensor parameters.
        steps: the total number of steps, when known: the schedule then ends there (the last
            drain keeps no weight version for a batch that will not come); None: open-ended.
        seed, init, weights, device: for stages on the meta device (a model built under
            ``torch.device("meta")`` and cut by ``nobubble.split``): this process gives real
            tensors on ``device`` to the stages it runs, and only to those (default: the GPU of
            LOCAL_RANK when CUDA is available under runtime="dist", else the CPU). ``weights``
            (a safetensors file, or a folder with ``model.safetensors`` or a sharded index)
            loads them, reading only their tensors; ``seed`` gives bitwise the values the
            model's own init gives it built normally after ``torch.manual_seed(seed)``;
            ``init(model)`` replaces that init (``nobubble.materialize``).
    """

    def __init__(
        self,
        stages: Sequence[nn.Module],
        loss_fn: LossFn,
        *,
        schedule: str = "1f1b",
        virtual_stages: int | None = None,
        microbatches: int = 4,
        accum: int | None = None,
        optimizer: str | OptimizerFactory = "adamw",
        lr: float | Callable[[int], float] = 1e-3,
        optimizer_options: Mapping[str, Any] | None = None,
        lr_schedule: Callable[[int], float] | None = None,
        clip: float | None = None,
        clip_scope: str = "auto",
        correction: str = "none",
        ef_lambda: float = 1.0,
        delay_lr_steps: int | None = None,
        sync_warmup: int = 0,
        dtype: str = "fp32",
        recompute: bool = False,
        fused_grad_accumulation: bool = False,
        runtime: str = "emulate",
        steps: int | None = None,
        timeout: float = 600.0,
        data_parallel: int = 1,
        bucket_mb: float = 25.0,
        shard: str = "none",
        backend: str | None = None,
        seed: int | None = None,
        init: Callable[[nn.Module], Any] | None = None,
        weights: str | os.PathLike[str] | None = None,
        device: str | torch.device | None = None,
    ) -> None:
        self.stages = check_stages(stages)
        on_meta_device = [s for s, module in enumerate(self.stages) if on_meta(module)]
        given = [
            k for k, v in (("seed", seed), ("init", init), ("weights", weights)) if v is not None
        ]
        if given and not on_meta_device:
            raise ValueError(
                f"{given[0]}= gives values to stages built on the meta device, and no stage is: "
                f"build the model under torch.device('meta') before nobubble.split, or drop "
                f"{given[0]}="
            )
        if steps is not None and (
            isinstance(steps, bool) or not isinstance(steps, int) or steps < 1
        ):
            raise ValueError(f"steps={steps!r}: use the total number of steps (>= 1), or None")
        self.total_steps = steps
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable(outputs, targets), got {loss_fn!r}")
        self.loss_fn = loss_fn
        info = schedule_info(schedule)
        if runtime not in RUNTIMES:
            raise ValueError(
                f"runtime={runtime!r} is unknown: use 'emulate' (every stage in this process) "
                "or 'dist' (one process per stage, e.g. under torchrun)"
            )
        check_trainable(schedule, f"schedule={schedule!r}", runtime)
        self.runtime = runtime
        self.schedule_name = schedule
        self.num_stages = len(self.stages)  # v·P: the schedule's stages
        self.virtual_stages = resolve_virtual_stages(schedule, virtual_stages)
        self.num_ranks = num_ranks_of(schedule, self.num_stages, self.virtual_stages)
        self.microbatches = resolve_microbatches(schedule, microbatches, accum)
        self.accum = accum
        if not (isinstance(timeout, int | float) and timeout > 0):
            raise ValueError(f"timeout={timeout!r}: use a number of seconds > 0")
        self.timeout = float(timeout)
        check_backend(backend, runtime)
        self.sync_warmup = check_correction(
            correction, schedule, info.synchronous, sync_warmup, delay_lr_steps, shard
        )
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is unknown: use one of {tuple(DTYPES)}")
        if recompute and schedule != "paci":
            raise ValueError(f"recompute=True applies to paci only, not {schedule}")
        if not isinstance(fused_grad_accumulation, bool):
            raise TypeError(
                f"fused_grad_accumulation must be a bool, got {fused_grad_accumulation!r}"
            )
        if fused_grad_accumulation:
            check_fusable(schedule, info.split_backward, data_parallel)
        if clip is not None and not (
            isinstance(clip, int | float) and math.isfinite(clip) and clip > 0
        ):
            raise ValueError(f"clip={clip!r} is not allowed: use a finite number > 0, or None")
        if clip_scope not in ("auto", "global", "stage"):
            raise ValueError(
                f"clip_scope={clip_scope!r} is unknown: use 'auto', 'global' or 'stage'"
            )
        if clip_scope == "global" and not info.synchronous:
            raise ValueError(
                f"clip_scope='global' would make the stages of the asynchronous {schedule} meet "
                "before every step, which its order does not allow: use clip_scope='stage' (each "
                "stage clips its own norm) or 'auto'"
            )
        if clip_scope == "auto":  # the whole model's norm where the stages step together
            clip_scope = "global" if info.synchronous else "stage"
        self.global_clip = clip is not None and clip_scope == "global"
        self.ties = find_ties(self.stages)
        # the stages meet before each step: for the global norm, or to add tied gradients
        self.meets = self.global_clip or bool(self.ties)
        if self.ties and not info.synchronous:
            a, name_a, b, name_b = self.ties[0]
            raise ValueError(
                f"{name_b} of stage {b} is tied to {name_a} of stage {a}; {schedule} would "
                "update the two copies at different times: split with untie=True "
                "(--untie-embeddings) to train them as two parameters, or use a synchronous "
                "schedule (gpipe, 1f1b), which adds their gradients before each step"
            )
        if lr_schedule is not None and not callable(lr_schedule):
            raise TypeError(f"lr_schedule must be callable(step) -> factor, got {lr_schedule!r}")

        # the first horizon; generating it checks the integers (P, M) with the generator's errors
        self.drains: list[int] = []  # steps after which drain() was called
        try:
            self.schedule, self.ledger = self._generate(FIRST_HORIZON)
        except ScheduleError as err:
            raise ValueError(
                f"schedule={schedule!r} on {self.num_ranks} ranks with microbatches="
                f"{self.microbatches}: {err}"
            ) from None
        self.transport = InProcessTransport(self.num_stages)
        where = self.schedule.placement
        if runtime == "dist" and self.ties and where.stages_per_rank > 1:
            a, name_a, b, name_b = self.ties[0]
            raise ValueError(
                f"{name_b} of stage {b} is tied to {name_a} of stage {a}: runtime='dist' adds "
                f"tied gradients between ranks of one stage each, not under {schedule}'s "
                f"{where.kind} placement; split with untie=True (--untie-embeddings), or use "
                "runtime='emulate'"
            )
        self.data_parallel, self.bucket_mb = check_data_parallel(
            data_parallel, bucket_mb, runtime, where.num_ranks, self.num_stages
        )
        # "none" or "fsdp" (``Pipeline.shard`` is the method that cuts a batch)
        self.sharding = (
            shard
            if shard == "none"
            else fsdp_module().check_shard(shard, data_parallel, optimizer, self.ties)
        )
        target = target_device(device, runtime)
        self.mesh = (
            None
            if runtime == "emulate"
            else dist_runner().join(
                self.num_stages, self.stages, where, data_parallel, backend, device=target
            )
        )
        # this process's pipeline rank (its pp coordinate) and its replica (dp coordinate)
        self.rank = None if self.mesh is None else self.mesh.pp_rank
        self.dp_rank = 0 if self.mesh is None else self.mesh.dp_rank
        # the stages run here: all of them, or the rank's (one, or v in pipeline order)
        self.local = (
            list(range(self.num_stages)) if self.rank is None else list(where.stages_of(self.rank))
        )
        if any(s in on_meta_device for s in self.local):
            if not given:
                raise ValueError(
                    f"stage {self.local[0]} is on the meta device: give seed= (the seed the model "
                    "would be built with, after torch.manual_seed), init= (your init of the whole "
                    "model) or weights= (a safetensors file or folder)"
                )
            where_to = target if target is not None else torch.device("cpu")
            weights_path = Path(os.fspath(weights)) if weights is not None else None
            materialize(
                self.stages, self.local, seed=seed, init=init, weights=weights_path, device=where_to
            )
        self.workers: list[StageWorker] = []
        # per local stage, the layers whose backward adds into .grad (fused_grad_accumulation)
        self.fused_layers: dict[int, list[str]] = {}
        for s in self.local:
            module = self.stages[s]
            if fused_grad_accumulation:
                self.fused_layers[s] = fuse_grad_accumulation(module)
            # FSDP2 shards the stage now: its optimizer is built over the sharded parameters
            fsdp = (
                None
                if self.sharding == "none"
                else fsdp_module().shard_stage(module, self.mesh, timeout, s)
            )
            named = list(module.named_parameters())
            stage_opt: StageOptimizer | TorchOptimizer
            if callable(optimizer):
                built = optimizer(named)
                if not isinstance(built, torch.optim.Optimizer):
                    raise TypeError(
                        f"the optimizer callable returned {type(built).__name__} for stage {s}: "
                        "it must return a torch.optim.Optimizer over the parameters it was given"
                    )
                stage_opt = TorchOptimizer(built)
                lr_fn = lr_schedule
            else:
                if optimizer not in OPTIMIZERS:
                    raise ValueError(
                        f"optimizer={optimizer!r} is unknown: use one of {OPTIMIZERS} or a callable"
                    )
                options = dict(optimizer_options or {})
                first_lr = lr(0) if callable(lr) else lr
                ocfg = OptimConfig(
                    name=optimizer, lr=first_lr, clip_norm=clip, warmup_frac=0.0, **options
                )
                stage_opt = build_optimizer(
                    ocfg, named, adamw_names=adamw_matrices(module), require_muon=False
                )
                lr_fn = scaled_lr(lr, lr_schedule)
                if fsdp is not None:
                    stage_opt = fsdp_module().shard_optimizer(fsdp, stage_opt)
            correction_s = make_correction(correction, ef_lambda, delay_lr_steps or 1)
            self.workers.append(
                StageWorker(
                    module,
                    self.schedule,
                    self.ledger.stages[s],
                    stage_opt,  # type: ignore[arg-type]
                    correction_s,
                    self._batch,
                    lr_fn,
                    clip_norm=clip,
                    autocast_dtype=DTYPES[dtype],
                    recompute=recompute,
                    loss_fn=loss_fn if s == self.num_stages - 1 else None,
                    sharded=fsdp,
                )
            )
        for worker in self.workers:
            worker.ties = list(self.ties)
        self.by_stage = {w.stage: w for w in self.workers}
        routed = [getattr(w.optimizer, "routing", None) for w in self.workers]
        if optimizer == "muon" and self.rank is None and not any(r and r.muon for r in routed):
            raise ValueError(
                "optimizer='muon' found no 2-D hidden matrix in any stage (embeddings and "
                "output heads go to AdamW): Muon would update nothing; use optimizer='adamw'"
            )
        self.step_count = 0  # optimizer steps completed by every stage
        self.fed = 0  # batches fed
        self.batches: dict[int, tuple[Tree, Tree]] = {}  # micro-batch -> (inputs, targets)
        self.done: dict[int, int] = {}  # step -> stages that have taken it
        self._finished: dict[int, list[float]] = {}  # step -> gradient norm per stage
        self._reported = 0
        # called with each step number a local stage completes (nobubble train's runtime)
        self.on_step: Callable[[int], None] | None = None
        self.runner_options: dict[str, Any] = {}  # the "dist" runner's: record, clock, strict
        self.emulator = self._runner(0)


__all__ = ["MicrobatchLoss", "Pipeline", "StepResult"]
