"""The path of one option (docs/architecture.md, issue 43): ``--correction`` enters five modules
between the command line and the step that applies it, and a test holds the source to that list.

A module *reads the correction* when its source reads a field or method of it, ``x.correction.y``
(the spec's ``config.correction.build()``, the built correction's ``self.correction.apply``), or
loads one of the registry's names (``CorrectionSpec``, ``CORRECTION_ENTRIES``, ...) imported from
``nobubble.optim`` (or defines them: the registry itself). Forwarding does not count: a pipeline
that passes ``**config.worker_options()`` on, a checkpoint that moves ``state["correction"]`` as
one entry among the stage's, a package ``__init__`` that re-exports the names (it loads none).
``--microbatches`` has no such test: past its resolution M is the schedule's own
``num_microbatches``, which every module that reads a schedule reads.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import nobubble
from nobubble.optim import correction_registry

SRC = Path(nobubble.__file__).parent
REGISTRY = "optim/correction_registry.py"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"

# flag, config key, registry, pipeline configuration, the step: docs/architecture.md's list
PATH = {
    "app/train/flags.py",
    "app/train/config.py",
    REGISTRY,
    "api/config.py",
    "engine/worker_step.py",
}
# off the path, each reading the name only: the run's summary records it, a time-to-target
# variant is checked against the registry before it becomes a --correction flag
OFF_PATH = {
    "app/train/trainer.py": {".correction.correction"},
    "app/time_to_target.py": {"correction_entry"},
}


def correction_reads(source: str, is_registry: bool = False) -> set[str]:
    """What ``source`` reads of the correction: ``.correction.<member>`` and registry names."""
    tree = ast.parse(source)
    names = set(correction_registry.__all__)
    ours = set(names) if is_registry else set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("nobubble.optim"):
            ours |= {a.asname or a.name for a in node.names if a.name in names}
    reads = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "correction"
        ):
            reads.add(f".correction.{node.attr}")
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in ours:
            reads.add(node.id)
    return reads


def readers() -> dict[str, set[str]]:
    """Every module of the package that reads the correction -> what it reads."""
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        name = path.relative_to(SRC).as_posix()
        reads = correction_reads(path.read_text(encoding="utf-8"), name == REGISTRY)
        if reads:
            found[name] = reads
    return found


def test_the_correction_is_read_by_the_five_modules_of_its_path_only():
    found = readers()
    entered = set(found) - set(OFF_PATH)
    assert entered == PATH, (
        f"modules that read the correction, beyond its path: {sorted(entered - PATH)}; on the "
        f"path but reading nothing: {sorted(PATH - entered)} (docs/architecture.md, 'The path "
        "of one option': hand the module what it needs, or update the path and its count)"
    )
    assert len(PATH) <= 5
    for module, allowed in OFF_PATH.items():
        assert found.get(module) == allowed, (module, found.get(module), allowed)


def test_the_documented_path_is_the_checked_one():
    text = DOCS.read_text(encoding="utf-8")
    section = text.split("## The path of one option", 1)[1].split("```")[1]
    documented = set(re.findall(r"\b(?:app|api|engine|optim|core|runtime|cli)/[\w/]+\.py", section))
    assert documented == PATH


def test_the_scan_finds_each_way_of_reading_and_skips_forwarding():
    """The scan sees the forms a new reader would use (a guard against a scan that finds
    nothing): a spec's method, a built correction's member, a registry name imported."""
    source = (
        "from nobubble.optim import CorrectionSpec as Spec\n"
        "def f(config, worker):\n"
        "    worker.correction.apply([], print)\n"
        "    return config.correction.build(), Spec()\n"
    )
    assert correction_reads(source) == {".correction.apply", ".correction.build", "Spec"}
    assert correction_reads("def f(config):\n    return g(**config.worker_options())\n") == set()
