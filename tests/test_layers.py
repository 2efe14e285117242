"""Each subpackage's ``__init__.py`` is its face: the one way other layers reach it. A
module outside ``autoloader/P/`` imports ``autoloader.P``, never ``autoloader.P._x``,
so that what a layer offers the others is the list its face exports (and
``lint-imports`` holds the layers themselves, ``pyproject.toml``)."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(path.parent.name for path in (ROOT / "autoloader").glob("*/__init__.py"))
_PRIVATE = re.compile(r"autoloader\.(\w+)\._\w+")
# Imported by its own name on purpose: every use of torch's private API is found by
# searching for it (loader/__init__.py).
_BY_NAME = {"autoloader.loader._torch_compat"}


def _imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
    return found


def test_other_layers_import_a_package_through_its_face() -> None:
    bypassing = []
    for path in sorted((ROOT / "autoloader").rglob("*.py")):
        relative = path.relative_to(ROOT)
        own = relative.parts[1] if len(relative.parts) > 2 else None
        for line, module in _imports(path):
            match = _PRIVATE.fullmatch(module)
            if module in _BY_NAME:
                continue
            if match and match.group(1) in PACKAGES and match.group(1) != own:
                bypassing.append(f"{relative}:{line} imports {module}")
    assert bypassing == []


@pytest.mark.parametrize("package", PACKAGES)
def test_a_face_exports_what_it_lists_and_lists_what_it_imports(package: str) -> None:
    face = importlib.import_module(f"autoloader.{package}")
    listed = set(face.__all__)
    imported = {
        alias.asname or alias.name
        for node in ast.parse((ROOT / "autoloader" / package / "__init__.py").read_text()).body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert listed == imported
    assert all(hasattr(face, name) for name in listed)


# Issue 37: a module a reader can hold in mind, a function read at one sitting.
_MOST_MODULE_LINES = 600
_MOST_FUNCTION_LINES = 80


def _code_lines(function: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]) -> int:
    """Lines of code in ``function``'s body: from its first statement after the
    docstring (a signature and a docstring are not code) to its last line, blank lines
    and lines holding only a comment left out. A function nested in it counts in it."""
    body = function.body
    first = body[0] if body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        body = body[1:] if isinstance(first.value.value, str) else body
    if not body:
        return 0
    first, last = body[0].lineno, max(node.end_lineno or node.lineno for node in body)
    return sum(
        1 for line in lines[first - 1 : last] if line.strip() and not line.strip().startswith("#")
    )


def _too_long(source: str, name: str) -> list[str]:
    """What of the module ``name``, of text ``source``, is over the sizes of issue 37."""
    lines = source.splitlines()
    found = []
    if len(lines) > _MOST_MODULE_LINES:
        found.append(f"{name}: {len(lines)} lines")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            count = _code_lines(node, lines)
            if count > _MOST_FUNCTION_LINES:
                found.append(f"{name}:{node.lineno} {node.name}: {count} lines of code")
    return found


def test_no_module_or_function_is_too_long_to_read() -> None:
    too_long = []
    for path in sorted((ROOT / "autoloader").rglob("*.py")):
        too_long += _too_long(path.read_text(), path.relative_to(ROOT).as_posix())
    assert too_long == []


def test_the_size_check_finds_a_long_module_and_a_long_function() -> None:
    body = "".join(f"    x{i} = {i}  # a comment\n\n    # only a comment\n" for i in range(81))
    function = f'def f():\n    """A docstring\n    of two lines."""\n{body}'
    assert _too_long(function, "m") == ["m:1 f: 81 lines of code"]
    shorter = function.replace("    x80 = 80  # a comment\n", "")
    assert _too_long(shorter, "m") == []
    assert _too_long("x = 1\n" * 601, "m") == ["m: 601 lines"]
    assert _too_long("x = 1\n" * 600, "m") == []
