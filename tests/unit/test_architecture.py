"""House rules that import-linter cannot see (the import contracts are in pyproject.toml and run by
``make test`` as ``lint-imports``).

* Package code never loads files from ``examples/`` or ``tests/``: no string literal (docstrings
  aside) names such a path, and nothing loads a module from a file path.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_railwave"
_CHECKOUT_DIR = re.compile(r"(^|[/\\])(examples|tests)([/\\]|$)")


def _docstring_nodes(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = getattr(node, "body", [])
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def offending_literals(source: str) -> list[tuple[int, str]]:
    """(line, text) of non-docstring string literals that name an examples/ or tests/ path, and of
    calls that load a module from a file."""
    tree = ast.parse(source)
    docs = _docstring_nodes(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if _CHECKOUT_DIR.search(node.value):
                found.append((node.lineno, node.value))
        if isinstance(node, ast.Attribute) and node.attr == "spec_from_file_location":
            found.append((node.lineno, "spec_from_file_location"))
    return found


def test_package_never_loads_files_from_examples_or_tests():
    found = [
        f"{path.relative_to(PACKAGE)}:{line}: {text!r}"
        for path in _sources()
        for line, text in offending_literals(path.read_text())
    ]
    assert found == [], "package code points into examples/ or tests/:\n" + "\n".join(found)


def test_the_check_catches_a_path_into_examples():
    bad = (
        'X = Path(__file__).parents[2] / "examples" / '
        '"cpu_shims.py"\nimportlib.util.spec_from_file_location("m", X)\n'
    )
    assert sorted(line for line, _ in offending_literals(bad)) == [1, 2]
    assert (
        offending_literals('"""Docs may mention examples/demo.py."""\nY = "tests_dir_name"\n') == []
    )
