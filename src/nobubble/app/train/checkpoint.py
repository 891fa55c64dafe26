"""Checkpoints at drain points (docs/semantics.md, "Schedule fields"): one part per stage plus
a manifest.

Layout of ``RUN/checkpoint/``, for P stages:

- ``model-0000k-of-0000P.safetensors``: stage k-1's weights under the model's own names, and
  ``model.safetensors.index.json``, the index transformers reads: the folder is a sharded
  safetensors checkpoint that ``from_pretrained`` (given a config.json) or
  ``nobubble.materialize(..., weights=)`` loads a stage at a time;
- ``stage{s}.pt``: the rest of stage s's state (optimizer, correction, weight versions, ...);
- ``stage{s}.json``: the small record of stage s's files (names, sizes, sha256), from which the
  index and the manifest are assembled: no process ever reads another stage's tensors;
- ``manifest.json``: every file's sha256 and the run's fingerprint, written last.

Parts are written into a temporary folder (each rank writes its own stages' files in the
multi-process runtime, each file atomically), and only once the manifest is written does the
folder replace the previous checkpoint. A folder without a manifest, a file whose checksum
differs, or a fingerprint that disagrees with the resuming config is refused before anything is
written. Checkpoints of format 1 (weights inside ``stage{s}.pt``) still load.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from nobubble.api.weights import INDEX, index_of, read_shard, write_index, write_shard
from nobubble.api.weights import sha256 as _sha256

CHECKPOINT = "checkpoint"
MANIFEST = "manifest.json"
FORMAT = 2
READABLE = (1, 2)


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupted or belongs to another configuration."""


def staging_dir(run_dir: Path, step: int) -> Path:
    return run_dir / f".{CHECKPOINT}-{step}.tmp"


def save_part(staging: Path, stage: int, part: dict[str, Any], num_stages: int) -> None:
    """Write one stage's part (module docstring): its weights as the stage's safetensors shard,
    the rest as ``stage{s}.pt``, then its record ``stage{s}.json``; each file atomically."""
    staging.mkdir(parents=True, exist_ok=True)
    record = write_shard(staging, stage, num_stages, part["module"])
    rest = {k: v for k, v in part.items() if k != "module"}
    rest["weights"] = {"file": record["file"], "aliases": record["aliases"]}
    final = staging / f"stage{stage}.pt"
    tmp = final.with_suffix(".pt.tmp")
    torch.save(rest, tmp)
    os.replace(tmp, final)
    record["files"] = {record["file"]: record.pop("sha256"), final.name: _sha256(final)}
    tmp_record = staging / f"stage{stage}.json.tmp"
    tmp_record.write_text(json.dumps(record, indent=1))
    os.replace(tmp_record, staging / f"stage{stage}.json")


def finalize(
    run_dir: Path, step: int, num_stages: int, fingerprint: dict[str, Any], extra: dict[str, Any]
) -> Path:
    """Once every stage's files exist: the index and the manifest from the stages' records,
    then swap the folder into place."""
    staging = staging_dir(run_dir, step)
    records = [json.loads((staging / f"stage{s}.json").read_text()) for s in range(num_stages)]
    write_index(staging, index_of(records))
    files: dict[str, str] = {}
    for s, record in enumerate(records):
        files.update(record["files"])
        files[f"stage{s}.json"] = _sha256(staging / f"stage{s}.json")
    files[INDEX] = _sha256(staging / INDEX)
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
    if manifest.get("format") not in READABLE:
        raise CheckpointError(
            f"checkpoint format {manifest.get('format')!r} in {str(path)!r} is not one of "
            f"{READABLE}: it was written by another nobubble version"
        )
    return manifest


# What a resume may change besides the data parallelism: the split of the model into stages.
# Each parameter's state moves by name to the stage that holds it now (api/restage.py); an
# asynchronous schedule then runs a new pipeline from the drained state (its delays, versions
# and ledger restart at the new depth). The schedule, the micro-batches and every other field
# stay: they change the numbers.
SHAPE = ("num_ranks", "virtual_stages")


def check_fingerprint(manifest: dict[str, Any], fingerprint: dict[str, Any], where: Path) -> None:
    saved = manifest["fingerprint"]
    differ = sorted(
        k
        for k in set(saved) | set(fingerprint)
        if saved.get(k) != fingerprint.get(k) and k not in SHAPE
    )
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
            f"--micro-batch-size {saved // cfg.runtime.data_parallel} at --data-parallel "
            f"{cfg.runtime.data_parallel}"
            if isinstance(saved, int) and saved % cfg.runtime.data_parallel == 0
            else f"a --data-parallel that divides {saved}"
        )
        raise CheckpointError(
            f"the checkpoint in {str(where)!r} trained global micro-batches of {saved} sequences; "
            f"--micro-batch-size {cfg.run.micro_batch_size} × --data-parallel "
            f"{cfg.runtime.data_parallel} = {now} would change the run: use {hint}"
        )
    # under today's key names; a field added since the checkpoint was written ran at its default
    written = type(cfg).normalized(manifest["fingerprint"])
    defaults = {k: v for k, v in type(cfg)().fingerprint().items() if k not in written}
    check_fingerprint(
        {**manifest, "fingerprint": {**defaults, **written}},
        cfg.fingerprint(),
        where,
    )


def checked_file(run_dir: Path, manifest: dict[str, Any], name: str) -> Path:
    """The checkpoint's file ``name``, after its checksum matched the manifest's."""
    path = checkpoint_dir(run_dir) / name
    if not path.is_file() or _sha256(path) != manifest["files"].get(name):
        raise CheckpointError(
            f"checkpoint part {str(path)!r} is missing or corrupted (checksum "
            "mismatch); resume from an intact checkpoint or start over"
        )
    return path


def load_part(
    run_dir: Path, manifest: dict[str, Any], stage: int, device: torch.device | str = "cpu"
) -> dict[str, Any]:
    """Stage ``stage``'s part, checked against the manifest, with its tensors on ``device``:
    its own files only (``stage{s}.pt`` and its shard)."""
    path = checked_file(run_dir, manifest, f"stage{stage}.pt")
    try:
        part: dict[str, Any] = torch.load(path, map_location=device, weights_only=True)
    except Exception as err:  # any unpickling failure means the same thing to the user
        raise CheckpointError(f"checkpoint part {str(path)!r} cannot be read: {err}") from None
    weights = part.pop("weights", None)
    if weights is not None:  # format 2: the weights are the stage's safetensors shard
        shard = checked_file(run_dir, manifest, weights["file"])
        module = read_shard(shard, weights["aliases"])
        part["module"] = {k: v.to(device) for k, v in module.items()}
    return part


def stage_weights(run_dir: Path, manifest: dict[str, Any], stage: int) -> dict[str, torch.Tensor]:
    """Stage ``stage``'s weights alone (CPU), checked against the manifest."""
    if manifest.get("format", 1) == 1:
        return dict(load_part(run_dir, manifest, stage)["module"])
    record_path = checked_file(run_dir, manifest, f"stage{stage}.json")
    record = json.loads(record_path.read_text())
    return read_shard(checked_file(run_dir, manifest, record["file"]), record["aliases"])


def reshaped(manifest: dict[str, Any], cfg: Any) -> bool:
    """Whether a resume of ``cfg`` runs at another split than the checkpoint's (``SHAPE``)."""
    saved = type(cfg).normalized(manifest["fingerprint"])  # under today's key names
    now = cfg.fingerprint()
    return any(saved.get(k, now[k]) != now[k] for k in SHAPE)


def resume_pipeline(
    pipe: Any, run_dir: Path, manifest: dict[str, Any], reshape: bool, device: Any = "cpu"
) -> None:
    """Load the checkpoint into ``pipe``: this process's stages' parts, or, at another split,
    every saved stage's part, each parameter's state moved to the stage that holds it now."""
    step = manifest["step"]
    if reshape:  # every saved part, on the CPU: each stage moves only its own share over
        saved = range(manifest["num_stages"])
        pipe.load_restaged_parts(step, [load_part(run_dir, manifest, s) for s in saved])
    else:
        pipe.load_stage_parts(step, [load_part(run_dir, manifest, s, device) for s in pipe.local])


def check_stream(manifest: dict[str, Any], stream: str | None, where: Path) -> None:
    """The documents are the checkpoint's: the same files, text column and tokenizer (the
    data's ``stream_id``, its cache key), so the resumed run reads the tokens an uninterrupted
    one would have."""
    saved = manifest.get("data_stream")
    if saved is not None and stream is not None and saved != stream:
        raise CheckpointError(
            f"the checkpoint in {str(where)!r} trained on the token stream {saved!r}, but --data "
            f"now gives {stream!r}: its files, --text-column or tokenizer changed; resume with "
            "the data it was written with, or start a new run with another --out"
        )


def check_work_left(step: int, end: int, run_dir: Path) -> None:
    """A resume must have steps left to run: name the checkpoint's step and the fix."""
    if step >= end:
        raise ValueError(
            f"the checkpoint in {str(run_dir)!r} is at step {step} and the run ends at step "
            f"{end}: nothing is left to train; give a larger --steps to continue it"
        )
