"""``PipelineConfig``: one frozen configuration of a pipeline, composed of specs, each checked on
construction and once more against the others.

A spec is a frozen, keyword-only dataclass owned by its component: ``ScheduleSpec`` (the
schedule registry, core/schedule_spec.py), ``CorrectionSpec`` (the correction registry,
optim/correction_registry.py), and here ``OptimizerSpec``, ``RuntimeSpec``, ``ComputeSpec`` and
``InitSpec``. A field's name is the concept's one name everywhere: the ``Pipeline`` keyword, the
``nobubble train`` flag (``--ef-lambda`` is ``ef_lambda``) and the config file's key.
``PipelineConfig.build(**keywords)`` routes each keyword to the spec that owns the field.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from torch import nn

from nobubble.core.ir import Schedule
from nobubble.core.schedule_spec import ScheduleSpec, check_one_schedule
from nobubble.core.schedules import ScheduleInfo
from nobubble.engine.blocks import CHECKPOINTING
from nobubble.engine.grad_fusion import check_fusable
from nobubble.engine.worker import WorkerOptions
from nobubble.optim import CorrectionSpec, OptimConfig, optimizer_entry

LossFn = Callable[[Any, Any], torch.Tensor]
OptimizerFactory = Callable[[list[tuple[str, nn.Parameter]]], torch.optim.Optimizer]
RUNTIMES = ("emulate", "dist")
DTYPES = {"fp32": None, "bf16": torch.bfloat16}
CLIP_SCOPES = ("auto", "global", "stage")
SHARDS = ("none", "fsdp")  # within a stage: replicated, or FSDP2 over its dp group


@dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    """How each stage updates its weights.

    optimizer: a registered name (``nobubble.optim.OPTIMIZER_ENTRIES``) or a callable that
        receives one stage's ``named_parameters()`` list and returns a ``torch.optim.Optimizer``.
    lr: a named optimizer's learning rate, or ``lr(step)`` giving it at each step 0, 1, ...
    optimizer_options: the rest of ``nobubble.optim.OptimConfig`` (weight_decay, betas, ...).
    lr_schedule: ``factor(step)`` multiplying the learning rate; None keeps it constant.
    clip: the largest gradient norm; None or 0: no clipping. clip_scope: "global" (the whole
        model's norm), "stage" (each stage's own), or "auto" (global for the synchronous
        schedules, per stage for the asynchronous ones, whose stages do not step together).
    """

    optimizer: str | OptimizerFactory = field(
        default="adamw", metadata={"help": "each stage's optimizer"}
    )
    lr: float | Callable[[int], float] = 1e-3
    optimizer_options: Mapping[str, Any] | None = None
    lr_schedule: Callable[[int], float] | None = None
    clip: float | None = field(default=None, metadata={"help": "gradient-norm clip, 0 disables"})
    clip_scope: str = field(
        default="auto",
        metadata={"help": "auto (global for sync, per stage for async) | stage | global"},
    )

    def __post_init__(self) -> None:
        clip = self.clip
        if clip is not None and not (
            isinstance(clip, int | float) and math.isfinite(clip) and clip >= 0
        ):
            raise ValueError(f"clip={clip!r} is not allowed: use a finite number > 0, or None")
        if self.clip_scope not in CLIP_SCOPES:
            raise ValueError(
                f"clip_scope={self.clip_scope!r} is unknown: use 'auto', 'global' or 'stage'"
            )
        if self.lr_schedule is not None and not callable(self.lr_schedule):
            raise TypeError(
                f"lr_schedule must be callable(step) -> factor, got {self.lr_schedule!r}"
            )
        if not callable(self.optimizer):
            self.optim_config()  # a named optimizer's options, checked now

    @property
    def clip_norm(self) -> float | None:
        return self.clip or None  # 0 and None: no clipping

    def optim_config(self) -> OptimConfig:
        """A named optimizer's ``OptimConfig`` at the first step's learning rate."""
        assert isinstance(self.optimizer, str), "a callable optimizer has no OptimConfig"
        first_lr = self.lr(0) if callable(self.lr) else self.lr
        options = dict(self.optimizer_options or {})
        return OptimConfig(
            name=self.optimizer, lr=first_lr, clip_norm=self.clip_norm, warmup_frac=0.0, **options
        )

    def global_clip(self, info: ScheduleInfo) -> bool:
        """Whether the stages clip by the whole model's norm (they meet before each step)."""
        if self.clip_scope == "global" and not info.synchronous:
            raise ValueError(
                f"clip_scope='global' would make the stages of the asynchronous {info.name} meet "
                "before every step, which its order does not allow: use clip_scope='stage' (each "
                "stage clips its own norm) or 'auto'"
            )
        scope = self.clip_scope
        if scope == "auto":  # the whole model's norm where the stages step together
            scope = "global" if info.synchronous else "stage"
        return self.clip_norm is not None and scope == "global"


@dataclass(frozen=True, kw_only=True)
class RuntimeSpec:
    """Where the stages run.

    runtime: "emulate" (every stage in this process) or "dist" (rank r's stages in process r).
    dist_timeout: seconds a "dist" rank waits for a peer before it names the one it waits for.
    backend: with runtime="dist", "nccl" or "gloo" (None: NCCL for stages on a GPU, else gloo).
    data_parallel: D replicas of the pipeline (runtime="dist"), their gradients averaged in
        ``bucket_mb`` MB buckets. shard: "none" (replicated stages) or "fsdp" (each stage sharded
        across its D replicas with FSDP2; data_parallel >= 2).
    """

    runtime: str = field(
        default="emulate",
        metadata={"help": "emulate (one process) | dist (one process per stage and replica)"},
    )
    dist_timeout: float = field(
        default=600.0, metadata={"help": "seconds to wait for a peer rank before failing"}
    )
    backend: str | None = None
    data_parallel: int = field(
        default=1, metadata={"help": "D pipeline replicas (dist: stages × D processes)"}
    )
    bucket_mb: float = field(
        default=25.0, metadata={"help": "bucket size (MB) of the data-parallel all-reduce"}
    )
    shard: str = field(
        default="none",
        metadata={
            "help": "none | fsdp: shard each stage's parameters, gradients and optimizer state "
            "across its data-parallel replicas (FSDP2)"
        },
    )

    def __post_init__(self) -> None:
        if self.runtime not in RUNTIMES:
            raise ValueError(
                f"runtime={self.runtime!r} is unknown: use 'emulate' (every stage in this "
                "process) or 'dist' (one process per stage, e.g. under torchrun)"
            )
        timeout = self.dist_timeout
        if isinstance(timeout, bool) or not (isinstance(timeout, int | float) and timeout > 0):
            raise ValueError(f"dist_timeout={timeout!r}: use a number of seconds > 0")
        self._check_backend()
        self._check_data_parallel()
        if self.shard not in SHARDS:
            raise ValueError(f"shard={self.shard!r} is unknown: use 'none' or 'fsdp'")
        if self.shard == "fsdp" and self.data_parallel < 2:
            raise ValueError(
                "shard='fsdp' shards each stage across its data-parallel replicas, but "
                f"data_parallel={self.data_parallel}: use data_parallel >= 2 (runtime='dist', "
                "P·D processes), or shard='none'"
            )

    def _check_backend(self) -> None:
        if self.backend is None:
            return
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend={self.backend!r} is unknown: use 'nccl', 'gloo' or None")
        if self.runtime != "dist":
            raise ValueError(
                f"backend={self.backend!r} applies to runtime='dist'; the emulator runs every "
                "stage in this process: leave backend=None"
            )

    def _check_data_parallel(self) -> None:
        d = self.data_parallel
        if isinstance(d, bool) or not isinstance(d, int) or d < 1:
            raise ValueError(
                f"data_parallel={d!r} is not allowed: use the number of pipeline replicas, an "
                "integer >= 1"
            )
        if d > 1 and self.runtime != "dist":
            raise ValueError(
                f"data_parallel={d} needs runtime='dist' (one process per stage and replica); "
                "the emulator runs one replica: give it micro-batches data_parallel times "
                "larger for the same numbers"
            )
        mb = self.bucket_mb
        finite = isinstance(mb, int | float) and not isinstance(mb, bool) and math.isfinite(mb)
        if not (finite and mb > 0):
            raise ValueError(f"bucket_mb={mb!r}: use a bucket size in MB > 0")


@dataclass(frozen=True, kw_only=True)
class ComputeSpec:
    """How a stage computes: dtype "fp32" or "bf16" (autocast, fp32 master weights);
    paci_recompute (paci only): keep the stage input and recompute the forward at backward;
    fused_grad_accumulation: Linear and Embedding layers add their weight gradient into
    ``.grad`` inside the backward (not with a split backward or data_parallel >= 2);
    activation_checkpointing: "none", "full" (every block keeps only its input and rebuilds its
    activations at backward, reading the weights its forward read) or "selective" (every
    ``selective_every``-th block, from the first); compile: torch.compile each block
    (regional). Blocks: ``nobubble.model.blocks.stage_blocks``."""

    dtype: str = field(
        default="fp32", metadata={"help": "fp32 | bf16 (autocast, fp32 master weights)"}
    )
    paci_recompute: bool = field(
        default=False,
        metadata={"help": "paci: recompute the stage forward at backward instead of keeping it"},
    )
    fused_grad_accumulation: bool = field(
        default=False,
        metadata={
            "help": "true: Linear and Embedding layers add their weight gradient into .grad "
            "inside the backward (no fresh gradient per micro-batch); last-bit different results"
        },
    )

    activation_checkpointing: str = field(
        default="none",
        metadata={
            "help": "none | full (recompute every block at backward) | selective (every "
            "selective_every-th block)"
        },
    )
    selective_every: int = field(
        default=2, metadata={"help": "selective checkpointing: every k-th block, from the first"}
    )
    compile: bool = field(
        default=False, metadata={"help": "torch.compile each block of each stage (regional)"}
    )

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is unknown: use one of {tuple(DTYPES)}")
        if self.activation_checkpointing not in CHECKPOINTING:
            raise ValueError(
                f"activation_checkpointing={self.activation_checkpointing!r} is unknown: use "
                "one of " + ", ".join(repr(c) for c in CHECKPOINTING)
            )
        k = self.selective_every
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(
                f"selective_every={k!r}: use an integer >= 1 (selective checkpointing "
                "recomputes every k-th block of a stage)"
            )
        for name in ("paci_recompute", "fused_grad_accumulation", "compile"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")

    def check(self, info: ScheduleInfo, data_parallel: int, shard: str = "none") -> None:
        if self.paci_recompute and info.name != "paci":
            raise ValueError(f"paci_recompute=True applies to paci only, not {info.name}")
        if self.fused_grad_accumulation:
            check_fusable(info.name, info.split_backward, data_parallel)
        checkpointed = self.activation_checkpointing != "none"
        if checkpointed and info.name == "paci" and not self.paci_recompute and shard == "fsdp":
            raise ValueError(
                f"activation_checkpointing={self.activation_checkpointing!r} with "
                "schedule='paci' and shard='fsdp': paci's steps update the weights a forward "
                "read in place before its backward, so a rebuilt block needs a copy of the "
                "values its forward read, which a sharded stage does not hold between actions "
                "(only its shards); use shard='none', paci_recompute=True (the whole stage "
                "rebuilt at backward, on the live weights) or activation_checkpointing='none'"
            )
        if self.compile and info.split_backward:
            raise ValueError(
                f"compile=True with schedule={info.name!r}: its split backward runs autograd "
                "twice over one graph (input gradients, then weight gradients, retain_graph), "
                "which a compiled block's backward refuses; use a schedule without a split "
                "backward (1f1b, paci, ...) or compile=False"
            )


@dataclass(frozen=True, kw_only=True)
class InitSpec:
    """Values for stages built on the meta device (``nobubble.materialize``): ``seed`` (the
    values the model's own init gives after ``torch.manual_seed(seed)``), ``init(model)``, or
    ``weights`` (a safetensors file or folder), on ``device`` (default: LOCAL_RANK's GPU under
    runtime="dist" when CUDA is available, else the CPU)."""

    seed: int | None = None
    init: Callable[[nn.Module], Any] | None = None
    weights: str | os.PathLike[str] | None = None
    device: str | torch.device | None = None

    @property
    def given(self) -> list[str]:
        """The ways of giving values that were given."""
        return [k for k in ("seed", "init", "weights") if getattr(self, k) is not None]


# a former keyword -> the one name it now has (accepted, so that old code keeps running)
ALIASES = {"recompute": "paci_recompute", "timeout": "dist_timeout"}


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """Everything a ``Pipeline`` is built with but its stages and loss, checked once.

    steps: the total number of steps, when known (the schedule ends there); None: open-ended.
    """

    schedule: ScheduleSpec = field(default_factory=ScheduleSpec)
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    correction: CorrectionSpec = field(default_factory=CorrectionSpec)
    runtime: RuntimeSpec = field(default_factory=RuntimeSpec)
    compute: ComputeSpec = field(default_factory=ComputeSpec)
    init: InitSpec = field(default_factory=InitSpec)
    steps: int | None = None

    def __post_init__(self) -> None:
        steps = self.steps
        if steps is not None and (
            isinstance(steps, bool) or not isinstance(steps, int) or steps < 1
        ):
            raise ValueError(f"steps={steps!r}: use the total number of steps (>= 1), or None")
        info = self.schedule.info
        shard = self.runtime.shard
        self.correction.check(info.name, info.synchronous, shard)
        # the correction's defaults (0) become their share of the steps, once, here
        object.__setattr__(self, "correction", self.correction.resolved(steps))
        self.optimizer.global_clip(info)
        self.compute.check(info, self.runtime.data_parallel, shard)
        if isinstance(self.optimizer.optimizer, str):
            optimizer_entry(self.optimizer.optimizer).check_shard(shard)
        if self.runtime.data_parallel > 1 and self.schedule.stages_per_rank > 1:
            raise ValueError(
                f"data_parallel={self.runtime.data_parallel} with schedule="
                f"{info.name!r} ({self.schedule.stages_per_rank} stages per rank): data "
                "parallelism runs one stage per rank; use a schedule without virtual stages"
            )

    @property
    def global_clip(self) -> bool:
        return self.optimizer.global_clip(self.schedule.info)

    def generate(self, num_ranks: int, num_steps: int, **options: Any) -> Schedule:
        """The run's schedule over ``num_steps`` steps (``options``: ``ScheduleSpec.generate``'s),
        its first steps flushed under sync-warmup: a correction of the schedule, not the step."""
        warmup = min(self.correction.sync_warmup, num_steps)
        return self.schedule.generate(num_ranks, num_steps, sync_warmup=warmup, **options)

    def worker_options(self) -> WorkerOptions:
        """One stage worker's step settings, made afresh per stage: its correction keeps the
        stage's own state (error feedback's last displacement)."""
        return WorkerOptions(
            correction=self.correction.build(),
            clip_norm=self.optimizer.clip_norm,
            autocast_dtype=DTYPES[self.compute.dtype],
            recompute=self.compute.paci_recompute,
        )

    @staticmethod
    def keywords() -> dict[str, str]:
        """Every keyword ``build`` takes -> the spec that owns it ("" for ``steps``)."""
        owners = {"steps": ""}
        for part in fields(PipelineConfig):
            if part.name != "steps":
                owners.update({f.name: part.name for f in _spec_fields(part.name)})
        return owners

    @staticmethod
    def build(base: PipelineConfig | None = None, **keywords: Any) -> PipelineConfig:
        """``base`` (default: the defaults) with ``keywords`` set, each on the spec owning it."""
        base = base or PipelineConfig()
        owners = PipelineConfig.keywords()
        check_one_schedule(keywords)
        parts: dict[str, dict[str, Any]] = {}
        for given, value in keywords.items():
            name = ALIASES.get(given, given)
            if name not in owners:
                raise TypeError(
                    f"Pipeline got an unknown keyword {given!r}; valid keywords: "
                    + ", ".join(sorted(owners))
                )
            parts.setdefault(owners[name], {})[name] = value
        steps = parts.pop("", {}).get("steps", base.steps)
        specs = {part: replace(getattr(base, part), **values) for part, values in parts.items()}
        return replace(base, steps=steps, **specs)


def _spec_fields(part: str) -> list[Any]:
    spec: Any = {f.name: f for f in fields(PipelineConfig)}[part].default_factory
    return [f for f in fields(spec) if f.init]


__all__ = [
    "ALIASES",
    "ComputeSpec",
    "InitSpec",
    "OptimizerSpec",
    "PipelineConfig",
    "RuntimeSpec",
]
