"""A forked worker does not outlive the process that started it, whenever that process
dies (NOTE [ A worker whose parent died as it started ]): a real process is started,
its loader's worker held at a point of its start-up, the process SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.workloads import ended

_ROOT = Path(__file__).resolve().parents[1]

# The process stands in for a torchrun rank: its loader's one worker writes its pid to
# STARTED at the point named, then sleeps 2 s there.
_PROCESS = """
import os, sys, time
sys.path.insert(0, {root!r})
import torch
from torch.utils.data import IterableDataset
from autoloader.loader import build_loader, merge_loader_kwargs
from tests.workloads import SleepDataset

def hold(where):
    with open({started!r}, "w") as file:
        file.write(str(os.getpid()))
    time.sleep(2)

class HeldAsItBegins(IterableDataset):
    def __iter__(self):
        hold("iter")
        return iter(range(64))

def slow_init(worker_id):
    hold("init")

if {where!r} == "init":
    dataset, fixed = SleepDataset(64), {{"worker_init_fn": slow_init}}
else:
    dataset, fixed = HeldAsItBegins(), {{}}
options = merge_loader_kwargs({{"num_workers": 1}}, batch_size=4, fixed=fixed)
next(iter(build_loader(dataset, options)))
"""


@pytest.mark.parametrize(
    "where",
    [
        # In the user's worker_init_fn: the worker finds its parent gone after it.
        "init",
        # Past worker_init_fn, as torch makes the fetcher (an iterable dataset's iter()),
        # before its watchdog reads the parent's pid: the kernel kills the worker.
        "iter",
    ],
)
def test_a_worker_whose_process_is_killed_as_it_starts_exits(tmp_path: Path, where: str) -> None:
    started = tmp_path / "worker"
    script = _PROCESS.format(root=str(_ROOT), started=str(started), where=where)
    process = subprocess.Popen([sys.executable, "-c", script])
    worker = 0
    try:
        deadline = time.monotonic() + 60
        while not (started.exists() and started.read_text()) and time.monotonic() < deadline:
            assert process.poll() is None, "the process ended before its worker started"
            time.sleep(0.02)
        worker = int(started.read_text())
        process.kill()
        process.wait()
        # Its worker sleeps 2 s more where it was held; torch's watchdog, had it read
        # init's pid as its parent's, would wait on for ever.
        assert ended(worker, within=10), f"worker {worker} still runs, its parent gone"
    finally:
        process.kill()
        process.wait()
        if worker and psutil.pid_exists(worker):
            os.kill(worker, signal.SIGKILL)


_FORKED = """
import ctypes, os, sys, threading
sys.path.insert(0, {root!r})
from autoloader.loader._worker_process import _die_with_parent

def fork_and_report(name):
    pid = os.fork()
    if pid == 0:
        armed = _die_with_parent()
        signal = ctypes.c_int(-1)
        ctypes.CDLL(None).prctl(2, ctypes.byref(signal), 0, 0, 0)  # PR_GET_PDEATHSIG
        print(name, armed, signal.value, flush=True)
        os._exit(0)
    os.waitpid(pid, 0)

fork_and_report("main")
thread = threading.Thread(target=fork_and_report, args=("thread",))
thread.start()
thread.join()
"""


@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(2) is Linux's")
def test_only_a_worker_forked_from_the_main_thread_dies_with_its_parent() -> None:
    """The kernel's signal comes when the forking thread ends: a worker forked from a
    thread of the user's that ends before the process must not get it."""
    done = subprocess.run(
        [sys.executable, "-c", _FORKED.format(root=str(_ROOT))],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == [f"main True {int(signal.SIGKILL)}", "thread False 0"]
