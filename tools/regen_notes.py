"""Write the NOTE index (docs/development/notes.md) again from the code.

Every design note, a block that opens with ``# NOTE [`` and its title (or such a
paragraph of a module's docstring), one row a note with the module that defines it,
sorted by title without regard to case: the table ``tests/test_notes.py`` checks.
Run it after adding, renaming or moving a note: ``python tools/regen_notes.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INDEX = ROOT / "docs" / "development" / "notes.md"
# The same definition tests/test_notes.py reads: the title alone on its line.
_DEFINITION = re.compile(r"^\s*(?:# )?NOTE \[ (.+?) \]\s*$", re.MULTILINE)
_TABLE = re.compile(r"\| Note \| Where \|\n\|---\|---\|\n(?:\|.*\|\n)+")


def table() -> str:
    rows = sorted(
        (
            (title, path.relative_to(ROOT).as_posix())
            for path in sorted((ROOT / "autoloader").rglob("*.py"))
            for title in _DEFINITION.findall(path.read_text())
        ),
        key=lambda row: row[0].casefold(),
    )
    lines = ["| Note | Where |", "|---|---|", *(f"| {t} | `{p}` |" for t, p in rows)]
    return "\n".join(lines) + "\n"


def main() -> None:
    text = INDEX.read_text()
    if not _TABLE.search(text):
        raise SystemExit(f"{INDEX} has no '| Note | Where |' table to replace")
    INDEX.write_text(_TABLE.sub(lambda _: table(), text, count=1))
    print(f"wrote {INDEX.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
