"""The flags of ``nobubble train``: one per ``TrainConfig`` key, a section field (a config file
may set the same), and the ``TrainConfig`` an argument list gives. Every way of starting a run
from flags (the command line, the experiment runner, segments, the torch peer) goes through
here."""

from __future__ import annotations

import argparse
from dataclasses import MISSING
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nobubble.app.train.config import TrainConfig

# The flags of the run itself; a flag that configures the pipeline takes its help from its spec
# field (nobubble.api.config) and its choices from the registries (``_from_specs``).
HELP = {
    "num_ranks": "pipeline ranks P (v·P stages for the looped schedules, 2P for the V ones)",
    "model": "a preset (tiny, mini, small, medium, ...) or hf:PATH, a Hugging Face model folder "
    "or config.json (Llama family, GPT-2)",
    "untie_embeddings": "train a tied Hugging Face head as its own parameter (async schedules)",
    "data": "'shakespeare' (default corpus), a text file or folder, parquet, jsonl or arrow "
    "files or a folder of them (a datasets save), or .bin shards",
    "text_column": "the column (jsonl: field) of parquet, jsonl or arrow documents holding text",
    "eval_every": "validate (and drain async schedules) every K steps",
    "checkpoint_every": "checkpoint every K steps (multiple of --eval-every; 0: at the end)",
    "betas": "B1,B2 of the Adam family and Lion (nadam-delay: beta1 rises with each stage's delay "
    "up to 0.99), or auto: the optimizer's own pair",
    "fused_adamw": "true: AdamW (also Muon's AdamW side) in torch's fused kernel, no per-tensor "
    "scratch in the step; last-bit different results",
    "resume": "continue the run in this directory from its last checkpoint",
    "out": "run directory (default runs/<time>-<schedule>-<optimizer>)",
    "threads": "torch threads per process (0: torch default)",
    "stop_at": "stop after the checkpoint of this step (resume later with --resume)",
    "master_port": "rendezvous port of --runtime dist (0: pick a free one)",
    "device": "auto (cuda when available) | cpu | cuda: where --runtime dist runs each stage",
    "backend": "auto (nccl on cuda, gloo on cpu) | gloo | nccl; gloo with --device cuda lets "
    "ranks share a GPU, every transfer through host memory (to debug)",
    "strict_p2p": "enforce NCCL's point-to-point rules on any backend (testing aid)",
}


# a key whose flag keeps another name
FLAG_NAMES = {"num_ranks": "stages"}


def _from_specs() -> tuple[dict[str, str], dict[str, tuple[str, ...]]]:
    """The help and choices of the flags that fill a spec field: the field's own help, and the
    registry's names with each entry's help."""
    from dataclasses import fields

    from nobubble.api.config import CLIP_SCOPES, DTYPES, RUNTIMES, SHARDS, PipelineConfig
    from nobubble.core.schedules import SCHEDULES
    from nobubble.optim import CORRECTION_ENTRIES, OPTIMIZER_ENTRIES

    help_text: dict[str, str] = {}
    for part in fields(PipelineConfig):
        factory: Any = part.default_factory
        if factory is not MISSING:
            help_text.update({f.name: f.metadata["help"] for f in fields(factory) if f.metadata})
    registries: dict[str, dict[str, str]] = {
        "schedule": {n: i.summary for n, i in SCHEDULES.items()},
        "optimizer": {n: e.help for n, e in OPTIMIZER_ENTRIES.items()},
        "correction": {n: e.help for n, e in CORRECTION_ENTRIES.items()},
    }
    for name, entries in registries.items():
        if name != "schedule":  # the schedules' summaries: `nobubble schedules`
            help_text[name] += ": " + " | ".join(f"{n} ({h})" for n, h in entries.items())
    choices = {name: tuple(entries) for name, entries in registries.items()}
    choices.update(
        {"runtime": RUNTIMES, "dtype": tuple(DTYPES), "clip_scope": CLIP_SCOPES, "shard": SHARDS}
    )
    return {k: v.replace("%", "%%") for k, v in help_text.items()}, choices


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def build_train_parser() -> argparse.ArgumentParser:
    """The full ``train`` parser; built only for ``train`` because it imports torch."""
    from nobubble.app.train.config import TrainConfig
    from nobubble.data.config import TOKENIZERS

    spec_help, choices = _from_specs()
    help_of = {**HELP, **spec_help}
    choices["tokenizer"] = TOKENIZERS
    p = argparse.ArgumentParser(
        prog="nobubble train", description="Train a language model under a pipeline schedule."
    )

    p.add_argument("--config", metavar="FILE", help="JSON or TOML file with the same keys")
    p.add_argument("--json", action="store_true", help="print the run summary as one JSON object")
    defaults = TrainConfig().to_json()
    for key in TrainConfig.key_map():
        # P keeps its former flag: --stages (the config key num_ranks also reads "stages")
        flag = "--" + FLAG_NAMES.get(key, key).replace("_", "-")
        default = defaults[key]
        kind: Any = {"int": int, "float": float, "bool": _parse_bool}.get(
            type(default).__name__, str
        )
        if key in ("accum", "virtual_stages"):
            kind = int
        if key == "progress":
            p.add_argument(
                "--no-progress",
                dest="progress",
                action="store_const",
                const=False,
                default=None,
                help="no progress bar",
            )
            continue
        help_text = help_of.get(key, "") + f" (default {default})"
        p.add_argument(
            flag,
            dest=key,
            type=kind,
            default=None,
            choices=choices.get(key),
            metavar="FILE" if key in ("from_torch_csv", "from_json") else None,
            help=help_text.strip(),
        )
    return p


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    from nobubble.app.train.config import TrainConfig

    values: dict[str, Any] = TrainConfig.load(args.config) if args.config else {}
    names = set(TrainConfig.key_map())
    values.update({k: v for k, v in vars(args).items() if k in names and v is not None})
    if args.resume and not args.config:  # a resumed run takes the saved settings by default
        saved = TrainConfig.load(f"{args.resume}/config.json")["config"]
        saved.pop("stop_at", None)  # a planned interruption ends the run it interrupted
        values = {**saved, **values}
    return TrainConfig.from_mapping(values)


__all__ = ["FLAG_NAMES", "build_train_parser", "config_from_args"]
