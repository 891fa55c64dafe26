"""Keep design.md section 3's layering: layer 0 imports no torch; imports point down only."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "nobubble"

# Top-level module or package of nobubble -> layer. Every module must be listed here.
LAYERS = {
    "__init__": 0,
    "__main__": 3,
    "ir": 0,
    "deps": 0,
    "placement": 0,
    "schedules": 0,
    "ledger": 0,
    "validate": 0,
    "sim": 0,
    "viz": 0,
    "util": 0,
    "errors": 0,
    "model": 1,
    "data": 1,
    "optim": 1,
    "exec": 1,
    "dist": 2,
    "config": 3,
    "train": 3,
    "checkpoint": 3,
    "assemble": 3,
    "metrics": 3,
    "experiments": 3,
    "bench_runtime": 3,
    "demo": 3,
    "bench": 3,
    "cli": 3,
}
LAYER0 = [name for name, layer in LAYERS.items() if layer == 0 and name != "__init__"]


def top_level(path: Path) -> str:
    rel = path.relative_to(SRC)
    return rel.parts[0].removesuffix(".py")


def nobubble_imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found += [(node.lineno, n) for n in names]
    return found


def test_every_module_has_a_layer():
    unknown = {top_level(p) for p in SRC.rglob("*.py")} - set(LAYERS)
    assert not unknown, f"add these to LAYERS in {__file__}: {sorted(unknown)}"


@pytest.mark.parametrize("path", sorted(SRC.rglob("*.py")), ids=lambda p: str(p.relative_to(SRC)))
def test_imports_point_down(path):
    own = LAYERS[top_level(path)]
    for lineno, name in nobubble_imports(path):
        parts = name.split(".")
        if parts[0] == "torch" or parts[0].startswith("torch"):
            assert own >= 1, f"{path.name}:{lineno} imports torch in layer 0"
        if parts[0] != "nobubble" or len(parts) == 1:
            continue
        target = LAYERS[parts[1]]
        assert target <= own, f"{path.name}:{lineno} (layer {own}) imports {name} (layer {target})"


def test_layer0_runs_without_torch():
    code = (
        "import sys\n"
        + "".join(f"import nobubble.{m}\n" for m in LAYER0)
        + "import nobubble.schedules.gpipe, nobubble.sim.engine, nobubble.viz.gantt\n"
        + "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        + "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
