"""The full suite runs four workers (pytest-xdist, ``-n 4``) on the seats of
``tests/seats.py``: a test takes two of them, a ``light`` one one (two if ``paced``), a
``calm`` one all but two, an ``alone`` one all eight. Checked with a real pytest-xdist run
of a few sleeping tests that write when they ran."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
import threading
import time
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


def _run_inner(tmp_path: Path, *, taken: str = "0") -> dict[str, tuple[float, float]]:
    # The full suite's workers take seconds to collect (torch), by which time all four
    # are up and worksteal hands each its slice; collected at once, the first two split
    # the run between them. A second's sleep stands in for torch.
    (tmp_path / "conftest.py").write_text(
        "import time\n"
        "from tests.seats import (  # noqa: F401\n"
        "    pytest_collection_modifyitems, pytest_configure, pytest_runtest_protocol,\n"
        "    pytest_sessionfinish, pytest_sessionstart,\n)\n"
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
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "RAN": str(ran), seats.TAKEN: taken},
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = ran.read_text().splitlines()
    return {name: (start, end) for name, start, end in map(json.loads, lines)}


def _kind(name: str) -> str:
    return name.rstrip("0123456789")


def _most_at_once(spans: dict[str, tuple[float, float]], seats_of: dict[str, int]) -> int:
    """The most tests running at once, each start checked to find the tests running
    then holding no more than the seats there are."""
    most = 0
    for name, (start, _) in spans.items():
        running = [other for other, (s, e) in spans.items() if s <= start < e]
        held = sum(seats_of[_kind(other)] for other in running)
        assert held <= seats.SEATS, (name, running, spans)
        most = max(most, len(running))
    return most


def test_tests_take_their_seats_and_the_alone_ones_run_with_no_other(tmp_path: Path) -> None:
    # Each test has 2.5 s (pytest-timeout), and the alone ones take 3 s together: the
    # others' wait for their seats is not counted in their time.
    spans = _run_inner(tmp_path)
    assert len(spans) == 26, spans

    def overlap(a: str, b: str) -> bool:
        return spans[a][0] < spans[b][1] and spans[b][0] < spans[a][1]

    # An alone test beside no other; a calm one never beside another calm one (nor
    # beside more than one other test's seats: the count below).
    for a, b in combinations(spans, 2):
        if overlap(a, b) and "alone" in a + b:
            raise AssertionError(f"{a} ran beside {b}: {spans}")
        if overlap(a, b) and "calm" in a + b:
            assert _kind(a) != _kind(b), (a, b, spans)
    # At each start, the tests running then hold no more than the seats there are.
    most = _most_at_once(spans, _SEATS)
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


class _Item:
    """A test's markers, as the seats ask for them."""

    def __init__(self, *markers: str) -> None:
        self.markers = markers

    def get_closest_marker(self, name: str) -> str | None:
        return name if name in self.markers else None


def _take_in_thread(held: seats._Seats, item: _Item) -> threading.Event:
    seated = threading.Event()

    def take() -> None:
        held.take(item)  # type: ignore[arg-type]
        seated.set()

    threading.Thread(target=take, daemon=True).start()
    return seated


def test_a_calm_test_waiting_for_another_leaves_the_seats_beside_it_to_the_others(
    tmp_path: Path,
) -> None:
    """Waiting while another calm test is seated, a calm test does not hold the gate:
    an ordinary test takes the two seats left beside the first (before, it waited for
    the first to end), and the waiting one is seated as the first gives its seats back."""
    first, waiting, other = (seats._Seats(tmp_path) for _ in range(3))
    try:
        first.take(_Item("calm"))  # type: ignore[arg-type]
        calm = _take_in_thread(waiting, _Item("calm"))
        time.sleep(0.5)  # at the gate
        assert not calm.is_set()
        assert _take_in_thread(other, _Item()).wait(5), "the waiting calm test held the gate"
        assert len(other.held) == 2
        first.give_back()
        assert calm.wait(5)
        assert len(waiting.held) == seats.SEATS - 2
    finally:
        for held in (first, waiting, other):
            held.give_back()
            held.close()  # a thread still waiting fails on its closed files, and ends


def test_beside_a_busy_cpu_each_test_takes_its_seats_times_the_cpus_over_those_free(
    tmp_path: Path,
) -> None:
    """Other processes held a CPU as the run began (``SUITE_CPUS_TAKEN=1``): on two
    CPUs, a test takes twice its seats, so two ordinary tests run at once at most and
    a ``calm`` one beside none, each keeping the share of a CPU it has when quiet."""
    cpus, machine = seats.run_cpus()
    scale = seats.seats_scale(1.0, cpus, machine)
    scaled = {kind: min(seats.SEATS, math.ceil(n * scale)) for kind, n in _SEATS.items()}
    spans = _run_inner(tmp_path, taken="1")
    assert len(spans) == 26, spans
    _most_at_once(spans, scaled)
    if (cpus, machine) == (2, 2):
        assert scaled == {"shared": 4, "light": 2, "paced": 4, "calm": 8, "alone": 8}
        for a, b in combinations(spans, 2):
            overlap = spans[a][0] < spans[b][1] and spans[b][0] < spans[a][1]
            assert not (overlap and "calm" in a + b), (a, b, spans)


@pytest.mark.parametrize(
    ("taken", "cpus", "machine", "scale"),
    [
        (0.0, 2, 2, 1.0),
        (0.4, 2, 2, 1.0),  # a machine's daemons
        (1.0, 2, 2, 2.0),  # one busy loop: twice the seats
        (0.6, 2, 2, 2 / 1.4),
        (3.0, 2, 2, 2.0),  # one CPU at least
        (1.0, 8, 8, 8 / 7),
        (30.0, 2, 64, 1.0),  # a container's two CPUs on a machine of 64, half of it busy
        (63.0, 2, 64, 2.0),
    ],
)
def test_the_seats_scale_by_the_cpus_over_those_left_free(
    taken: float, cpus: int, machine: int, scale: float
) -> None:
    assert seats.seats_scale(taken, cpus, machine) == pytest.approx(scale)


def test_the_cpus_taken_count_another_process_busy_beside_this_one() -> None:
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # started: its interpreter's start-up done
        assert seats.cpus_taken(0.5) >= 0.5  # its CPU, whoever else ran (a lower bound)
    finally:
        busy.kill()
        busy.wait()
