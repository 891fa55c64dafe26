"""The flags of ``nobubble train``: one per ``TrainConfig`` field (a config file may set the same),
and the ``TrainConfig`` an argument list gives. Every way of starting a run from flags (the
command line, the experiment runner, segments, the torch peer) goes through here."""

from __future__ import annotations

import argparse
from dataclasses import MISSING, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nobubble.app.train.config import TrainConfig

HELP = {
    "model": "a preset (tiny, mini, small, medium, ...) or hf:PATH, a Hugging Face model folder "
    "or config.json (Llama family, GPT-2)",
    "untie_embeddings": "train a tied Hugging Face head as its own parameter (async schedules)",
    "correction": "none | ef (error feedback, scaled by each stage's delay) | predict (delayed "
    "forwards read weights extrapolated by their delay) | delay-lr (per-stage lr warm-up by "
    "delay) | sync-warmup",
    "ef_lambda": "error-feedback lambda (default 1)",
    "delay_lr_steps": "steps over which --correction delay-lr's damping fades (0: --steps/4)",
    "sync_warmup": "synchronous steps first with --correction sync-warmup (0: 10%% of --steps)",
    "virtual_stages": "stages per rank v of interleaved-1f1b (default 2; zbv: 2)",
    "accum": "accumulation factor a of pipedream (default 1) and paci (default --microbatches)",
    "clip": "gradient-norm clip, 0 disables",
    "clip_scope": "auto (global for sync, per stage for async) | stage | global",
    "data": "'shakespeare' (default corpus), a text file or folder, or .bin shards",
    "eval_every": "validate (and drain async schedules) every K steps",
    "checkpoint_every": "checkpoint every K steps (multiple of --eval-every; 0: at the end)",
    "dtype": "fp32 | bf16 (autocast, fp32 master weights)",
    "fused_adamw": "true: AdamW (also Muon's AdamW side) in torch's fused kernel, no per-tensor "
    "scratch in the step; last-bit different results",
    "fused_grad_accumulation": "true: Linear and Embedding layers add their weight gradient into "
    ".grad inside the backward (no fresh gradient per micro-batch); last-bit different results",
    "runtime": "emulate (one process) | dist (one process per stage and replica)",
    "resume": "continue the run in this directory from its last checkpoint",
    "out": "run directory (default runs/<time>-<schedule>-<optimizer>)",
    "threads": "torch threads per process (0: torch default)",
    "stop_at": "stop after the checkpoint of this step (resume later with --resume)",
    "dist_timeout": "seconds to wait for a peer rank before failing",
    "master_port": "rendezvous port of --runtime dist (0: pick a free one)",
    "device": "auto (cuda when available) | cpu | cuda: where --runtime dist runs each stage",
    "backend": "auto (nccl on cuda, gloo on cpu) | gloo | nccl; gloo with --device cuda lets "
    "ranks share a GPU, every transfer through host memory (to debug)",
    "strict_p2p": "enforce NCCL's point-to-point rules on any backend (testing aid)",
    "data_parallel": "D pipeline replicas (--runtime dist: stages × D processes); "
    "--micro-batch-size is per replica",
    "bucket_mb": "bucket size (MB) of the data-parallel gradient all-reduce",
    "shard": "none | fsdp: shard each stage's parameters, gradients and optimizer state "
    "across its --data-parallel replicas (FSDP2)",
}


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def build_train_parser() -> argparse.ArgumentParser:
    """The full ``train`` parser; built only for ``train`` because it imports torch."""
    from nobubble.app.train.config import TrainConfig
    from nobubble.core.schedules import SCHEDULE_NAMES
    from nobubble.data.config import TOKENIZERS
    from nobubble.optim import OPTIMIZERS

    choices: dict[str, tuple[str, ...]] = {
        "schedule": SCHEDULE_NAMES,
        "optimizer": OPTIMIZERS,
        "tokenizer": TOKENIZERS,
        "shard": ("none", "fsdp"),
    }
    p = argparse.ArgumentParser(
        prog="nobubble train", description="Train a language model under a pipeline schedule."
    )

    p.add_argument("--config", metavar="FILE", help="JSON or TOML file with the same keys")
    p.add_argument("--json", action="store_true", help="print the run summary as one JSON object")
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        default = None if f.default is MISSING else f.default
        kind: Any = {"int": int, "float": float, "bool": _parse_bool}.get(
            type(default).__name__, str
        )
        if f.name in ("accum", "virtual_stages"):
            kind = int
        if f.name == "progress":
            p.add_argument(
                "--no-progress",
                dest="progress",
                action="store_const",
                const=False,
                default=None,
                help="no progress bar",
            )
            continue
        help_text = HELP.get(f.name, "") + f" (default {default})"
        p.add_argument(
            flag,
            dest=f.name,
            type=kind,
            default=None,
            choices=choices.get(f.name),
            help=help_text.strip(),
        )
    return p


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    from nobubble.app.train.config import TrainConfig

    values: dict[str, Any] = TrainConfig.load(args.config) if args.config else {}
    names = {f.name for f in fields(TrainConfig)}
    values.update({k: v for k, v in vars(args).items() if k in names and v is not None})
    if args.resume and not args.config:  # a resumed run takes the saved settings by default
        saved = TrainConfig.load(f"{args.resume}/config.json")["config"]
        saved.pop("stop_at", None)  # a planned interruption ends the run it interrupted
        values = {**saved, **values}
    return TrainConfig.from_mapping(values)
