"""The full suite's timeline: when each test ran, on which pytest-xdist worker, at what CPU.

A pytest plugin and its summary. Run the suite with it (each worker appends one line a
test to ``$SUITE_TIMELINE/<worker>.tsv``), then summarise the folder::

    SUITE_TIMELINE=/tmp/timeline python -m pytest -p tools.suite_timeline -n 4 --dist worksteal
    python tools/suite_timeline.py /tmp/timeline

The summary says how long the run's phases took (the ``alone`` tests, run with no other
beside them, then the ``calm`` ones: docs/development/checks.md), how many workers ran
a test in each 30 s of the run, and the CPU the tests used in each minute (the worker's
and its reaped children's, ``getrusage``): where that stays under the machine's CPUs, the
order of the tests, not their work, sets the run's length.
"""

from __future__ import annotations

import collections
import os
import resource
import sys
import time
from collections.abc import Generator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

_MARKERS = ("alone", "calm", "late", "light", "paced", "slow")
_BUCKET = 30.0


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Generator[None, None, None]:
    folder = os.environ.get("SUITE_TIMELINE")
    if not folder:
        yield
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    started, cpu = time.time(), _cpu_seconds()
    yield
    ended, used = time.time(), _cpu_seconds() - cpu
    marks = ",".join(m for m in _MARKERS if item.get_closest_marker(m) is not None)
    Path(folder).mkdir(parents=True, exist_ok=True)
    with open(Path(folder) / f"{worker}.tsv", "a") as out:
        out.write(f"{worker}\t{started:.3f}\t{ended:.3f}\t{used:.2f}\t{marks}\t{item.nodeid}\n")


@dataclass(frozen=True, slots=True)
class Run:
    """One test's run: its worker, start and end (seconds from the first test's start),
    CPU seconds, markers and node id."""

    worker: str
    start: float
    end: float
    cpu: float
    marks: tuple[str, ...]
    test: str


def read(folder: Path) -> list[Run]:
    """Every test's run in ``folder``'s files, in the order they started."""
    rows = [
        line.rstrip("\n").split("\t")
        for path in sorted(folder.glob("*.tsv"))
        for line in path.read_text().splitlines()
    ]
    if not rows:
        raise SystemExit(f"no timeline in {folder}: run the suite with SUITE_TIMELINE={folder}")
    first = min(float(row[1]) for row in rows)
    runs = [
        Run(w, float(s) - first, float(e) - first, float(c), tuple(filter(None, m.split(","))), t)
        for w, s, e, c, m, t in rows
    ]
    return sorted(runs, key=lambda run: run.start)


def busy_workers(runs: Iterable[Run], bucket: float = _BUCKET) -> list[float]:
    """Workers running a test in each ``bucket`` seconds of the run, on average."""
    busy: dict[int, float] = collections.defaultdict(float)
    last = 0.0
    for run in runs:
        at, last = run.start, max(last, run.end)
        while at < run.end:
            index = int(at // bucket)
            upto = min(run.end, (index + 1) * bucket)
            busy[index] += upto - at
            at = upto
    return [busy[i] / bucket for i in range(int(last // bucket) + 1)]


def summary(runs: list[Run]) -> list[str]:
    """The run's phases, busy workers and CPU by minute, and its last tests, in lines."""
    span = max(run.end for run in runs)
    lines = [
        f"{len(runs)} tests in {span:.1f} s; {sum(r.cpu for r in runs):.0f} CPU s, "
        f"{sum(r.end - r.start for r in runs):.0f} s of tests"
    ]
    for mark in ("alone", "calm", "late"):
        marked = [run for run in runs if mark in run.marks]
        if marked:
            lines.append(
                f"{mark}: {len(marked)} tests, {sum(r.end - r.start for r in marked):.0f} s, "
                f"from {min(r.start for r in marked):.0f} s to {max(r.end for r in marked):.0f} s"
            )
    workers = " ".join(f"{n:.1f}" for n in busy_workers(runs))
    lines.append(f"workers busy, each {_BUCKET:.0f} s: {workers}")
    cpu: dict[int, float] = collections.defaultdict(float)
    for run in runs:
        cpu[int(run.start // 60)] += run.cpu
    minutes = " ".join(f"{cpu[m]:.0f}" for m in range(int(span // 60) + 1))
    lines.append(f"CPU s of the tests started in each minute: {minutes}")
    lines.append("the last to end:")
    for run in sorted(runs, key=lambda run: run.end)[-8:]:
        lines.append(
            f"  {run.worker} {run.start:6.0f} {run.end:6.0f} s {run.cpu:6.1f} CPU s  {run.test}"
        )
    return lines


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python tools/suite_timeline.py FOLDER")
    print("\n".join(summary(read(Path(sys.argv[1])))))
