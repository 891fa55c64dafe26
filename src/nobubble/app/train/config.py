"""``TrainConfig``: everything a training run needs, resolved and checked on construction.

It holds the pipeline's specs as they are (``nobubble.api.config``: ``ScheduleSpec``,
``CorrectionSpec``, ``RuntimeSpec``, ``ComputeSpec``) and the run's own sections
(app/train/sections.py: the optimizer's recipe, the run, the data, the model, the launch).
Seen from outside it is flat: a config file (JSON or TOML), the flags and a checkpoint's
fingerprint use one key per section field (``--ef-lambda`` is ``correction.ef_lambda``), the map
``KEYS`` derived from the sections' fields. ``pipeline_config()`` composes the specs into the
pipeline's configuration, which checks them against each other with ``Pipeline``'s texts; what
only a run has (drain and checkpoint points, model depth, memory) is checked here, all before any
work starts.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from functools import cache, partial
from pathlib import Path
from typing import Any

import tomllib

from nobubble.api.config import ComputeSpec, OptimizerSpec, PipelineConfig, RuntimeSpec
from nobubble.app.train.run_memory import check_memory
from nobubble.app.train.sections import (
    GPT2_VOCAB_SIZE,
    DataSpec,
    LaunchSpec,
    ModelSpec,
    RecipeSpec,
    RunSpec,
    check_choice,
    check_port,
    check_positive,
    parse_betas,
)
from nobubble.core.schedule_spec import ScheduleSpec, check_one_schedule
from nobubble.data import DataConfig
from nobubble.model import MODEL_PRESETS
from nobubble.model.hf import check_installed, config_layers, config_vocab
from nobubble.optim import CorrectionSpec, OptimConfig, lr_at

DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("auto", "gloo", "nccl")
# Keys that do not change the numbers of a run; a checkpoint resumes a run that agrees on the rest.
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
    # where a given order was read from; the fingerprint holds its hash (schedule_order)
    "from_torch_csv",
    "from_json",
)
# A former key -> its one name (config files, checkpoints and run keys written before it load).
KEY_ALIASES = {"stages": "num_ranks"}
# Spec fields a run does not take from its keys: the launcher's backend is ``LaunchSpec``'s (the
# pipeline uses the process group the launcher started).
NOT_KEYS = {("runtime", "backend")}


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run: the pipeline's specs and the run's sections. Build one from flat keys
    with ``TrainConfig.of(schedule="zbv", num_ranks=4)`` or ``from_mapping``; ``to_json``
    gives them back. Each section documents its fields."""

    schedule: ScheduleSpec = field(default_factory=lambda: ScheduleSpec(schedule="paci"))
    correction: CorrectionSpec = field(default_factory=CorrectionSpec)
    optimizer: RecipeSpec = field(default_factory=RecipeSpec)
    runtime: RuntimeSpec = field(default_factory=lambda: RuntimeSpec(dist_timeout=50.0))
    compute: ComputeSpec = field(default_factory=ComputeSpec)
    run: RunSpec = field(default_factory=RunSpec)
    data: DataSpec = field(default_factory=DataSpec)
    model: ModelSpec = field(default_factory=ModelSpec)
    launch: LaunchSpec = field(default_factory=LaunchSpec)
    pipeline: PipelineConfig = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_choice("device", self.launch.device, DEVICES)
        check_choice("backend", self.launch.backend, BACKENDS)
        run = self.run
        for name in ("num_ranks", "micro_batch_size", "steps", "eval_every", "eval_batches"):
            check_positive(name, getattr(run, name))
        check_positive("seq_len", self.data.seq_len)
        for name in ("checkpoint_every", "seed", "sample_tokens", "stop_at"):
            check_positive(name, getattr(run, name), minimum=0)
        check_positive("threads", self.launch.threads, minimum=0)
        check_port(self.launch.master_port)
        if not isinstance(self.schedule.schedule, str):  # its config and ranks name a file
            raise TypeError("a run trains a given order from a file: save_json it, give from_json")
        # the pipeline's options: each spec checked itself, now against the others (api/config)
        object.__setattr__(self, "pipeline", self._pipeline_config())
        self.schedule.check(run.num_ranks)  # the schedule's own preconditions on (P, M, v)
        self._check_model()
        self._check_run()
        self.data_config()
        check_memory(self)

    # ----- flat keys ---------------------------------------------------------------------------
    @staticmethod
    def key_map() -> dict[str, tuple[str, str]]:
        """Every flat key -> (section, field), from the sections' fields."""
        return _keys()

    @staticmethod
    def of(**values: Any) -> TrainConfig:
        """The config of flat keys ``values`` (the rest at their defaults)."""
        return TrainConfig.from_mapping(values)

    def to_json(self) -> dict[str, Any]:
        return {key: getattr(getattr(self, s), f) for key, (s, f) in _keys().items()}

    @staticmethod
    def normalized(values: Mapping[str, Any]) -> dict[str, Any]:
        """``values`` under the keys' one names (``--ef-lambda``, ``stages``: former spellings)."""
        out = {}
        for key, value in values.items():
            key = key.replace("-", "_")
            out[KEY_ALIASES.get(key, key)] = value
        return out

    @staticmethod
    def from_mapping(values: Mapping[str, Any], base: TrainConfig | None = None) -> TrainConfig:
        keys = _keys()
        normalized = TrainConfig.normalized(values)
        check_one_schedule(normalized)
        unknown = sorted(set(normalized) - set(keys))
        if unknown:
            raise ValueError(
                f"unknown config keys {unknown}; valid keys: {', '.join(sorted(keys))}"
            )
        base = base or TrainConfig()
        parts: dict[str, dict[str, Any]] = {}
        for key, value in normalized.items():
            section, name = keys[key]
            parts.setdefault(section, {})[name] = value
        sections = {s: replace(getattr(base, s), **given) for s, given in parts.items()}
        return replace(base, **sections)

    def replace(self, **values: Any) -> TrainConfig:
        """This config with flat keys ``values`` changed."""
        return TrainConfig.from_mapping(values, base=self)

    # ----- what follows from the sections --------------------------------------------------------
    def _pipeline_config(self) -> PipelineConfig:
        """The pipeline's configuration, checked (each spec, then against each other): the
        recipe's learning rate (warm-up, cosine) by step, the optimizer's options."""
        recipe, steps = self.optimizer, self.run.steps
        optimizer = OptimizerSpec(
            optimizer=recipe.optimizer,
            lr=partial(lr_at, total_steps=steps, cfg=self.optim_config()),
            optimizer_options={
                "weight_decay": recipe.weight_decay,
                "betas": parse_betas(recipe.betas),
                "momentum": recipe.momentum,
                "fused_adamw": recipe.fused_adamw,
            },
            clip=recipe.clip,
            clip_scope=recipe.clip_scope,
        )
        return PipelineConfig(
            schedule=self.schedule,
            optimizer=optimizer,
            correction=self.correction,
            runtime=self.runtime,
            compute=self.compute,
            steps=steps,
        )

    def pipeline_config(self) -> PipelineConfig:
        return self.pipeline

    @property
    def num_ranks(self) -> int:
        """P, the pipeline's ranks."""
        return self.run.num_ranks

    @property
    def model_stages(self) -> int:
        """The stages the model is cut into: v·P, or P with one stage per rank."""
        return self.run.num_ranks * self.schedule.stages_per_rank

    @property
    def num_microbatches(self) -> int:
        """M per optimizer step as the schedule reads it (``a`` for pipedream and paci)."""
        return self.schedule.num_microbatches

    @property
    def delay_lr_span(self) -> int | None:
        """The steps over which --correction delay-lr's damping fades (0: a quarter of --steps)."""
        if self.correction.correction != "delay-lr":
            return None
        return self.pipeline.correction.delay_lr_steps

    @property
    def sync_warmup_steps(self) -> int:
        return self.pipeline.correction.sync_warmup

    @property
    def global_clip(self) -> bool:
        return self.pipeline.global_clip

    @property
    def global_micro_batch_size(self) -> int:
        """Sequences per micro-batch over all replicas: what a run at D=1 would read."""
        return self.run.micro_batch_size * self.runtime.data_parallel

    @property
    def tokens_per_step(self) -> int:
        return self.num_microbatches * self.global_micro_batch_size * self.data.seq_len

    @property
    def model_vocab_size(self) -> int:
        """The model's vocabulary as far as the flags tell (a trained BPE may hold fewer)."""
        return GPT2_VOCAB_SIZE if self.data.tokenizer == "gpt2" else self.data.vocab_size

    @property
    def stages_per_machine(self) -> int:
        """All stages share the emulator's process and the launcher's machine; under torchrun
        LOCAL_WORLD_SIZE ranks do."""
        local = os.environ.get("LOCAL_WORLD_SIZE", "")
        if self.runtime.runtime == "dist" and local.isdigit():
            return max(1, min(int(local), self.run.num_ranks))
        return self.run.num_ranks

    def hf_config(self) -> dict[str, Any]:
        from nobubble.model.hf import read_config

        return read_config(self.model.model.removeprefix("hf:"))

    def optim_config(self) -> OptimConfig:
        recipe = self.optimizer
        return OptimConfig(
            name=recipe.optimizer,
            lr=recipe.lr,
            weight_decay=recipe.weight_decay,
            betas=parse_betas(recipe.betas),
            momentum=recipe.momentum,
            warmup_frac=recipe.warmup_frac,
            min_lr_ratio=recipe.min_lr_ratio,
            clip_norm=recipe.clip if recipe.clip > 0 else None,
            fused_adamw=recipe.fused_adamw,
        )

    def data_config(self) -> DataConfig:
        """The data's config; with ``--model hf:PATH`` whose folder holds a tokenizer.json and
        the default tokenizer (or ``--tokenizer hf``), the model's own tokenizer and
        vocabulary."""
        data = self.data
        if data.data != "shakespeare" and not Path(data.data).exists():
            raise ValueError(
                f"--data {data.data!r} does not exist: give a text file, a folder of .txt files, "
                "parquet, jsonl or arrow files (or a folder of them, such as a datasets save), "
                ".bin shards, or 'shakespeare'"
            )
        tokenizer, path, vocab = data.tokenizer, None, data.vocab_size
        if data.tokenizer in ("bpe", "hf") and self.model.is_hf:
            folder = Path(self.model.model.removeprefix("hf:")).expanduser()
            folder = folder.parent if folder.is_file() else folder
            if data.tokenizer == "hf" or (folder / "tokenizer.json").is_file():
                tokenizer, path = "hf", str(folder)
                vocab = config_vocab(self.hf_config())
        elif data.tokenizer == "hf":
            raise ValueError(
                f"--tokenizer hf reads the tokenizer.json of --model hf:PATH, but --model is "
                f"{self.model.model!r}: give a Hugging Face model folder, or --tokenizer bpe or "
                "gpt2"
            )
        return DataConfig(
            source=data.data,
            tokenizer=tokenizer,
            vocab_size=vocab,
            seq_len=data.seq_len,
            seed=self.run.seed,
            tokenizer_path=path,
            text_column=data.text_column,
        )

    # ----- checks of a run ---------------------------------------------------------------------
    def _check_model(self) -> None:
        """A preset or a Hugging Face model, with at least one layer per stage."""
        if self.model.is_hf:
            check_installed()
            n_layers = config_layers(self.hf_config())
        else:
            if self.model.model.startswith("hf"):
                raise ValueError(
                    f"--model {self.model.model!r}: write hf:PATH (a folder or config.json)"
                )
            check_choice("model", self.model.model, tuple(MODEL_PRESETS))
            n_layers = MODEL_PRESETS[self.model.model].n_layers
            if self.model.untie_embeddings:
                raise ValueError(
                    "--untie-embeddings applies to Hugging Face models (--model hf:PATH); "
                    f"{self.model.model} has an untied head already"
                )
        if self.model_stages <= n_layers:
            return
        per_rank = self.model_stages // self.num_ranks
        cut = (
            f" cuts the model into {self.model_stages} stages ({per_rank} per rank under "
            f"{self.schedule.name}), which"
            if per_rank > 1
            else ""
        )
        raise ValueError(
            f"--stages {self.num_ranks}{cut} is more than the {n_layers} layers of model "
            f"{self.model.model!r}: use --stages {max(1, n_layers // per_rank)} or fewer, or a "
            "deeper --model"
        )

    def _check_run(self) -> None:
        """What only a training run has: drain points, checkpoints, where the ranks run."""
        if self.run.checkpoint_every % self.run.eval_every:
            raise ValueError(
                f"--checkpoint-every {self.run.checkpoint_every} must be a multiple of "
                f"--eval-every {self.run.eval_every} (checkpoints need drain points)"
            )
        if self.runtime.runtime == "emulate" and (
            self.launch.device == "cuda" or self.launch.backend != "auto" or self.launch.strict_p2p
        ):
            raise ValueError(
                "--device cuda, --backend and --strict-p2p apply to --runtime dist; the "
                "emulator runs every stage in one process on the CPU: use --runtime dist"
            )
        every = self.run.checkpoint_every
        if self.run.stop_at and not (
            self.run.stop_at < self.run.steps and every and self.run.stop_at % every == 0
        ):
            raise ValueError(
                f"--stop-at {self.run.stop_at} must be a checkpoint step below --steps "
                f"{self.run.steps} (a multiple of --checkpoint-every)"
            )

    def fingerprint(self) -> dict[str, Any]:
        """The keys that fix the numbers (everything but where and how it runs). The
        micro-batch is the global one: a run resumes at another D with the same global batch."""
        values = {k: v for k, v in self.to_json().items() if k not in RUNTIME_ONLY}
        values["micro_batch_size"] = self.global_micro_batch_size
        values["schedule_order"] = self.schedule.digest  # a given order: its rows, not its file
        if self.schedule.program is not None:
            values["schedule"] = "a given order"
        return values

    @staticmethod
    def load(path: str | Path) -> dict[str, Any]:
        """Read a JSON or TOML config file into a mapping of flat keys."""
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


@cache
def _keys() -> dict[str, tuple[str, str]]:
    keys: dict[str, tuple[str, str]] = {}
    for section in fields(TrainConfig):
        if not section.init:
            continue
        kind: Any = section.default_factory
        for f in fields(kind()):
            if f.init and (section.name, f.name) not in NOT_KEYS:
                assert f.name not in keys, f"key {f.name!r} in two sections"
                keys[f.name] = (section.name, f.name)
    return keys


__all__ = [
    "BACKENDS",
    "DEVICES",
    "KEY_ALIASES",
    "NOT_KEYS",
    "RUNTIME_ONLY",
    "TrainConfig",
]
