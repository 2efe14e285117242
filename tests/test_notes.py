"""The design notes (blocks that open with ``# NOTE [`` and a title, as torch.utils.data
writes them): each defined once, each reference to one that exists, and the NOTE index
(docs/development/notes.md) listing every one at the module that holds it."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A note's own block: the title alone on its line, in a comment or a docstring.
_DEFINITION = re.compile(r"^\s*(?:# )?NOTE \[ (.+?) \]\s*$", re.MULTILINE)
_REFERENCE = re.compile(r"NOTE \[ (.+?) \]")
# The index: one row a note, "| Title | `path` |".
INDEX = ROOT / "docs" / "development" / "notes.md"
_INDEX_ROW = re.compile(r"^\| (.+?) \| `(autoloader/[^`]+)` \|$", re.MULTILINE)


def _sources() -> dict[str, str]:
    return {
        path.relative_to(ROOT).as_posix(): path.read_text()
        for path in sorted((ROOT / "autoloader").rglob("*.py"))
    }


def _definitions() -> list[tuple[str, str]]:
    return [
        (title, path) for path, text in _sources().items() for title in _DEFINITION.findall(text)
    ]


def test_each_note_is_defined_once() -> None:
    counts = Counter(title for title, _ in _definitions())
    assert not [title for title, n in counts.items() if n > 1]


def test_each_reference_names_a_note_that_exists() -> None:
    defined = {title for title, _ in _definitions()}
    texts = [*_sources().values(), (ROOT / "README.md").read_text()]
    texts += [p.read_text() for p in sorted((ROOT / "docs").rglob("*.md"))]
    texts += [p.read_text() for p in sorted((ROOT / "tests").glob("*.py"))]
    texts += [p.read_text() for p in sorted((ROOT / "benchmarks").glob("*.py"))]
    referenced = {title for text in texts for title in _REFERENCE.findall(text)}
    assert sorted(referenced - defined) == []


def test_the_index_lists_every_note_where_it_is() -> None:
    index = _INDEX_ROW.findall(INDEX.read_text())
    rewrite = "python tools/regen_notes.py writes the index again from the code"
    assert sorted(index) == sorted(_definitions()), rewrite
    titles = [title for title, _ in index]
    assert titles == sorted(titles, key=str.casefold), rewrite
