"""A thread that computes on a CPU it shares with a busy process asks for the whole of
it: its run delay counts as CPU demand (NOTE [ CPU demand ])."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from time import perf_counter, thread_time

import psutil
import pytest

from autoloader.loader._params import normalize_params
from autoloader.measure import _cpu_demand
from autoloader.measure._cpu_demand import CpuDemand
from autoloader.measure._process_memory import tree_memory
from autoloader.measure._runner import TrialRunner

from .workloads import SleepDataset

pytestmark = pytest.mark.skipif(
    not os.path.exists(f"/proc/self/task/{os.getpid()}/schedstat"),
    reason="run delay is read from Linux's /proc/<pid>/task/<tid>/schedstat",
)

_BUSY = "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True: pass"


@contextlib.contextmanager
def _sharing_a_cpu() -> Iterator[None]:
    """This thread and a busy-loop process pinned to the same CPU."""
    affinity = os.sched_getaffinity(0)
    cpu = min(affinity)
    busy = subprocess.Popen([sys.executable, "-c", _BUSY, str(cpu)])
    try:
        os.sched_setaffinity(0, {cpu})
        # Until the busy loop runs: its interpreter started and pinned itself.
        watched = psutil.Process(busy.pid)
        while watched.cpu_affinity() != [cpu] or sum(watched.cpu_times()[:2]) < 0.05:
            time.sleep(0.01)
        yield
    finally:
        os.sched_setaffinity(0, affinity)
        busy.kill()
        busy.wait()


def _compute(seconds: float) -> None:
    until = perf_counter() + seconds
    while perf_counter() < until:
        pass


def test_a_thread_sharing_its_cpu_with_a_busy_process_demands_all_of_its_time() -> None:
    demand = CpuDemand()
    try:
        with _sharing_a_cpu():
            on_cpu = thread_time()
            start, process, own = demand.read()
            _compute(0.6)
            end, process_after, own_after = demand.read()
            on_cpu = thread_time() - on_cpu
    finally:
        demand.close()
    wall = end - start
    assert on_cpu < 0.8 * wall, "the busy process never took the CPU: nothing is measured"
    assert 0.9 * wall <= own_after - own <= 1.05 * wall
    assert process_after - process >= 0.9 * wall


def test_the_step_on_a_shared_cpu_is_measured_as_working_on_the_cpu() -> None:
    runner = TrialRunner(
        SleepDataset(64, latency=0.0),
        lambda batch: _compute(0.002),
        batch_size=4,
        memory_budget=tree_memory() + 2**31,
    )
    with _sharing_a_cpu():
        measured = runner.measure(normalize_params({"num_workers": 0}), max_seconds=1.5)
    assert measured.batches > 0
    # NOTE [ Step threads ]: a step on the CPU at least half of its time works there.
    assert measured.step_thread_cpu_seconds >= 0.85 * measured.step_seconds, measured
    assert measured.step_cpu_seconds >= 0.85 * measured.step_seconds, measured


def test_without_schedstat_the_demand_is_the_cpu_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_cpu_demand, "_TASKS", "/nonexistent")  # as on a system without it
    demand = CpuDemand()
    assert not demand.available
    on_cpu = thread_time()
    _compute(0.05)
    _, _, own = demand.read()
    assert on_cpu <= own <= thread_time()
    demand.close()


_PINNED_FOR = (
    "import os, sys, time; os.sched_setaffinity(0, {int(sys.argv[1])})\n"
    "until = time.perf_counter() + float(sys.argv[2])\n"
    "while time.perf_counter() < until: pass"
)


@pytest.mark.alone  # another test's processes on the shared CPU add run delay
def test_children_computing_on_one_shared_cpu_gather_the_run_delay_they_waited() -> None:
    """Two children started while it runs, each computing 0.6 s on the same CPU: each
    waits for it about half that time, runnable. A child started before is not
    counted, though it shares the CPU too."""
    cpu = min(os.sched_getaffinity(0))
    # This process, and a busy child started before.
    with _sharing_a_cpu(), _cpu_demand.ChildrenRunDelay(interval=0.02) as waited:
        started = perf_counter()
        children = [
            subprocess.Popen([sys.executable, "-c", _PINNED_FOR, str(cpu), "0.6"]) for _ in range(2)
        ]
        for child in children:
            child.wait()
        wall = perf_counter() - started
    # Three busy processes on one CPU for the children's 0.6 s each: they waited at
    # least as long as they ran, less the reads' interval and the start-up before it.
    assert waited.seconds >= 0.6, (waited.seconds, wall)
    assert waited.seconds <= 2 * wall
    with _cpu_demand.ChildrenRunDelay() as idle:
        subprocess.run([sys.executable, "-c", "import time; time.sleep(0.3)"], check=True)
    assert idle.seconds < 0.1
