"""Keep design.md section 3's layering: layer 0 imports no torch; imports point down only."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "nobubble"

# Module or package of nobubble -> layer; the most specific dotted name wins. Every top-level
# module must be listed. In `distributed`, the transport is layer 2; the runtimes that run a whole
# TrainConfig (per-rank runtime, launcher, synthetic runs, torch peer) sit in layer 3 beside the
# emulator's Trainer, because they use config and assembly.
LAYERS = {
    # the front door names the public API of every layer, loaded on first use (importing the
    # package loads no torch: tests/test_api.py checks it), so its own imports count as layer 3
    "__init__": 3,
    "__main__": 3,
    "core": 0,  # the torch-free core: ir, deps, placement, comm, schedules, ledger, ...
    "model": 1,
    "data": 1,
    "optim": 1,
    "exec": 1,
    "pipeline": 3,  # the public API runs on the emulator (1) or the multi-process runner (2)
    "splitting": 1,
    "materializing": 1,  # stages of a meta-device model given tensors where they run
    "replay": 1,  # a model's own init replayed with only some tensors real
    "weights": 1,  # safetensors read and written a stage at a time
    "host_memory": 0,  # glibc malloc settings through ctypes: no torch
    "hf": 1,
    "export": 3,
    "distributed": 3,
    "distributed.__init__": 2,
    "distributed.transport": 2,
    "distributed.clock": 2,
    "distributed.api": 2,
    "distributed.data_parallel": 2,  # the dp all-reduce, beside the transport
    "distributed.fsdp": 2,  # sharding within a stage (FSDP2), beside it
    "distributed.sharded_muon": 2,
    "distributed.shard_comm": 2,
    "distributed.staging": 2,  # gloo on a GPU: the transport's tensors through host memory
    "config": 3,
    "train": 3,
    "checkpoint": 3,
    "assemble": 3,
    "metrics": 3,
    "experiments": 3,
    "bench_runtime": 3,
    "bench_memory": 3,
    "demo": 3,
    "segments": 3,
    "time_to_target": 3,
    "study": 3,
    "bench": 3,
    "cli": 3,
}
# every module of layer 0, by its dotted name under nobubble
LAYER0 = sorted(
    ".".join(p.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
    for p in SRC.rglob("*.py")
    if LAYERS.get(p.relative_to(SRC).parts[0].removesuffix(".py")) == 0
)


def top_level(path: Path) -> str:
    rel = path.relative_to(SRC)
    return rel.parts[0].removesuffix(".py")


def layer_of(dotted: str) -> int:
    """Layer of ``a.b.c`` (without the ``nobubble.`` prefix): its most specific listed prefix."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYERS:
            return LAYERS[".".join(parts[:n])]
    raise KeyError(dotted)


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
    rel = path.relative_to(SRC).with_suffix("")
    own = layer_of(".".join(rel.parts))
    for lineno, name in nobubble_imports(path):
        parts = name.split(".")
        if parts[0] == "torch" or parts[0].startswith("torch"):
            assert own >= 1, f"{path.name}:{lineno} imports torch in layer 0"
        if parts[0] != "nobubble" or len(parts) == 1:
            continue
        target = layer_of(".".join(parts[1:]))
        assert target <= own, f"{path.name}:{lineno} (layer {own}) imports {name} (layer {target})"


def test_layer0_runs_without_torch():
    code = (
        "import sys\n"
        + "".join(f"import nobubble.{m}\n" for m in LAYER0)
        + "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        + "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
