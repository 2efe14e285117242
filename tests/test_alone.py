"""The full suite runs two tests at a time (pytest-xdist, ``-n 2``); a test marked
``alone`` runs with no other beside it (``tests/conftest.py``). Checked with a real
pytest-xdist run of a few sleeping tests that write when they ran."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from itertools import combinations
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a pytest-xdist run of its own, two workers importing torch

ROOT = Path(__file__).resolve().parents[1]

_TESTS = """
import json, os, time
import pytest

def _ran(name, seconds):
    started = time.time()
    time.sleep(seconds)
    with open(os.environ["RAN"], "a") as out:
        out.write(json.dumps([name, started, time.time()]) + "\\n")

@pytest.mark.parametrize("n", range(6))
def test_shared(n):
    _ran(f"shared{n}", 0.4)

@pytest.mark.alone
@pytest.mark.parametrize("n", range(2))
def test_alone(n):
    _ran(f"alone{n}", 0.6)
"""


def test_an_alone_test_runs_with_no_other_beside_it_and_the_others_in_pairs(
    tmp_path: Path,
) -> None:
    (tmp_path / "conftest.py").write_text(
        "from tests.conftest import _room, alone_if_marked  # noqa: F401\n"
    )
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(_TESTS))
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\naddopts = --strict-markers\nmarkers =\n    alone: alone\n"
    )
    ran = tmp_path / "ran.jsonl"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
         "--basetemp", str(tmp_path / "temp"), str(tmp_path)],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "RAN": str(ran)},
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    spans = {
        name: (start, end) for name, start, end in map(json.loads, ran.read_text().splitlines())
    }
    assert len(spans) == 8, spans

    def overlap(a: str, b: str) -> bool:
        return spans[a][0] < spans[b][1] and spans[b][0] < spans[a][1]

    for a, b in combinations(spans, 2):
        if a.startswith("alone") or b.startswith("alone"):
            assert not overlap(a, b), (a, b, spans)
    # Without the lock's shared side, two workers: some shared tests ran side by side.
    shared = [name for name in spans if name.startswith("shared")]
    assert any(overlap(a, b) for a, b in combinations(shared, 2)), spans
