"""No function or method in the package is over 80 lines (docs/architecture.md): a longer one is
split by responsibility.

A function's length is counted with ``ast`` from its ``def`` line to its last line, docstring,
comments and blank lines inside it included, decorators excluded; a nested function counts within
its enclosing one and on its own.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "nobubble"
MAX_LINES = 80


def function_lengths(root: Path) -> dict[str, int]:
    """``"path Qualified.name"`` -> lines, for every function and method under ``root``."""
    lengths: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str, rel: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                assert child.end_lineno is not None
                lengths[f"{rel} {name}"] = child.end_lineno - child.lineno + 1
                visit(child, f"{name}.", rel)
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.", rel)
            else:
                visit(child, prefix, rel)

    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        visit(ast.parse(path.read_text(), filename=str(path)), "", rel)
    return lengths


def test_no_function_is_over_80_lines():
    long = {name: n for name, n in function_lengths(SRC).items() if n > MAX_LINES}
    assert not long, f"split these functions by responsibility (over {MAX_LINES} lines): {long}"


def test_the_count_sees_methods_nested_functions_and_not_decorators(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(80))
    (tmp_path / "m.py").write_text(
        "import functools\n"
        "class C:\n"
        "    @functools.cache\n"
        "    @staticmethod\n"
        f"    def long():\n{body.replace('    ', '        ')}"
        "def short():\n"
        "    def inner():\n"
        "        pass\n"
        "    return inner\n"
    )
    assert function_lengths(tmp_path) == {
        "m.py C.long": 81,
        "m.py short": 4,
        "m.py short.inner": 2,
    }
