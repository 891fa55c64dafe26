"""What a fresh ``pip install -e .`` needs: every third-party package the library imports is a
declared dependency, or belongs to the extra that names it (the tests run with the dev extra,
which would hide a missing one: safetensors once was)."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def _name(requirement: str) -> str:
    """The normalized distribution name of a requirement string (PEP 503)."""
    return re.sub(r"[-_.]+", "-", re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0]).lower()


def imported_packages() -> set[str]:
    """Top-level modules imported anywhere in src/nobubble, less the standard library."""
    found = set()
    for path in (ROOT / "src" / "nobubble").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return {m for m in found if m not in sys.stdlib_module_names and m != "nobubble"}


def test_every_imported_package_is_a_declared_dependency():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    required = {_name(r) for r in project["dependencies"]}
    optional = project["optional-dependencies"]
    extras = {_name(r) for extra in ("hf", "optim", "data") for r in optional[extra]}
    distributions = importlib.metadata.packages_distributions()
    missing = {
        module: distributions.get(module, [module])
        for module in imported_packages()
        if not {_name(d) for d in distributions.get(module, [module])} & (required | extras)
    }
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"
