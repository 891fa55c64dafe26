"""Export a finished run: its last checkpoint as a transformers folder, a stage at a time.

The checkpoint already holds each stage's weights as a safetensors shard under the model's own
names; the export writes them again as ``model-0000k-of-0000P.safetensors`` with the index
transformers reads, plus the config, holding one stage's tensors at a time (and the embedding,
to check a tied head against it). No process holds the whole model.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from nobubble.api.weights import index_of, write_index, write_shard
from nobubble.app.train.checkpoint import load_part, read_manifest, stage_weights
from nobubble.app.train.config import TrainConfig


def run_config(run_dir: Path) -> TrainConfig:
    """The configuration of the Hugging Face run in ``run_dir``."""
    config_path = run_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{run_dir} holds no run (no config.json): pass a run directory")
    cfg = TrainConfig.from_mapping(TrainConfig.load(config_path)["config"])
    if not cfg.model.is_hf:
        raise ValueError(
            f"{run_dir} trained the internal model {cfg.model.model!r}; export --hf writes Hugging "
            "Face models, trained with --model hf:PATH"
        )
    return cfg


def load_run_model(run_dir: Path) -> tuple[Any, list[Any], int]:
    """The whole Hugging Face model of ``run_dir`` with its last checkpoint's weights, its
    stages (which share its modules) and the checkpoint's step (for tests and small models:
    it holds the whole model)."""
    cfg = run_config(run_dir)
    manifest = read_manifest(run_dir)  # checked before the model is built
    parts = [load_part(run_dir, manifest, s) for s in range(cfg.model_stages)]
    from nobubble.api.splitting import split
    from nobubble.model.hf import load_model

    model = load_model(cfg.model.model.removeprefix("hf:"), seed=cfg.run.seed)
    stages = split(model, cfg.model_stages, untie=cfg.model.untie_embeddings)
    for stage, part in zip(stages, parts, strict=True):
        stage.load_state_dict(part["module"])
    return model, stages, int(manifest["step"])


def export_run(run_dir: Path, out: Path) -> Path:
    """Write the run's last checkpoint to ``out`` as a sharded transformers folder."""
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"--hf {out} exists and is not empty: pass a new folder")
    cfg = run_config(run_dir)
    manifest = read_manifest(run_dir)
    from nobubble.model.hf import embedding_names, meta_model

    model = meta_model(cfg.model.model.removeprefix("hf:"))  # for its config and class: no memory
    tied = bool(model.config.tie_word_embeddings) and not cfg.model.untie_embeddings
    embed_name, head_name = embedding_names(model.config.model_type)
    num_stages = cfg.model_stages
    staging = out.with_name(out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    records, embedding = [], None
    for s in range(num_stages):
        state = stage_weights(run_dir, manifest, s)
        if tied and s == 0:
            embedding = state[embed_name]
        if tied and s == num_stages - 1:  # transformers ties the head again: drop the copy
            head = state.pop(head_name)
            if embedding is None or not torch.equal(head, embedding):
                raise ValueError(
                    f"the config ties {head_name} to {embed_name}, but the two copies differ: "
                    "they were trained apart (--untie-embeddings sets tie_word_embeddings false)"
                )
        records.append(write_shard(staging, s, num_stages, state))
        del state
    write_index(staging, index_of(records))
    model.config.tie_word_embeddings = tied
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(staging)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(staging)
    meta = {"written_by": "nobubble", "tie_word_embeddings": tied, "step": manifest["step"]}
    (staging / "nobubble.json").write_text(json.dumps(meta, indent=1) + "\n")
    if out.exists():
        out.rmdir()  # empty, checked above
    os.replace(staging, out)
    return out
