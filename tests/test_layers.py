"""The package's folders are its layers (docs/architecture.md): imports point down only, no module
imports itself through others (no import circles), and the torch-free core loads no torch.

Imports are read with ``ast`` from every file of the package, including those inside functions
and under ``TYPE_CHECKING``: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "nobubble"

# Module or package of nobubble (dotted, without ``nobubble.``) -> layer; the most specific
# listed prefix wins. Every top-level module or folder must be listed. A module may import its
# own layer and the ones below it.
LAYERS = {
    "core": 0,  # no torch: schedules as data and everything derived from them
    "model": 1,  # the internal GPT, Hugging Face models as stages, cost and memory models
    "data": 1,
    "optim": 1,
    "engine": 2,  # a schedule executed on modules: worker, versions, interpreter
    "runtime": 3,  # what drives the engine: the emulator, torch.distributed
    "api": 4,  # the public API: Pipeline, split, materialize, weights
    # the front door names the public API, loaded on first use (importing the package loads no
    # torch: tests/test_api.py checks it); nobubble.hf, the public path of the Hugging Face
    # support, only re-exports
    "__init__": 4,
    "hf": 4,
    "app": 5,  # application commands: train, bench, experiments, demo, study, export
    "cli": 6,  # the command line, a thin layer over app
    "__main__": 6,
}


def module_name(path: Path, root: Path) -> str:
    """``a.b`` for root/a/b.py and root/a/b/__init__.py; ``__init__`` for the root's own."""
    parts = path.relative_to(root).with_suffix("").parts
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def layer_of(dotted: str) -> int:
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYERS:
            return LAYERS[".".join(parts[:n])]
    raise KeyError(dotted)


def modules(root: Path) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def imports_of(path: Path, root: Path, known: set[str]) -> list[tuple[int, str]]:
    """(line, module) for every import of the package in ``path`` (``torch`` ones too, as
    ``torch``): ``from pkg import sub`` counts as both ``pkg`` and the submodule, ``from pkg
    import name`` as ``pkg``, ``from pkg.sub import name`` and ``import pkg.sub`` as the
    submodule only (the way to reach a sibling from a module its package's __init__ imports);
    the package itself (``import nobubble``) is ``__init__``."""
    package = root.name
    own = module_name(path, root)
    is_package = path.name == "__init__.py"
    found: list[tuple[int, str]] = []

    def resolve(dotted: str) -> str | None:
        parts = dotted.split(".")
        if parts[0] != package:
            return None
        inner = parts[1:]
        for n in range(len(inner), 0, -1):
            if ".".join(inner[:n]) in known:
                return ".".join(inner[:n])
        return "__init__"

    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the importer's package
                base = own.split(".") if is_package and own != "__init__" else own.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join([package, *base, *([node.module] if node.module else [])])
            else:
                stem = node.module or ""
            targets = [f"{stem}.{alias.name}" for alias in node.names]
        else:
            continue
        if isinstance(node, ast.ImportFrom):
            # ``from pkg import sub`` runs pkg's __init__ before it reads ``sub``: an import of
            # the package too, so a package whose __init__ imports its importer is a circle
            targets.append(stem)
        for target in targets:
            if target.split(".")[0] == "torch":
                found.append((node.lineno, "torch"))
            resolved = resolve(target)
            if resolved is not None and resolved != own:
                found.append((node.lineno, resolved))
    return sorted(set(found))


def import_graph(root: Path) -> dict[str, set[str]]:
    mods = modules(root)
    known = set(mods) - {"__init__"}
    return {
        name: {t for _, t in imports_of(path, root, known) if t != "torch"}
        for name, path in mods.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def upward(root: Path) -> list[str]:
    """Every import of a higher layer, and every torch import in layer 0."""
    mods = modules(root)
    known = set(mods) - {"__init__"}
    bad = []
    for name, path in mods.items():
        own = layer_of(name)
        for lineno, target in imports_of(path, root, known):
            rel = path.relative_to(root)
            if target == "torch":
                if own == 0:
                    bad.append(f"{rel}:{lineno} imports torch in layer 0")
            elif layer_of(target) > own:
                bad.append(f"{rel}:{lineno} (layer {own}) imports {target} ({layer_of(target)})")
    return bad


def test_every_module_has_a_layer():
    unknown = set()
    for name in modules(SRC):
        try:
            layer_of(name)
        except KeyError:
            unknown.add(name.split(".")[0])
    assert not unknown, f"add these to LAYERS in {__file__}: {sorted(unknown)}"


def test_imports_point_down():
    bad = upward(SRC)
    assert not bad, "imports that point up:\n" + "\n".join(bad)


def test_no_import_circles():
    found = cycles(import_graph(SRC))
    assert not found, "modules that import each other (directly or around a circle):\n" + (
        "\n".join(" <-> ".join(c) for c in found)
    )


def test_the_checks_catch_a_circle_and_an_upward_import(tmp_path):
    """Including a circle through a package's __init__ (``from pkg import sub``)."""
    root = tmp_path / "nobubble"
    files = {
        "__init__.py": "",
        "core/__init__.py": "",
        "core/a.py": "from nobubble.core.b import X\n",
        "core/b.py": "def f():\n    from nobubble.core import a\nX = 1\n",  # a <-> b, lazily
        "core/c.py": "from . import a\nimport torch\n",  # relative import; torch in layer 0
        "engine/__init__.py": "",
        "engine/w.py": "from nobubble.api.p import P\n",  # up from 2 to 4
        "api/__init__.py": "",
        "api/p.py": "from nobubble.engine import w\nP = 1\n",  # w <-> p
        # a package whose __init__ imports a module that reaches a sibling through the package
        "core/s/__init__.py": "from nobubble.core.s import bound, ok\n",
        "core/s/g.py": "N = 1\n",
        "core/s/bound.py": "from nobubble.core.s import g\n",  # runs s's __init__: s <-> bound
        "core/s/ok.py": "import nobubble.core.s.g as g\nfrom nobubble.core.s.g import N\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    graph = import_graph(root)
    assert cycles(graph) == [
        ["api.p", "engine.w"],
        ["core.a", "core.b"],
        ["core.s", "core.s.bound"],
    ]
    assert graph["core.c"] == {"core", "core.a"}
    assert graph["core.s.bound"] == {"core.s", "core.s.g"}
    assert graph["core.s.ok"] == {"core.s.g"}
    bad = upward(root)
    assert len(bad) == 2, bad
    assert "core/c.py:2 imports torch in layer 0" in bad
    assert "engine/w.py:1 (layer 2) imports api.p (4)" in bad


def layer0() -> list[str]:
    return sorted(m for m in modules(SRC) if m != "__init__" and layer_of(m) == 0)


def test_layer0_runs_without_torch():
    code = (
        "import sys\n"
        + "".join(f"import nobubble.{m}\n" for m in layer0())
        + "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        + "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("layer", sorted(set(LAYERS.values())))
def test_every_layer_has_modules(layer):
    """A layer of the map that no module is in is a stale map."""
    assert any(layer_of(m) == layer for m in modules(SRC)), layer


MAX_LINES = 400


def test_no_module_is_over_400_lines():
    """A module that grows past this is split by responsibility (docs/architecture.md)."""
    long = {
        str(p.relative_to(SRC)): n
        for p in SRC.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split these modules by responsibility: {long}"
