"""The run-only sections of a ``TrainConfig`` (frozen, keyword-only, like the pipeline's specs
in ``nobubble.api.config``), and the checks of one value.

``RecipeSpec`` is the optimizer as a run sets it (peak learning rate, warm-up and cosine; it
builds the pipeline's ``OptimizerSpec``); ``RunSpec``, ``DataSpec``, ``ModelSpec`` and
``LaunchSpec`` hold what only a training run has. A field's name is its config key and its flag.
"""

from __future__ import annotations

from dataclasses import dataclass

GPT2_VOCAB_SIZE = 50257  # --tokenizer gpt2 fixes the vocabulary, whatever --vocab-size says


@dataclass(frozen=True, kw_only=True)
class RecipeSpec:
    """optimizer: a registered name. lr: the peak learning rate (linear warm-up over
    warmup_frac of the steps, cosine to min_lr_ratio of it); weight_decay, betas, momentum,
    fused_adamw: the optimizer's (``OptimConfig``; betas "B1,B2", or "auto" for the entry's own
    pair). clip: 0 disables; clip_scope: the ``OptimizerSpec``'s."""

    optimizer: str = "adamw"
    lr: float = 3e-3
    weight_decay: float = 0.1
    betas: str = "auto"
    warmup_frac: float = 0.1
    min_lr_ratio: float = 0.1
    momentum: float = 0.95
    clip: float = 1.0
    clip_scope: str = "auto"
    fused_adamw: bool = False


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """num_ranks: pipeline ranks P (flag --stages; the model is cut into P stages, v·P under
    the looped schedules and 2P under the V ones). micro_batch_size: sequences per
    micro-batch, per replica (the run reads global micro-batches of
    data_parallel·micro_batch_size sequences, replica r the r-th slice of each). steps:
    optimizer steps. seed: the model's init and the data order. eval_every: validation every
    K steps (asynchronous schedules drain there). checkpoint_every: checkpoint every K steps
    (a multiple of eval_every); 0: only at the end. stop_at: stop after the checkpoint of this
    step (a planned interruption; --resume goes on).
    """

    num_ranks: int = 2
    micro_batch_size: int = 8
    steps: int = 300
    seed: int = 0
    eval_every: int = 50
    eval_batches: int = 8
    checkpoint_every: int = 0
    sample_tokens: int = 200
    stop_at: int = 0


@dataclass(frozen=True, kw_only=True)
class DataSpec:
    """data: 'shakespeare', a text file or folder, .bin shards, or parquet, jsonl and arrow
    documents (files or folders); text_column: the documents' text column; tokenizer,
    vocab_size and seq_len: ``nobubble.data.DataConfig``'s (with an hf: model whose folder holds
    a tokenizer.json, its own tokenizer and vocabulary)."""

    data: str = "shakespeare"
    tokenizer: str = "bpe"
    text_column: str = "text"
    vocab_size: int = 4096
    seq_len: int = 128


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """model: a preset (tiny, mini, ...) or hf:PATH, a Hugging Face model folder or
    config.json (Llama family or GPT-2; a config alone gets a random init from --seed).
    untie_embeddings: a Hugging Face model with tied embeddings trains its head as a separate
    parameter (needed by asynchronous schedules over several stages)."""

    model: str = "tiny"
    untie_embeddings: bool = False

    @property
    def is_hf(self) -> bool:
        return self.model.startswith("hf:")


@dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    """Where and how the run goes, not what it computes.

    threads: torch intra-op threads per process (0: torch's default; the multi-process runtime
        defaults to cores / stages, since OpenMP threads that outnumber cores spin and stall).
    master_port: rendezvous port (0: a free one).
    device: auto (cuda when available, else cpu) | cpu | cuda: where each rank's stage runs.
    backend: auto (nccl on cuda, gloo on cpu) | gloo | nccl (gloo on cuda: ranks share GPUs,
        every transfer through host memory; a debugging mode, docs/runtime.md).
    strict_p2p: run point-to-point under NCCL's completion rules on any backend (one stream per
        rank; a testing aid that makes an order NCCL would deadlock on hang on gloo too).
    """

    out: str | None = None
    resume: str | None = None
    progress: bool = True
    threads: int = 0
    master_port: int = 0
    device: str = "auto"
    backend: str = "auto"
    strict_p2p: bool = False


def parse_betas(value: object) -> tuple[float, float] | None:
    """``--betas``: "auto" (None: the optimizer's own pair) or "B1,B2", each in [0, 1) (a config
    file may give a list of two numbers)."""
    if value == "auto":
        return None
    parts = value.split(",") if isinstance(value, str) else value
    try:
        if isinstance(parts, (list, tuple)) and len(parts) == 2:
            betas = float(parts[0]), float(parts[1])
            if all(0.0 <= b < 1.0 for b in betas):
                return betas
    except (TypeError, ValueError):
        pass
    raise ValueError(
        f"--betas {value!r} is not a pair of numbers in [0, 1): give B1,B2 (for example "
        "0.9,0.95), or auto for the optimizer's own pair"
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
        flag = {"num_ranks": "stages"}.get(name, name).replace("_", "-")
        raise ValueError(f"--{flag} must be an integer >= {minimum}, got {value!r}")


__all__ = [
    "GPT2_VOCAB_SIZE",
    "DataSpec",
    "LaunchSpec",
    "ModelSpec",
    "RecipeSpec",
    "RunSpec",
    "check_choice",
    "check_port",
    "check_positive",
    "parse_betas",
]
