"""Checkpoints at drain points (design.md section 5): one part per stage plus a manifest.

Layout: ``RUN/checkpoint/{stage0.pt, ..., manifest.json}``. Parts are written into a temporary
folder (each rank writes its own part in the multi-process runtime); the manifest, with every
part's sha256 and the run's fingerprint, is written last, and only then does the folder replace
the previous checkpoint. A folder without a manifest, a part whose checksum differs, or a
fingerprint that disagrees with the resuming config is refused before anything is written.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

CHECKPOINT = "checkpoint"
MANIFEST = "manifest.json"
FORMAT = 1


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupted or belongs to another configuration."""


def staging_dir(run_dir: Path, step: int) -> Path:
    return run_dir / f".{CHECKPOINT}-{step}.tmp"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def save_part(staging: Path, stage: int, part: dict[str, Any]) -> None:
    """Write one stage's part atomically (temporary file, then rename)."""
    staging.mkdir(parents=True, exist_ok=True)
    final = staging / f"stage{stage}.pt"
    tmp = final.with_suffix(".pt.tmp")
    torch.save(part, tmp)
    os.replace(tmp, final)


def finalize(
    run_dir: Path, step: int, num_stages: int, fingerprint: dict[str, Any], extra: dict[str, Any]
) -> Path:
    """Write the manifest once every part exists, then swap the folder into place."""
    staging = staging_dir(run_dir, step)
    files = {f"stage{s}.pt": _sha256(staging / f"stage{s}.pt") for s in range(num_stages)}
    manifest = {
        "format": FORMAT,
        "step": step,
        "num_stages": num_stages,
        "fingerprint": fingerprint,
        "files": files,
        **extra,
    }
    tmp = staging / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, staging / MANIFEST)
    final, old = run_dir / CHECKPOINT, run_dir / f".{CHECKPOINT}-old"
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(staging, final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def checkpoint_dir(run_dir: Path) -> Path:
    """The checkpoint folder; the previous one if a crash fell between finalize's two renames."""
    final, old = run_dir / CHECKPOINT, run_dir / f".{CHECKPOINT}-old"
    if not (final / MANIFEST).is_file() and (old / MANIFEST).is_file():
        return old
    return final


def read_manifest(run_dir: Path) -> dict[str, Any]:
    path = checkpoint_dir(run_dir) / MANIFEST
    if not path.is_file():
        raise CheckpointError(
            f"no complete checkpoint in {str(run_dir)!r} ({CHECKPOINT}/{MANIFEST} is missing); "
            "checkpoints are written every --checkpoint-every steps and at the end of a run"
        )
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"checkpoint manifest {str(path)!r} is corrupted: {err}") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"checkpoint format {manifest.get('format')!r} in {str(path)!r} is "
            f"not {FORMAT}: it was written by another nobubble version"
        )
    return manifest


def check_fingerprint(manifest: dict[str, Any], fingerprint: dict[str, Any], where: Path) -> None:
    saved = manifest["fingerprint"]
    differ = sorted(k for k in set(saved) | set(fingerprint) if saved.get(k) != fingerprint.get(k))
    if differ:
        details = ", ".join(
            f"{k}: checkpoint {saved.get(k)!r} vs now {fingerprint.get(k)!r}" for k in differ
        )
        raise CheckpointError(
            f"checkpoint in {str(where)!r} belongs to another configuration "
            f"({details}); resume with the same settings or start a new --out"
        )


def check_resumable(manifest: dict[str, Any], cfg: Any, where: Path) -> None:
    """The checkpoint's run is this config's: the same global batch (any split of it into
    replicas: the fingerprint holds micro_batch_size × data_parallel), then every other field."""
    saved = manifest["fingerprint"].get("micro_batch_size")
    now = cfg.global_micro_batch_size
    if saved != now:
        hint = (
            f"--micro-batch-size {saved // cfg.data_parallel} at --data-parallel "
            f"{cfg.data_parallel}"
            if isinstance(saved, int) and saved % cfg.data_parallel == 0
            else f"a --data-parallel that divides {saved}"
        )
        raise CheckpointError(
            f"the checkpoint in {str(where)!r} trained global micro-batches of {saved} sequences; "
            f"--micro-batch-size {cfg.micro_batch_size} × --data-parallel {cfg.data_parallel} "
            f"= {now} would change the run: use {hint}"
        )
    check_fingerprint(manifest, cfg.fingerprint(), where)


def load_part(
    run_dir: Path, manifest: dict[str, Any], stage: int, device: torch.device | str = "cpu"
) -> dict[str, Any]:
    """Stage ``stage``'s part, checked against the manifest, with its tensors on ``device``."""
    name = f"stage{stage}.pt"
    path = checkpoint_dir(run_dir) / name
    if not path.is_file() or _sha256(path) != manifest["files"].get(name):
        raise CheckpointError(
            f"checkpoint part {str(path)!r} is missing or corrupted (checksum "
            "mismatch); resume from an intact checkpoint or start over"
        )
    try:
        part: dict[str, Any] = torch.load(path, map_location=device, weights_only=True)
    except Exception as err:  # any unpickling failure means the same thing to the user
        raise CheckpointError(f"checkpoint part {str(path)!r} cannot be read: {err}") from None
    return part


def check_work_left(step: int, end: int, run_dir: Path) -> None:
    """A resume must have steps left to run: name the checkpoint's step and the fix."""
    if step >= end:
        raise ValueError(
            f"the checkpoint in {str(run_dir)!r} is at step {step} and the run ends at step "
            f"{end}: nothing is left to train; give a larger --steps to continue it"
        )
