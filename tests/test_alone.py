"""The full suite runs four workers (pytest-xdist, ``-n 4``) on the seats of
``tests/seats.py``: a test takes two of them, a ``light`` one one (two if ``paced``), a
``calm`` one all but two, an ``alone`` one all eight. Checked with a real pytest-xdist run
of a few sleeping tests that write when they ran."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from itertools import combinations
from pathlib import Path

import pytest

from tests import seats

pytestmark = pytest.mark.slow  # a pytest-xdist run of its own, four workers

ROOT = Path(__file__).resolve().parents[1]

_TESTS = """
import json, os, time
import pytest

def _ran(name, seconds):
    started = time.time()
    time.sleep(seconds)
    with open(os.environ["RAN"], "a") as out:
        out.write(json.dumps([name, started, time.time()]) + "\\n")

# First of the shared ones in each slice: waiting while the alone and calm tests run.
@pytest.mark.light
@pytest.mark.paced
@pytest.mark.parametrize("n", range(2))
def test_paced(n):
    _ran(f"paced{n}", 0.5)

@pytest.mark.parametrize("n", range(12))
def test_shared(n):
    _ran(f"shared{n}", 0.5)

@pytest.mark.light
@pytest.mark.parametrize("n", range(6))
def test_light(n):
    _ran(f"light{n}", 0.5)

@pytest.mark.calm
@pytest.mark.parametrize("n", range(3))
def test_calm(n):
    _ran(f"calm{n}", 0.5)

@pytest.mark.alone
@pytest.mark.parametrize("n", range(3))
def test_alone(n):
    _ran(f"alone{n}", 1.0)
"""

_SEATS = {
    "shared": 2, "light": 1, "paced": 2, "calm": seats.SEATS - 2, "alone": seats.SEATS
}  # fmt: skip


def _run_inner(tmp_path: Path) -> dict[str, tuple[float, float]]:
    # The full suite's workers take seconds to collect (torch), by which time all four
    # are up and worksteal hands each its slice; collected at once, the first two split
    # the run between them. A second's sleep stands in for torch.
    (tmp_path / "conftest.py").write_text(
        "import time\n"
        "from tests.seats import (  # noqa: F401\n"
        "    pytest_collection_modifyitems, pytest_runtest_protocol, pytest_sessionfinish,\n"
        "    pytest_sessionstart,\n)\n"
        "def pytest_collection_finish(session):\n"
        "    time.sleep(1.0)\n"
    )
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(_TESTS))
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\naddopts = --strict-markers\nmarkers =\n    alone: alone\n    light: light\n"
        "    calm: calm\n    paced: paced\n"
    )
    ran = tmp_path / "ran.jsonl"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "4",
         "--dist", "worksteal",
         "--timeout", "2.5", "--basetemp", str(tmp_path / "temp"), str(tmp_path)],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "RAN": str(ran)},
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = ran.read_text().splitlines()
    return {name: (start, end) for name, start, end in map(json.loads, lines)}


def test_tests_take_their_seats_and_the_alone_ones_run_with_no_other(tmp_path: Path) -> None:
    # Each test has 2.5 s (pytest-timeout), and the alone ones take 3 s together: the
    # others' wait for their seats is not counted in their time.
    spans = _run_inner(tmp_path)
    assert len(spans) == 26, spans

    def overlap(a: str, b: str) -> bool:
        return spans[a][0] < spans[b][1] and spans[b][0] < spans[a][1]

    def kind(name: str) -> str:
        return name.rstrip("0123456789")

    # An alone test beside no other; a calm one never beside another calm one (nor
    # beside more than one other test's seats: the count below).
    for a, b in combinations(spans, 2):
        if overlap(a, b) and "alone" in a + b:
            raise AssertionError(f"{a} ran beside {b}: {spans}")
        if overlap(a, b) and "calm" in a + b:
            assert kind(a) != kind(b), (a, b, spans)
    # At each start, the tests running then hold no more than the seats there are.
    most = 0
    for name, (start, _) in spans.items():
        running = [other for other, (s, e) in spans.items() if s <= start < e]
        held = sum(_SEATS[kind(other)] for other in running)
        assert held <= seats.SEATS, (name, running, spans)
        most = max(most, len(running))
    # Light tests side by side: more than the two that ordinary tests alone would allow.
    assert most >= 3, spans
    # The alone tests are collected first: the first two, on one worker, ran one after
    # the other with their seats kept, no test let in between.
    gap = (spans["alone0"][1], spans["alone1"][0])
    assert not any(gap[0] < start < gap[1] for start, _ in spans.values()), spans
    # The calm ones next, each waiting for its seats at the gate: taking seats as they
    # came free, they waited while the other workers took turns, to the end of the run.
    last_shared = max(spans[f"shared{n}"][0] for n in range(12))
    assert all(spans[f"calm{n}"][0] < last_shared for n in range(3)), spans
