"""Export a finished run: its last checkpoint, loaded into the model it trained, written out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nobubble.checkpoint import load_part, read_manifest
from nobubble.config import TrainConfig


def load_run_model(run_dir: Path) -> tuple[Any, list[Any], int]:
    """The Hugging Face model of ``run_dir`` with its last checkpoint's weights, its stages
    (which share its modules) and the checkpoint's step."""
    config_path = run_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{run_dir} holds no run (no config.json): pass a run directory")
    cfg = TrainConfig.from_mapping(TrainConfig.load(config_path)["config"])
    if not cfg.is_hf:
        raise ValueError(
            f"{run_dir} trained the internal model {cfg.model!r}; export --hf writes Hugging "
            "Face models, trained with --model hf:PATH"
        )
    manifest = read_manifest(run_dir)  # checked before the model is built
    parts = [load_part(run_dir, manifest, s) for s in range(cfg.model_stages)]
    from nobubble.hf import load_model
    from nobubble.splitting import split

    model = load_model(cfg.model.removeprefix("hf:"), seed=cfg.seed)
    stages = split(model, cfg.model_stages, untie=cfg.untie_embeddings)
    for stage, part in zip(stages, parts, strict=True):
        stage.load_state_dict(part["module"])
    return model, stages, int(manifest["step"])


def export_run(run_dir: Path, out: Path) -> Path:
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"--hf {out} exists and is not empty: pass a new folder")
    from nobubble.hf import export

    model, _, _ = load_run_model(run_dir)
    return export(model, out)
