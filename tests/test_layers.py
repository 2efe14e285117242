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
