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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nobubble.api.materializing import materialize, on_meta
from nobubble.core.ir import STEP, Action, Schedule, ScheduleError
from nobubble.core.ledger import Ledger, build_ledger
from nobubble.core.schedules import (
    SCHEDULES,
    build_schedule,
    check_trainable,
    resolve_microbatches,
    resolve_virtual_stages,
    schedule_info,
)
from nobubble.core.validate import validate
from nobubble.engine import InProcessTransport, StageWorker
from nobubble.engine.tree import Tree
from nobubble.engine.worker import Tie
from nobubble.optim import (
    CORRECTIONS,
    DelayAwareLR,
    OptimConfig,
    StageOptimizer,
    build_optimizer,
    make_correction,
)
from nobubble.optim.config import OPTIMIZERS
from nobubble.runtime.emulator import Emulator, rank_interpreters

LossFn = Callable[[Any, Any], torch.Tensor]
OptimizerFactory = Callable[[list[tuple[str, nn.Parameter]]], torch.optim.Optimizer]
RUNTIMES = ("emulate", "dist")
DTYPES = {"fp32": None, "bf16": torch.bfloat16}
FIRST_HORIZON = 16  # steps the schedule is first generated for (and at least ahead of the feed)
MARGIN = 2  # steps the horizon keeps ahead of the batches fed (1 suffices: tested for all)
FORMAT = "nobubble.pipeline/1"


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


class TorchOptimizer:
    """A user's ``torch.optim.Optimizer`` behind the stage-optimizer face, used as returned.

    ``set_lr(factor)`` scales each group's learning rate as built (an ``lr_schedule`` factor).
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.base_lrs = [float(g["lr"]) for g in optimizer.param_groups]

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def set_lr(self, factor: float) -> None:
        for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = base * factor

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": "callable", "state": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("optimizer") != "callable":
            raise ValueError(
                f"optimizer state of {state.get('optimizer')!r} given to a pipeline built with a "
                "callable optimizer: build the pipeline with the optimizer it was saved with"
            )
        self.optimizer.load_state_dict(state["state"])


def _check_stages(stages: Sequence[nn.Module]) -> list[nn.Module]:
    if isinstance(stages, nn.Module) or not isinstance(stages, Sequence) or not stages:
        raise TypeError(
            "stages must be a non-empty list of nn.Module, one per pipeline stage (cut a model "
            f"with nobubble.split), got {type(stages).__name__}"
        )
    owner: dict[int, tuple[int, str]] = {}
    for s, module in enumerate(stages):
        if not isinstance(module, nn.Module):
            raise TypeError(f"stage {s} is a {type(module).__name__}, not an nn.Module")
        named = list(module.named_parameters())
        if not named:
            raise ValueError(
                f"stage {s} has no parameters: a pipeline stage must own weights to train; move "
                "a split point so that every stage holds at least one layer"
            )
        for name, p in named:
            if id(p) in owner and owner[id(p)][0] != s:
                other, other_name = owner[id(p)]
                raise ValueError(
                    f"parameter {name!r} of stage {s} is also {other_name!r} of stage {other} "
                    "(tied weights): each stage must own its weights; untie them (e.g. "
                    "clone the output embedding) before splitting"
                )
            owner[id(p)] = (s, name)
    return list(stages)


class Pipeline:
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
        self.stages = _check_stages(stages)
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
        self.num_ranks = _num_ranks(schedule, self.num_stages, self.virtual_stages)
        self.microbatches = resolve_microbatches(schedule, microbatches, accum)
        self.accum = accum
        if not (isinstance(timeout, int | float) and timeout > 0):
            raise ValueError(f"timeout={timeout!r}: use a number of seconds > 0")
        self.timeout = float(timeout)
        _check_backend(backend, runtime)
        if correction not in CORRECTIONS:
            raise ValueError(f"correction={correction!r} is unknown: use one of {CORRECTIONS}")
        if correction != "none" and info.synchronous:
            raise ValueError(
                f"correction={correction!r} corrects asynchronous schedules; {schedule} is "
                "synchronous: use correction='none'"
            )
        if correction == "sync-warmup" and not (isinstance(sync_warmup, int) and sync_warmup > 0):
            raise ValueError(
                f"correction='sync-warmup' needs sync_warmup >= 1 steps, got {sync_warmup!r}"
            )
        self.sync_warmup = sync_warmup if correction == "sync-warmup" else 0
        if correction == "delay-lr":
            DelayAwareLR(delay_lr_steps)  # type: ignore[arg-type]  # refuses a bad value now
        elif delay_lr_steps is not None:
            raise ValueError(
                f"delay_lr_steps={delay_lr_steps!r} applies to correction='delay-lr' only, not "
                f"{correction!r}: drop it or use correction='delay-lr'"
            )
        if shard == "fsdp" and correction == "predict":
            raise ValueError(
                "correction='predict' with shard='fsdp': a prediction is a whole-stage weight "
                "copy, which the sharded versions do not keep; use correction='ef' or "
                "'delay-lr', or shard='none'"
            )
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is unknown: use one of {tuple(DTYPES)}")
        if recompute and schedule != "paci":
            raise ValueError(f"recompute=True applies to paci only, not {schedule}")
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
        self.ties = _find_ties(self.stages)
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
        self.data_parallel, self.bucket_mb = _check_data_parallel(
            data_parallel, bucket_mb, runtime, where.num_ranks, self.num_stages
        )
        # "none" or "fsdp" (``Pipeline.shard`` is the method that cuts a batch)
        self.sharding = (
            shard
            if shard == "none"
            else _fsdp().check_shard(shard, data_parallel, optimizer, self.ties)
        )
        target = _target_device(device, runtime)
        self.mesh = (
            None
            if runtime == "emulate"
            else _dist().join(
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
        for s in self.local:
            module = self.stages[s]
            # FSDP2 shards the stage now: its optimizer is built over the sharded parameters
            fsdp = (
                None
                if self.sharding == "none"
                else _fsdp().shard_stage(module, self.mesh, timeout, s)
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
                    ocfg, named, adamw_names=_adamw_matrices(module), require_muon=False
                )
                lr_fn = _scaled(lr, lr_schedule)
                if fsdp is not None:
                    stage_opt = _fsdp().shard_optimizer(fsdp, stage_opt)
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

    # ----- schedules ---------------------------------------------------------------------------
    def _generate(self, steps: int) -> tuple[Schedule, Ledger]:
        if self.total_steps is not None:
            steps = min(steps, self.total_steps)
        schedule = build_schedule(
            self.schedule_name,
            self.num_ranks,
            self.microbatches,
            steps,
            self.microbatches if SCHEDULES[self.schedule_name].uses_accum else None,
            sync_warmup=min(self.sync_warmup, steps),
            max_actions=None,
            drain_at=self.drains,
            virtual_stages=self.virtual_stages,
        )
        validate(schedule)
        return schedule, build_ledger(schedule)

    def _runner(self, start_step: int) -> Any:
        """What runs the actions: the emulator (every rank here), or this rank's runner."""
        if self.rank is not None:
            return _dist().RankRunner(self, self.workers, start_step)
        return self._emulator(start_step)

    def _available(self, action: Action) -> bool:
        """An action runs once its batch was fed."""
        m = self.microbatches
        batch = action.number - 1 if action.kind == STEP else action.number // m
        return batch < self.fed

    def _emulator(self, start_step: int) -> Emulator:
        interpreters = rank_interpreters(self.schedule, self.workers, self.transport, self.meets)
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
        return _shard_tree(batch, self.microbatches, self.data_parallel, self.dp_rank)

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
            zip(_split_tree(inputs, m, "inputs"), _split_tree(targets, m, "targets"), strict=True)
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

    def evaluate(
        self, inputs: Tree, targets: Tree, microbatches: int | None = None
    ) -> float | None:
        """The loss of a batch on the current weights: forwards only, stage to stage, in eval
        mode, changing no training state. The batch is cut into ``microbatches`` pieces (the
        pipeline's M by default) along dim 0; the result is the mean of their losses, as a
        step's loss is. Needs a drained pipeline. With runtime="dist", call it on every rank
        with the same batch: the rank of the last stage returns the loss (the last rank; rank 0
        under zbv's V), the others None."""
        self._check_drained("evaluate()")
        m = self.microbatches if microbatches is None else microbatches
        if not isinstance(m, int) or isinstance(m, bool) or m < 1:
            raise ValueError(f"microbatches={m!r} is not allowed: use an integer >= 1")
        pieces = list(
            zip(_split_tree(inputs, m, "inputs"), _split_tree(targets, m, "targets"), strict=True)
        )
        modes = [(w.module, w.module.training) for w in self.workers]
        for module, _ in modes:
            module.eval()
        try:
            if self.rank is not None:
                losses = self.emulator.evaluate(pieces)
            else:
                losses = []
                for x, y in pieces:
                    h = x
                    for worker in self.workers:
                        h = worker.infer(h, y)
                    losses.append(h)
        finally:
            for module, training in modes:
                module.train(training)
        if losses is None:
            return None
        values = torch.stack([loss.detach().float().reshape(()) for loss in losses]).cpu().tolist()
        return sum(values) / len(values)

    def _on_step(self, action: Action) -> None:
        if self.on_step is not None:
            self.on_step(action.number)
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

    def close(self) -> None:
        """With runtime="dist": leave the process group (every rank, after the last step)."""
        if self.rank is not None:
            _dist().close()

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

    def merged_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights under its own parameter names (a copy). The master
        weights: in flight, the newest version of every stage. With runtime="dist" every rank
        gathers every stage's (a collective: call it on every rank; tensors on the CPU)."""
        state: dict[str, torch.Tensor] = {}
        for s in self.local:  # whole tensors (a dp collective when the stages are sharded)
            state.update(self.by_stage[s].module_state())
        if self.mesh is not None:
            return _dist().gather_state(state, self.mesh.pp_group)
        return state

    def save_weights(self, folder: str | os.PathLike[str]) -> Path:
        """The model's weights as safetensors shards in ``folder``, one per stage under the
        model's own names (``model-0000k-of-0000n.safetensors``), with the index transformers
        reads. Each process writes its own stages' shards; the index is assembled from the
        shards' small records, so no process holds another stage's tensors. With
        runtime="dist", call it on every rank (replica 0 writes). A Hugging Face model's
        folder loads with ``from_pretrained`` once its config is saved there too."""
        from nobubble.api.weights import index_of, write_index, write_shard

        self._check_drained("save_weights()")
        out = Path(os.fspath(folder))
        records = []
        if self.dp_rank == 0:
            for s in self.local:
                state = self.stages[s].state_dict()
                records.append(write_shard(out, s, self.num_stages, state))
        if self.mesh is not None:
            records = _dist().gather_records(records, self.mesh.pp_group)
        if self.dp_rank == 0 and self.rank in (None, 0):
            write_index(out, index_of(sorted(records, key=lambda r: r["stage"])))
        if self.mesh is not None:
            _dist().gather_records([], self.mesh.pp_group)  # the index exists on return
        return out

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue: weights, optimizer and correction state per stage."""
        self._check_drained("state_dict()")
        return {
            "format": FORMAT,
            "schedule": self.schedule_name,
            "num_stages": self.num_stages,
            "microbatches": self.microbatches,
            "step": self.step_count,
            "stages": self.stage_parts(),
        }

    def stage_parts(self) -> list[dict[str, Any]]:
        """Each local stage's part of a checkpoint (``nobubble train``'s on-disk format, which
        the multi-process runtime reads and writes too); with runtime="dist", this rank's."""
        self._check_drained("a checkpoint")
        return [w.state_dict() for w in self.workers]

    def load_stage_parts(self, step: int, parts: Sequence[Mapping[str, Any]]) -> None:
        """Continue from the parts of a checkpoint written at step ``step`` (a drain point):
        the schedule goes on from there with a drain point at ``step``."""
        self._check_drained("loading a checkpoint")
        if self.fed:
            raise RuntimeError("load a checkpoint into a new pipeline, before any step()")
        for worker, part in zip(self.workers, parts, strict=True):
            if part["stage"] != worker.stage:
                raise ValueError(
                    f"checkpoint part of stage {part['stage']} given to stage {worker.stage}"
                )
        self.drains = [step] if step else []
        self.fed = self.step_count = step
        self._reported = step * self.microbatches
        self.schedule, self.ledger = self._generate(step + FIRST_HORIZON)
        for worker, part in zip(self.workers, parts, strict=True):
            worker.use_schedule(self.schedule, self.ledger.stages[worker.stage], fresh=True)
            worker.load_state_dict(dict(part))
        self.emulator = self._runner(step)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._check_drained("load_state_dict()")
        if state.get("format") != FORMAT:
            raise ValueError(
                f"not a nobubble pipeline state (format {state.get('format')!r}, expected "
                f"{FORMAT!r}): load the dict that Pipeline.state_dict() returned"
            )
        if state["num_stages"] != self.num_stages:
            raise ValueError(
                f"the state holds {state['num_stages']} stages, this pipeline has "
                f"{self.num_stages}: split the model the same way it was saved"
            )
        for worker, part in zip(self.workers, state["stages"], strict=True):
            ours = {n: tuple(p.shape) for n, p in worker.named}
            theirs = {n: tuple(t.shape) for n, t in part["module"].items() if n in ours}
            if ours != theirs:
                differ = sorted(n for n in ours if ours[n] != theirs.get(n))
                raise ValueError(
                    f"stage {worker.stage}'s parameters {differ[:3]} are missing from the state "
                    "or have other shapes: split the same model at the same points"
                )
        self.load_stage_parts(state["step"], state["stages"])


def _target_device(device: str | torch.device | None, runtime: str) -> torch.device | None:
    """Where stages on meta get their tensors: ``device``, or under runtime="dist" the GPU of
    LOCAL_RANK when CUDA is available (None: decide from the stages)."""
    if device is not None:
        try:
            return torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(
                f"device={device!r} is not a torch device: use 'cpu' or 'cuda:0'"
            ) from None
    if runtime == "dist" and torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return None


def _dist() -> Any:
    """The multi-process runner (layer 2), imported only when asked for."""
    from nobubble.runtime.distributed import runner

    return runner


def _fsdp() -> Any:
    """Sharding within a stage (layer 2), imported only with shard="fsdp"."""
    from nobubble.runtime.distributed import fsdp

    return fsdp


def _check_backend(backend: Any, runtime: str) -> None:
    if backend is None:
        return
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r} is unknown: use 'nccl', 'gloo' or None")
    if runtime != "dist":
        raise ValueError(
            f"backend={backend!r} applies to runtime='dist'; the emulator runs every stage in "
            "this process: leave backend=None"
        )


def _check_data_parallel(
    data_parallel: Any, bucket_mb: Any, runtime: str, num_ranks: int, num_stages: int
) -> tuple[int, float]:
    if isinstance(data_parallel, bool) or not isinstance(data_parallel, int) or data_parallel < 1:
        raise ValueError(
            f"data_parallel={data_parallel!r} is not allowed: use the number of pipeline "
            "replicas, an integer >= 1"
        )
    if data_parallel > 1 and runtime != "dist":
        raise ValueError(
            f"data_parallel={data_parallel} needs runtime='dist' (one process per stage and "
            "replica); the emulator runs one replica: give it micro-batches data_parallel "
            "times larger for the same numbers"
        )
    if data_parallel > 1 and num_ranks != num_stages:
        raise ValueError(
            "data_parallel > 1 runs one stage per rank: use a schedule without virtual stages"
        )
    if not (isinstance(bucket_mb, int | float) and math.isfinite(bucket_mb) and bucket_mb > 0):
        raise ValueError(f"bucket_mb={bucket_mb!r}: use a bucket size in MB > 0")
    return data_parallel, float(bucket_mb)


def _shard_tree(value: Tree, m: int, d: int, r: int) -> Tree:
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
        return {k: _shard_tree(v, m, d, r) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return type(value)(_shard_tree(v, m, d, r) for v in value)
    raise TypeError(
        f"a batch is a tensor, or a tuple or dict of tensors, not {type(value).__name__}"
    )


def _num_ranks(schedule: str, num_stages: int, virtual: int) -> int:
    """P, the ranks ``num_stages`` stage modules make under ``schedule`` (v stages per rank)."""
    if num_stages % virtual == 0:
        return num_stages // virtual
    fit = ", ".join(str(virtual * p) for p in range(1, 4))
    what = "virtual_stages" if schedule == "interleaved-1f1b" else "stages per rank"
    raise ValueError(
        f"schedule={schedule!r} places {virtual} stages on each rank ({what}={virtual}), so it "
        f"needs a multiple of {virtual} stage modules, got {num_stages}: split the model into "
        f"{fit}, ... stages"
        + (", or set virtual_stages to a divisor of it" if schedule == "interleaved-1f1b" else "")
    )


def _find_ties(stages: list[nn.Module]) -> list[Tie]:
    """The (stage a, name a, stage b, name b) pairs, a < b, that stages declare tied in a
    ``tied_parameters`` dict (own name -> the other copy's name); both must start equal."""
    owner = {n: (s, p) for s, m in enumerate(stages) for n, p in m.named_parameters()}
    ties = []
    for s, module in enumerate(stages):
        for name, other in getattr(module, "tied_parameters", {}).items():
            if other not in owner or name not in owner or owner[name][0] != s:
                raise ValueError(
                    f"stage {s} declares {name!r} tied to {other!r}, but "
                    + (
                        f"no stage holds {other!r}"
                        if other not in owner
                        else f"it holds no {name!r}"
                    )
                )
            t, p = owner[other]
            both = not (p.is_meta or owner[name][1].is_meta)  # a process holds both copies
            if both and not torch.equal(p, owner[name][1]):
                raise ValueError(f"tied parameters {name!r} and {other!r} start unequal")
            a, b = sorted([(s, name), (t, other)])
            ties.append((a[0], a[1], b[0], b[1]))
    return sorted(ties)


def _scaled(
    lr: float | Callable[[int], float], factor: Callable[[int], float] | None
) -> Callable[[int], float]:
    base = lr if callable(lr) else (lambda step: lr)
    if factor is None:
        return base
    return lambda step: base(step) * factor(step)


def _adamw_matrices(module: nn.Module) -> set[str]:
    """Names of the 2-D tensors Muon must not take: embedding tables and output heads."""
    names: set[str] = set()
    for prefix, sub in module.named_modules():
        if isinstance(sub, nn.Embedding):
            names.update(f"{prefix}.{n}" if prefix else n for n, _ in sub.named_parameters())
    for name, _ in module.named_parameters():
        parts = name.split(".")
        if any(p in ("lm_head", "head", "output", "wte", "wpe", "embed_tokens") for p in parts):
            names.add(name)
    return names


def _split_tree(value: Tree, m: int, label: str) -> list[Tree]:
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 or value.shape[0] % m:
            size = "a scalar" if value.dim() == 0 else f"batch dimension {value.shape[0]}"
            raise ValueError(
                f"{label} has {size}, which does not split into the pipeline's {m} micro-batches: "
                f"pass a batch whose dim 0 is a multiple of {m}"
            )
        return list(value.chunk(m)) if m > 1 else [value]
    if isinstance(value, dict):
        split = {k: _split_tree(v, m, f"{label}[{k!r}]") for k, v in value.items()}
        return [{k: v[i] for k, v in split.items()} for i in range(m)]
    if isinstance(value, tuple | list):
        split_l = [_split_tree(v, m, f"{label}[{j}]") for j, v in enumerate(value)]
        return [type(value)(v[i] for v in split_l) for i in range(m)]
    raise TypeError(
        f"{label} is a {type(value).__name__}: pass a tensor, or a tuple or dict of tensors"
    )


__all__ = ["MicrobatchLoss", "Pipeline", "StepResult"]
