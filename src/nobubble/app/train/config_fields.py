"""The fields of a training run (``TrainFields``, the base of ``TrainConfig``, whose docstring
documents them), what follows from the fields alone (the pipeline's configuration, the optimizer
and data configs, micro-batches, tokens per step, stages, vocabulary), and the checks of one
field.

A field that configures the pipeline has the name of the spec field it fills
(``nobubble.api.config``): ``pipeline_config`` copies them by name, and the specs check them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from functools import partial
from pathlib import Path
from typing import Any

from nobubble.api.config import ComputeSpec, OptimizerSpec, PipelineConfig, RuntimeSpec
from nobubble.core.schedules import ScheduleSpec
from nobubble.data import DataConfig
from nobubble.optim import CorrectionSpec, OptimConfig, lr_at

GPT2_VOCAB_SIZE = 50257  # --tokenizer gpt2 fixes the vocabulary, whatever --vocab-size says


@dataclass(frozen=True)
class TrainFields:
    """One field per ``nobubble train`` flag (``TrainConfig`` checks and documents them)."""

    schedule: str = "paci"
    optimizer: str = "adamw"
    correction: str = "none"
    ef_lambda: float = 1.0
    delay_lr_steps: int = 0
    sync_warmup: int = 0
    stages: int = 2
    virtual_stages: int | None = None
    microbatches: int = 4
    accum: int | None = None
    micro_batch_size: int = 8
    steps: int = 300
    lr: float = 3e-3
    weight_decay: float = 0.1
    warmup_frac: float = 0.1
    min_lr_ratio: float = 0.1
    momentum: float = 0.95
    clip: float = 1.0
    clip_scope: str = "auto"
    seed: int = 0
    data: str = "shakespeare"
    tokenizer: str = "bpe"
    text_column: str = "text"
    vocab_size: int = 4096
    seq_len: int = 128
    model: str = "tiny"
    dtype: str = "fp32"
    paci_recompute: bool = False
    fused_adamw: bool = False
    fused_grad_accumulation: bool = False
    activation_checkpointing: str = "none"
    selective_every: int = 2
    compile: bool = False
    eval_every: int = 50
    eval_batches: int = 8
    checkpoint_every: int = 0
    sample_tokens: int = 200
    runtime: str = "emulate"
    dist_timeout: float = 50.0
    out: str | None = None
    resume: str | None = None
    progress: bool = True
    threads: int = 0
    stop_at: int = 0
    master_port: int = 0
    device: str = "auto"
    backend: str = "auto"
    strict_p2p: bool = False
    untie_embeddings: bool = False
    data_parallel: int = 1
    bucket_mb: float = 25.0
    shard: str = "none"

    @property
    def is_hf(self) -> bool:
        return self.model.startswith("hf:")

    def hf_config(self) -> dict[str, Any]:
        from nobubble.model.hf import read_config

        return read_config(self.model.removeprefix("hf:"))

    # ----- derived ---------------------------------------------------------------------------
    @property
    def model_vocab_size(self) -> int:
        """The model's vocabulary as far as the flags tell (a trained BPE may hold fewer)."""
        return GPT2_VOCAB_SIZE if self.tokenizer == "gpt2" else self.vocab_size

    @property
    def stages_per_machine(self) -> int:
        """All stages share the emulator's process and the launcher's machine; under torchrun
        LOCAL_WORLD_SIZE ranks do."""
        local = os.environ.get("LOCAL_WORLD_SIZE", "")
        if self.runtime == "dist" and local.isdigit():
            return max(1, min(int(local), self.stages))
        return self.stages

    def _spec(self, kind: type) -> Any:
        """The spec ``kind`` from the fields of the same names."""
        return kind(**{f.name: getattr(self, f.name) for f in fields(kind) if f.init})

    @property
    def schedule_spec(self) -> ScheduleSpec:
        return self._spec(ScheduleSpec)

    def pipeline_config(self) -> PipelineConfig:
        """The pipeline's configuration, checked (each spec, then against each other): the
        recipe's learning rate (warm-up, cosine) by step, the optimizer's options."""
        optim = self.optim_config()
        optimizer = OptimizerSpec(
            optimizer=self.optimizer,
            lr=partial(lr_at, total_steps=self.steps, cfg=optim),
            optimizer_options={
                "weight_decay": self.weight_decay,
                "momentum": self.momentum,
                "fused_adamw": self.fused_adamw,
            },
            clip=self.clip,
            clip_scope=self.clip_scope,
        )
        runtime = {
            f.name: getattr(self, f.name) for f in fields(RuntimeSpec) if f.name != "backend"
        }
        return PipelineConfig(
            schedule=self.schedule_spec,
            optimizer=optimizer,
            correction=self._spec(CorrectionSpec),
            # the backend is the launcher's (app/ranks): the pipeline uses the group it started
            runtime=RuntimeSpec(**runtime),
            compute=self._spec(ComputeSpec),
            steps=self.steps,
        )

    @property
    def model_stages(self) -> int:
        """The stages the model is cut into: v·P, or P with one stage per rank."""
        return self.stages * self.schedule_spec.stages_per_rank

    @property
    def num_microbatches(self) -> int:
        """M per optimizer step as the schedule reads it (``a`` for pipedream and paci)."""
        return self.schedule_spec.num_microbatches

    @property
    def delay_lr_span(self) -> int | None:
        """The steps over which --correction delay-lr's damping fades (0: a quarter of --steps)."""
        if self.correction != "delay-lr":
            return None
        return self.pipeline_config().correction.delay_lr_steps

    @property
    def sync_warmup_steps(self) -> int:
        return self.pipeline_config().correction.sync_warmup

    @property
    def global_clip(self) -> bool:
        return self.pipeline_config().global_clip

    @property
    def global_micro_batch_size(self) -> int:
        """Sequences per micro-batch over all replicas: what a run at D=1 would read."""
        return self.micro_batch_size * self.data_parallel

    @property
    def tokens_per_step(self) -> int:
        return self.num_microbatches * self.global_micro_batch_size * self.seq_len

    def optim_config(self) -> OptimConfig:
        return OptimConfig(
            name=self.optimizer,
            lr=self.lr,
            weight_decay=self.weight_decay,
            momentum=self.momentum,
            warmup_frac=self.warmup_frac,
            min_lr_ratio=self.min_lr_ratio,
            clip_norm=self.clip if self.clip > 0 else None,
            fused_adamw=self.fused_adamw,
        )

    def data_config(self) -> DataConfig:
        """The data's config; with ``--model hf:PATH`` whose folder holds a tokenizer.json and
        the default tokenizer (or ``--tokenizer hf``), the model's own tokenizer and
        vocabulary."""
        if self.data != "shakespeare" and not Path(self.data).exists():
            raise ValueError(
                f"--data {self.data!r} does not exist: give a text file, a folder of .txt files, "
                "parquet, jsonl or arrow files (or a folder of them, such as a datasets save), "
                ".bin shards, or 'shakespeare'"
            )
        tokenizer, path, vocab = self.tokenizer, None, self.vocab_size
        if self.tokenizer in ("bpe", "hf") and self.is_hf:
            folder = Path(self.model.removeprefix("hf:")).expanduser()
            folder = folder.parent if folder.is_file() else folder
            if self.tokenizer == "hf" or (folder / "tokenizer.json").is_file():
                tokenizer, path = "hf", str(folder)
                from nobubble.model.hf import config_vocab

                vocab = config_vocab(self.hf_config())
        elif self.tokenizer == "hf":
            raise ValueError(
                f"--tokenizer hf reads the tokenizer.json of --model hf:PATH, but --model is "
                f"{self.model!r}: give a Hugging Face model folder, or --tokenizer bpe or gpt2"
            )
        return DataConfig(
            source=self.data,
            tokenizer=tokenizer,
            vocab_size=vocab,
            seq_len=self.seq_len,
            seed=self.seed,
            tokenizer_path=path,
            text_column=self.text_column,
        )


def check_port(port: object) -> None:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(
            f"--master-port {port!r} is not a TCP port: use 1..65535, or 0 to let nobubble "
            "pick a free one"
        )


def check_choice(flag: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"--{flag} {value!r} is not known; valid values: {', '.join(allowed)}")


def check_positive(name: str, value: object, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        flag = name.replace("_", "-")
        raise ValueError(f"--{flag} must be an integer >= {minimum}, got {value!r}")


__all__ = [
    "GPT2_VOCAB_SIZE",
    "TrainFields",
    "check_choice",
    "check_port",
    "check_positive",
]
