"""docs/api.md's examples run, in order, in one namespace, and README's: the pages cannot drift
from the API."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "api.md"


def test_every_example_of_the_api_page_runs() -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.DOTALL)
    assert len(blocks) >= 4, "docs/api.md lost its examples"
    namespace: dict[str, object] = {"__name__": "api_doc"}
    for i, code in enumerate(blocks):
        exec(compile(code, f"{DOC.name} example {i + 1}", "exec"), namespace)


def test_the_readme_python_example_runs() -> None:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.DOTALL)
    assert len(blocks) == 1, "README.md's Python example is gone"
    exec(compile(blocks[0], "README.md example", "exec"), {"__name__": "readme"})
