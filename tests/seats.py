"""The seats of the full suite's pytest-xdist run: how many tests run side by side,
which run alone, and which first and last. Hooks for ``tests/conftest.py``; no torch
here, so that the pytest-xdist run of ``tests/test_alone.py`` starts its workers
cheaply."""

from __future__ import annotations

import fcntl
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

# Tests side by side (the full suite runs under pytest-xdist, `-n 4`). The workers share
# eight seats: a test takes two, so that all four workers run one at once on the two
# cores here (most tests wait on their trials' workers part of the time: three at once
# left 0.3-0.5 of a core idle); a test marked `light` (it mostly waits: on sleeps, a
# subprocess's deadline, a hang's timeout) takes one, unless also `paced` (its verdict
# rests on a pace it measures), which takes two; a test marked `calm` (its verdict needs
# a trial's workers to start and deliver within a short budget, or it holds a deadline)
# takes all but two: it runs beside one other test, or two light ones, never beside
# another `calm` one; a test marked `alone` (it measures the machine, or a light
# neighbour broke it, or two busy ones) takes all eight (beside a light one, diagnose()
# tests failed twice in five full runs: docs/development/checks.md). Quiet, the same
# code took 660 s on six seats (three tests at once, a `calm` one beside a light one at
# most) and 640 s on eight; 600 s with a `calm` one beside one other (and 16 s less of
# `alone` tests). The `alone` tests are collected first, together, then the `calm`
# ones, the slow tests first in each group, and one followed by another on the same
# worker keeps its seats: the others wait once for the run of them, not once for each.
# While an `alone` or a `calm` test waits for its seats it holds a gate that the others
# pass to take theirs, so none comes in first: taking seats as they came free, `calm`
# tests waited up to 273 s while the others took turns, two of the four workers idle
# for the last third of a run. But not while another `alone` or `calm` test is seated
# (it holds `seats.gated`, shared): the seats it waits for are that test's, and the
# others take the seats left beside it meanwhile. Holding the gate then, a `late` calm
# test waiting for the calm ones' chain left two seats unused for 70 s, three workers
# idle (a quiet full run, 2026-11-29).
# Seats are taken before pytest-timeout's clock starts: the wait is not the test's time.
# The files are in the run's temporary directory, which every worker shares.
# The seats are the CPUs the suite has: where other processes held CPUs as the run
# began (a busy loop beside it, a build), each test takes its seats times the CPUs over
# those left free (`seats_scale`), so that it keeps the share of a CPU it has on a quiet
# machine and the tests that hold a short budget their neighbours' count (two ordinary
# tests at once beside one busy loop on two cores, each `calm` test alone).
# `SUITE_CPUS_TAKEN` (CPUs) says it instead of the reading: `0` seats a quiet run.
SEATS = 8
TAKEN = "SUITE_CPUS_TAKEN"
_READING_SECONDS = 1.0
_LEAST_TAKEN = 0.5  # a machine's daemons, a shell: below this, the run is quiet
_ORDINARY = 2
# `paced` before `light`: a light test whose verdict rests on a pace it measures takes
# two seats, as an ordinary test does (a light one that compares a reused setting's
# loading speed with the tuned one failed beside an `alone` one and a busy loop).
_NEEDED = {"alone": SEATS, "calm": SEATS - _ORDINARY, "paced": _ORDINARY, "light": 1}
_GATED = _NEEDED["calm"]  # tests needing this many seats or more wait for them at the gate


class _Seats:
    """The seats of a pytest-xdist run: ``flock``-ed files."""

    def __init__(self, folder: Path, scale: float = 1.0) -> None:
        self.scale = scale
        self.gate = os.open(folder / "seats.gate", os.O_CREAT | os.O_RDWR, 0o600)
        self.gated = os.open(folder / "seats.gated", os.O_CREAT | os.O_RDWR, 0o600)
        self.seats = [
            os.open(folder / f"seat{n}", os.O_CREAT | os.O_RDWR, 0o600) for n in range(SEATS)
        ]
        self.held: list[int] = []

    def needed(self, item: pytest.Item) -> int:
        seats = next(
            (n for marker, n in _NEEDED.items() if item.get_closest_marker(marker) is not None),
            _ORDINARY,
        )
        return min(SEATS, math.ceil(seats * self.scale - 1e-9))

    def take(self, item: pytest.Item) -> None:
        """Wait for ``item``'s seats, unless they are held on from the test before."""
        count = self.needed(item)
        if len(self.held) == count:
            return
        self.give_back()  # held on for an `alone` test that another worker took
        gated = count >= _GATED
        while True:
            fcntl.flock(self.gate, fcntl.LOCK_EX)
            try:
                while not self._try(count) and gated and not self._gated_elsewhere():
                    time.sleep(0.02)  # an `alone` or `calm` test waits at the gate
                if self.held:
                    if gated:  # taken before the gate is let go: no waiter misses it
                        fcntl.flock(self.gated, fcntl.LOCK_SH)
                    return
            finally:
                fcntl.flock(self.gate, fcntl.LOCK_UN)
            time.sleep(0.02)  # the others pass it, and ask again

    def _gated_elsewhere(self) -> bool:
        """Whether another worker's `alone` or `calm` test is seated."""
        try:
            fcntl.flock(self.gated, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(self.gated, fcntl.LOCK_UN)
        return False

    def _try(self, count: int) -> bool:
        for seat in self.seats:
            if len(self.held) == count:
                break
            try:
                fcntl.flock(seat, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            self.held.append(seat)
        if len(self.held) == count:
            return True
        self.give_back()  # all or none: a half-seated test would hold the others back
        return False

    def leave(self, item: pytest.Item, nextitem: pytest.Item | None) -> None:
        if nextitem is None or self.needed(nextitem) < _GATED:
            self.give_back()
        else:  # `alone` or `calm` next: keep what it needs (take() waits for the rest)
            while len(self.held) > self.needed(nextitem):
                fcntl.flock(self.held.pop(), fcntl.LOCK_UN)

    def give_back(self) -> None:
        for seat in self.held:
            fcntl.flock(seat, fcntl.LOCK_UN)
        self.held = []
        fcntl.flock(self.gated, fcntl.LOCK_UN)

    def close(self) -> None:
        for fd in (self.gate, self.gated, *self.seats):
            os.close(fd)


def _is_alone(item: pytest.Item) -> bool:
    return item.get_closest_marker("alone") is not None


def _is_calm(item: pytest.Item) -> bool:
    return item.get_closest_marker("calm") is not None


def _is_late(item: pytest.Item) -> bool:
    return item.get_closest_marker("late") is not None


_SEATS = pytest.StashKey[_Seats]()


def seats_scale(taken: float, cpus: int, machine: int | None = None) -> float:
    """How many times its quiet seats a test takes where other processes held ``taken``
    CPUs of the ``machine``'s (``cpus`` when not given) as the run began, the run's
    ``cpus`` of them: its CPUs over those left free (one at least). In a container whose
    machine has more CPUs than its affinity, others run on the rest first."""
    free = min(float(cpus), (machine or cpus) - taken)
    if taken < _LEAST_TAKEN or free >= cpus:
        return 1.0
    return cpus / max(1.0, free)


def run_cpus() -> tuple[int, int]:
    """The CPUs this run may use (its affinity) and the machine's."""
    cpus = len(os.sched_getaffinity(0))
    return cpus, max(cpus, psutil.cpu_count() or cpus)


def cpus_taken(seconds: float = _READING_SECONDS) -> float:
    """CPUs other processes than this one used over ``seconds``, on average: the
    machine's busy time (a hypervisor's stolen time included) less this process's."""
    me = psutil.Process()
    machine, own, started = _busy_seconds(), _cpu_seconds(me), time.perf_counter()
    time.sleep(seconds)
    wall = time.perf_counter() - started
    others = (_busy_seconds() - machine) - (_cpu_seconds(me) - own)
    return max(0.0, others / wall)


def _busy_seconds() -> float:
    times = psutil.cpu_times()
    idle = sum(getattr(times, name, 0.0) for name in ("idle", "iowait", "guest", "guest_nice"))
    return float(sum(times) - idle)


def _cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system + times.children_user + times.children_system)


def pytest_configure(config: pytest.Config) -> None:
    """In a pytest-xdist run's controller, before its workers start (they inherit the
    environment): how many CPUs other processes hold, unless ``SUITE_CPUS_TAKEN``
    says."""
    workers = getattr(config.option, "numprocesses", None)
    if "PYTEST_XDIST_WORKER" in os.environ or not workers or TAKEN in os.environ:
        return
    os.environ[TAKEN] = f"{cpus_taken():.2f}"


def pytest_sessionstart(session: pytest.Session) -> None:
    if "PYTEST_XDIST_WORKER" in os.environ:
        temporary = session.config._tmp_path_factory  # type: ignore[attr-defined]
        folder = temporary.getbasetemp().parent  # pytest-N, above popen-gwN
        taken = float(os.environ.get(TAKEN, "0"))
        session.config.stash[_SEATS] = _Seats(folder, seats_scale(taken, *run_cpus()))


def pytest_report_header(config: pytest.Config) -> str | None:
    """The CPUs other processes held as the run began, and what the tests take for it."""
    if TAKEN not in os.environ or "PYTEST_XDIST_WORKER" in os.environ:
        return None
    taken = float(os.environ[TAKEN])
    scale = seats_scale(taken, *run_cpus())
    if scale == 1.0:
        return f"seats: other processes held {taken:.2f} CPUs as the run began: quiet"
    return (
        f"seats: other processes held {taken:.2f} CPUs as the run began: each test takes "
        f"{scale:.2f}x its seats (tests/seats.py)"
    )


def pytest_sessionfinish(session: pytest.Session) -> None:
    seats = session.config.stash.get(_SEATS, None)
    if seats is not None:
        seats.close()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist, the `alone` tests first, then the `calm` ones, and the
    `late` ones last (their `calm` ones first), the `slow` ones before the others in
    each group (`_later`), each in their order. A `late` test
    imports Lightning, which stays in its worker: every DataLoader worker forked there
    after it costs twice the CPU (``tests/lazy.py``), and the workers take the
    collection's last tests last (``--dist worksteal`` hands each a slice of it in
    order, and the idle ones take from the end of the others'). Where the tests that
    need nearly every seat are last, the run ends with one of them at a time."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        items.sort(key=lambda item: (not _is_alone(item), _is_late(item), *_later(item)))


def _later(item: pytest.Item) -> tuple[bool, bool]:
    """Within a group, `calm` tests first, then the `slow` ones: the run ends with
    short tests on every worker, not with one long test on one."""
    return not _is_calm(item), item.get_closest_marker("slow") is None


@pytest.hookimpl(wrapper=True, tryfirst=True)  # around pytest-timeout's
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    seats = item.config.stash.get(_SEATS, None)
    if seats is None:
        return (yield)
    seats.take(item)
    try:
        return (yield)
    finally:
        seats.leave(item, nextitem)  # `nextitem`: what this worker runs next, unless stolen
