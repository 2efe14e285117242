"""The documentation site (mkdocs.yml, docs/): it builds with every warning an error, and
its API reference documents every public name and the command line's help."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import autoloader

ROOT = Path(__file__).resolve().parents[1]
# The framework adapters, each a public module of its own outside autoloader.__all__.
ADAPTERS = ("lightning", "transformers", "accelerate")
# A mkdocstrings directive: "::: autoloader.name" on its own line.
_DIRECTIVE = re.compile(r"^::: (\S+)\s*$", re.MULTILINE)


def _public_names() -> set[str]:
    names = {f"autoloader.{name}" for name in autoloader.__all__}
    for adapter in ADAPTERS:
        # Read, not imported: importing the module imports its framework.
        tree = ast.parse((ROOT / "autoloader" / f"{adapter}.py").read_text())
        exported = next(
            node.value
            for node in tree.body
            if isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
        )
        names |= {f"autoloader.{adapter}.{name}" for name in ast.literal_eval(exported)}
    return names


def test_the_reference_documents_every_public_name() -> None:
    documented = [
        name
        for page in sorted((ROOT / "docs" / "reference").glob("*.md"))
        for name in _DIRECTIVE.findall(page.read_text())
    ]
    assert sorted(set(documented)) == sorted(_public_names())
    assert len(documented) == len(set(documented)), "a name documented twice"


@pytest.mark.slow
def test_the_site_builds_with_warnings_as_errors(tmp_path: Path) -> None:
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    pages = "".join(p.read_text() for p in (site / "reference").rglob("*.html"))
    # Each public name rendered from its docstring, under its own anchor.
    assert sorted(n for n in _public_names() if f'id="{n}"' not in pages) == []
    # The command line's help, made from its parser when the site was built.
    cli = (site / "reference" / "cli" / "index.html").read_text()
    for command in ("", " tune", " show", " plot", " demo"):
        assert f"usage: autoloader{command} [-h]" in cli
    assert "--memory-budget SIZE" in cli
