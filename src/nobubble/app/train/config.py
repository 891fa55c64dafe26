"""``TrainConfig``: everything a training run needs, validated on construction.

Flat on purpose: one field per command-line flag (``--ef-lambda`` is ``ef_lambda``), so a config
file (JSON or TOML with the same keys), the flags and a checkpoint's fingerprint are the same
thing. A field that configures the pipeline has the name of its spec field
(``nobubble.api.config``): ``pipeline_config()`` builds the specs from those fields and they
check them, with the same texts as ``Pipeline``'s. The other component configs (``OptimConfig``,
``DataConfig``, the model preset) are derived too; what only a run has (drain and checkpoint
points, model depth, memory) is checked here, all before any work starts.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import tomllib

from nobubble.app.train.config_fields import (
    TrainFields,
    check_choice,
    check_port,
    check_positive,
)
from nobubble.core.util import physical_memory_bytes
from nobubble.model import MODEL_PRESETS, model_config
from nobubble.model.hf import check_installed, config_layers
from nobubble.model.memory import FP32, StageLoad, machine_bytes, stage_bytes, stage_loads

# Share of the machine's memory a run may plan to fill; the rest is for the OS, other programs and
# what the estimate leaves out (the allocator's slack, transient copies while the model is built).
MEMORY_SHARE = 0.8
# One Python process with torch imported and the tokens loaded: 0.2 GiB right after `import
# torch`; the estimate plus this matched the peak RSS of short runs of tiny, small and medium.
PROCESS_BYTES = 2**29
DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("auto", "gloo", "nccl")
# Fields that change the numbers of a run; a checkpoint only resumes a run that agrees on them.
RUNTIME_ONLY = (
    "out",
    "resume",
    "runtime",
    "progress",
    "sample_tokens",
    "dist_timeout",
    "threads",
    "stop_at",
    "master_port",
    "device",
    "backend",
    "strict_p2p",
    "data_parallel",  # the fingerprint holds the global micro-batch instead (resume at any D)
    "bucket_mb",
    "shard",  # a sharded stage's checkpoint is gathered: the replicated format
)


@dataclass(frozen=True)
class TrainConfig(TrainFields):
    """One training run. Every field is a ``nobubble train`` flag of the same name.

    The pipeline's options are the fields of its specs, documented there (nobubble.api.config:
    ``ScheduleSpec`` schedule, microbatches, accum, virtual_stages; ``CorrectionSpec``
    correction, ef_lambda, delay_lr_steps, sync_warmup; optimizer, clip, clip_scope;
    ``RuntimeSpec`` runtime, dist_timeout, data_parallel, bucket_mb, shard; ``ComputeSpec``
    dtype, paci_recompute, fused_grad_accumulation, activation_checkpointing, selective_every,
    compile). What only a run has:

    stages: pipeline ranks P (the stages too, but for interleaved-1f1b, v·P, and zbv, 2P).
    micro_batch_size: sequences per micro-batch, per replica: the run reads global micro-batches
        of data_parallel·micro_batch_size sequences, replica r the r-th slice of each.
    steps: optimizer steps. lr: peak learning rate (linear warm-up over warmup_frac of the
        steps, cosine to min_lr_ratio of it); weight_decay, momentum, fused_adamw: the
        optimizer's (``OptimConfig``). clip: 0 disables.
    eval_every: validation every K steps; asynchronous schedules drain there.
    checkpoint_every: checkpoint every K steps (a multiple of eval_every); 0 = only at the end.
    threads: torch intra-op threads per process (0: torch's default; the multi-process runtime
        defaults to cores / stages, since OpenMP threads that outnumber cores spin and stall).
    stop_at: stop after the checkpoint of this step (a planned interruption; --resume continues).
    dist_timeout: a hung rank is caught that way, and every process is gone within it + 6 s.
    master_port: rendezvous port (0: a free one).
    device: auto (cuda when available, else cpu) | cpu | cuda: where each rank's stage runs.
    backend: auto (nccl on cuda, gloo on cpu) | gloo | nccl (gloo on cuda: ranks share GPUs,
        every transfer through host memory; a debugging mode, docs/runtime.md).
    strict_p2p: run point-to-point under NCCL's completion rules on any backend (one stream per
        rank; a testing aid that makes an order NCCL would deadlock on hang on gloo too).
    model: a preset (tiny, mini, ...) or hf:PATH, a Hugging Face model folder or config.json
        (Llama family or GPT-2; a config alone gets a random init from --seed).
    untie_embeddings: a Hugging Face model with tied embeddings trains its head as a separate
        parameter (needed by asynchronous schedules over several stages).
    """

    def __post_init__(self) -> None:
        check_choice("device", self.device, DEVICES)
        check_choice("backend", self.backend, BACKENDS)
        for name in (
            "stages",
            "micro_batch_size",
            "steps",
            "eval_every",
            "eval_batches",
            "seq_len",
        ):
            check_positive(name, getattr(self, name))
        for name in ("checkpoint_every", "seed", "sample_tokens", "threads", "stop_at"):
            check_positive(name, getattr(self, name), minimum=0)
        check_port(self.master_port)
        # the pipeline's options: each spec checks itself, then against the others (api/config)
        self.pipeline_config()
        self.schedule_spec.check(self.stages)  # the schedule's own preconditions on (P, M, v)
        self._check_model()
        self._check_run()
        self.data_config()
        self._check_memory()

    def _check_model(self) -> None:
        """A preset or a Hugging Face model, with at least one layer per stage."""
        if self.is_hf:
            check_installed()
            n_layers = config_layers(self.hf_config())
        else:
            if self.model.startswith("hf"):
                raise ValueError(f"--model {self.model!r}: write hf:PATH (a folder or config.json)")
            check_choice("model", self.model, tuple(MODEL_PRESETS))
            n_layers = MODEL_PRESETS[self.model].n_layers
            if self.untie_embeddings:
                raise ValueError(
                    "--untie-embeddings applies to Hugging Face models (--model hf:PATH); "
                    f"{self.model} has an untied head already"
                )
        if self.model_stages <= n_layers:
            return
        per_rank = self.model_stages // self.stages
        cut = (
            f" cuts the model into {self.model_stages} stages ({per_rank} per rank under "
            f"{self.schedule}), which"
            if per_rank > 1
            else ""
        )
        raise ValueError(
            f"--stages {self.stages}{cut} is more than the {n_layers} layers of model "
            f"{self.model!r}: use --stages {max(1, n_layers // per_rank)} or fewer, or a "
            "deeper --model"
        )

    def _check_run(self) -> None:
        """What only a training run has: drain points, checkpoints, where the ranks run."""
        if self.checkpoint_every % self.eval_every:
            raise ValueError(
                f"--checkpoint-every {self.checkpoint_every} must be a multiple of "
                f"--eval-every {self.eval_every} (checkpoints need drain points)"
            )
        if self.runtime == "emulate" and (
            self.device == "cuda" or self.backend != "auto" or self.strict_p2p
        ):
            raise ValueError(
                "--device cuda, --backend and --strict-p2p apply to --runtime dist; the "
                "emulator runs every stage in one process on the CPU: use --runtime dist"
            )
        every = self.checkpoint_every
        if self.stop_at and not (self.stop_at < self.steps and every and self.stop_at % every == 0):
            raise ValueError(
                f"--stop-at {self.stop_at} must be a checkpoint step below --steps "
                f"{self.steps} (a multiple of --checkpoint-every)"
            )

    def _check_memory(self) -> None:
        """Refuse a run whose estimated peak memory exceeds MEMORY_SHARE of this machine's."""
        total = physical_memory_bytes()
        if total is None or not self._in_host_memory() or self.is_hf:
            return  # a Hugging Face model's size is not estimated yet
        available = MEMORY_SHARE * total
        need = self.memory_bytes()
        if need <= available:
            return
        seq_len = _largest(lambda t: self.memory_bytes(seq_len=t) <= available, self.seq_len - 1)
        batch = _largest(
            lambda b: self.memory_bytes(micro_batch_size=b) <= available, self.micro_batch_size - 1
        )
        fixes = [f"--seq-len {seq_len} or less"] if seq_len else []
        fixes += [f"--micro-batch-size {batch} or less"] if batch else []
        inflight = max(load.inflight for load in self.stage_loads())
        raise ValueError(
            f"--seq-len {self.seq_len} with --micro-batch-size {self.micro_batch_size} needs "
            f"about {_gib(need)} of memory on this machine (model {self.model}, {self.stages} "
            f"stages, up to {inflight} micro-batches in flight on a stage: saved activations, "
            f"weights, gradients and optimizer state), more than the {_gib(available)} available "
            f"({MEMORY_SHARE:.0%} of {_gib(total)}): use "
            + (", or ".join(fixes) or "a smaller --model (the weights and state alone do not fit)")
        )

    def _in_host_memory(self) -> bool:
        """The emulator and CPU ranks keep everything in this machine's memory. CUDA ranks are
        not checked: asking a GPU for its memory would initialize CUDA in this process."""
        if self.runtime == "emulate" or self.device == "cpu":
            return True
        if self.device == "cuda":
            return False
        import torch

        return not torch.cuda.is_available()

    def stage_loads(self, seq_len: int | None = None) -> list[StageLoad]:
        """Layers, parameters, micro-batches in flight and weight versions of each stage."""
        seq_len = seq_len or self.seq_len
        model = model_config(self.model, self.model_vocab_size, seq_len)
        return stage_loads(
            model,
            self.schedule,
            self.stages,
            self.num_microbatches,
            self.steps,
            seq_len,
            self.model_stages // self.stages,
        )

    def memory_bytes(self, seq_len: int | None = None, micro_batch_size: int | None = None) -> int:
        """Estimated peak bytes of the stages that share one machine (model/memory.py)."""
        seq_len = seq_len or self.seq_len
        batch = micro_batch_size or self.micro_batch_size
        model = model_config(self.model, self.model_vocab_size, seq_len)
        per_stage = [
            stage_bytes(model, load, batch, seq_len, self.dtype, self.paci_recompute)
            for load in self.stage_loads(seq_len)
        ]
        if self.runtime == "emulate":  # one process; evaluation merges the stages into a model
            return sum(per_stage) + PROCESS_BYTES + FP32 * model.num_params()
        machine = self.stages_per_machine
        return machine_bytes(per_stage, machine) + PROCESS_BYTES * machine

    def fingerprint(self) -> dict[str, Any]:
        """The fields that fix the numbers (everything but where and how it runs). The
        micro-batch is the global one: a run resumes at another D with the same global batch."""
        values = {k: v for k, v in asdict(self).items() if k not in RUNTIME_ONLY}
        values["micro_batch_size"] = self.global_micro_batch_size
        return values

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_mapping(values: dict[str, Any], base: TrainConfig | None = None) -> TrainConfig:
        known = {f.name for f in fields(TrainConfig)}
        normalized = {k.replace("-", "_"): v for k, v in values.items()}
        unknown = sorted(set(normalized) - known)
        if unknown:
            raise ValueError(
                f"unknown config keys {unknown}; valid keys: {', '.join(sorted(known))}"
            )
        return replace(base or TrainConfig(), **normalized)

    @staticmethod
    def load(path: str | Path) -> dict[str, Any]:
        """Read a JSON or TOML config file into a mapping of field values."""
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"config file {str(path)!r} does not exist")
        try:
            if path.suffix == ".toml":
                return tomllib.loads(path.read_text())
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, tomllib.TOMLDecodeError) as err:
            raise ValueError(f"config file {str(path)!r} is not valid: {err}") from None
        if not isinstance(data, dict):
            raise ValueError(f"config file {str(path)!r} must hold an object of flag values")
        return data


def _largest(fits: Callable[[int], bool], upper: int) -> int:
    """Largest v in 1..upper with fits(v), by bisection (fits holds up to some v, then not);
    0 if none does."""
    low, high = 0, upper
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.1f} GiB"


__all__ = [
    "BACKENDS",
    "DEVICES",
    "MEMORY_SHARE",
    "PROCESS_BYTES",
    "RUNTIME_ONLY",
    "TrainConfig",
]
