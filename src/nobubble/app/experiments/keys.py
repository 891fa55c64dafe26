"""Run keys: a readable name plus a short hash of everything that decides the run's numbers.

A finished run is reused when its key matches, so the key must change whenever the run would
come out differently. It hashes two things:

- the resolved config: the grid's base and overrides on top of ``TrainConfig``'s defaults,
  every field except NOT_KEYED (where a run writes, whether it prints progress, a planned
  interruption, the rendezvous port and timeout). Kept fields include the runtime, threads,
  device and backend: they change the wall clock the PACI report reads. A new field is keyed.
- the training code's version (``code_version``): torch's version, pytorch-optimizer's (the
  optim extra's library optimizers; "absent" when it is not installed), and the source of every
  nobubble module except NOT_TRAINING_CODE, the parts that only plan, read, draw or benchmark
  runs. The code is hashed as its syntax trees without docstrings and imports, statement by
  top-level statement in sorted order, without the names of the files: comments, docstrings,
  formatting and moves of code between modules never invalidate a run, and any other edit
  does. A module added later counts as training code until it is listed.

Run folders named before keys carried the hash (``2bw-adamw-s0``) are left alone: no key matches
them, so they are never reused.
"""

from __future__ import annotations

import ast
import hashlib
import json
from pathlib import Path
from typing import Any

NOT_KEYED = ("out", "resume", "progress", "stop_at", "master_port", "dist_timeout")
NOT_TRAINING_CODE = (
    "app/experiments",
    "core/viz",
    "cli/experiment_cmds.py",
    "cli/schedule_cmds.py",
    "cli/bench_cmds.py",
    "cli/time_to_target_cmds.py",
    "cli/export_cmds.py",
    "app/export.py",
    "app/bench/emulator.py",
    "app/bench/runtime.py",
    "app/demo.py",
    "app/segments.py",
    "app/time_to_target.py",
    "app/time_to_target_bench.py",
    "app/time_to_target_race.py",
    "app/time_to_target_report.py",
    "app/time_to_target_tune.py",
)
HASH_CHARS = 8


def keyed_config(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """The resolved config of a run, less NOT_KEYED: defaults filled in, validated."""
    from nobubble.app.train.config import TrainConfig

    resolved = TrainConfig.from_mapping({**base, **overrides}).to_json()
    return {k: v for k, v in sorted(resolved.items()) if k not in NOT_KEYED}


def _without_docstrings(tree: ast.Module) -> ast.Module:
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            body.pop(0)
    return tree


def _without_imports(tree: ast.Module) -> ast.Module:
    """The tree without its import statements (where the code lives changes them, not what it
    does: the code they name is hashed where it is defined)."""
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            body[:] = [n for n in body if not isinstance(n, ast.Import | ast.ImportFrom)]
    return tree


def _package_root() -> Path:
    import nobubble

    return Path(nobubble.__file__).parent


def training_sources(root: Path | None = None) -> dict[str, Path]:
    """nobubble's .py files that can change a run's numbers, by path inside the package."""
    root = root or _package_root()
    sources = {}
    for path in sorted(root.rglob("*.py")):
        name = path.relative_to(root).as_posix()
        folders = ["/".join(name.split("/")[:n]) for n in range(1, name.count("/") + 1)]
        if name not in NOT_TRAINING_CODE and not set(folders) & set(NOT_TRAINING_CODE):
            sources[name] = path
    return sources


def code_version(root: Path | None = None) -> str:
    """Hash of torch's and pytorch-optimizer's versions and of the training code's syntax (hex)."""
    import importlib.metadata

    import torch

    try:
        library = importlib.metadata.version("pytorch-optimizer")
    except importlib.metadata.PackageNotFoundError:
        library = "absent"
    digest = hashlib.sha256(f"torch {torch.__version__}\npytorch-optimizer {library}\n".encode())
    # every top-level statement of the training code, without its imports, in sorted order and
    # without the file it is in: moving code between modules changes no key
    statements = []
    for path in training_sources(root).values():
        tree = _without_imports(
            _without_docstrings(ast.parse(path.read_text(), filename=str(path)))
        )
        statements += [ast.dump(node) for node in tree.body]
    for statement in sorted(statements):
        digest.update(f"{statement}\n".encode())
    return digest.hexdigest()


def run_key(name: str, config: dict[str, Any], code: str) -> str:
    """``name-HASH``: HASH covers the keyed config and the code version."""
    blob = json.dumps({"config": config, "code": code}, sort_keys=True, default=str)
    return f"{name}-{hashlib.sha256(blob.encode()).hexdigest()[:HASH_CHARS]}"
