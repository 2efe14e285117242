from __future__ import annotations

import gc
import multiprocessing.resource_tracker
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

import psutil
import pytest
import torch
from torch.utils.data._utils import signal_handling

from tests.lazy import LazyModule, imported

# Tests side by side under pytest-xdist, on seats (``tests/seats.py``, kept free of torch:
# ``tests/test_alone.py`` starts a pytest-xdist run of its own with these hooks).
from tests.seats import (  # noqa: F401
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_report_header,
    pytest_runtest_protocol,
    pytest_sessionfinish,
    pytest_sessionstart,
)

# The suite starts hundreds of Python processes that import autoloader (torchrun ranks
# and agents, the command line, the examples, spawned workers and trials) and four
# pytest-xdist workers that rewrite every test module's asserts. Where the environment
# says not to write bytecode (PYTHONDONTWRITEBYTECODE, as in many container images),
# each of them compiled those sources again: the workers and every process this
# session starts cache it, in the checkout's `__pycache__` folders (git ignores them),
# as Python does by default. Set here, as the controller loads this file, before it
# starts the workers, which inherit the environment.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# Spawning a process (isolation="subprocess", the spawn start method) starts the
# standard library's resource tracker once, for the rest of the test session: it is not
# something a test left behind.
multiprocessing.resource_tracker.ensure_running()


# The modules of tests.lazy.LazyModule (Lightning) that collecting imported: none should.
IMPORTED_AT_COLLECTION = pytest.StashKey[set[str]]()


def pytest_collection_finish(session: pytest.Session) -> None:
    session.config.stash[IMPORTED_AT_COLLECTION] = imported(LazyModule.names)


@pytest.fixture(autouse=True)
def no_leftover_processes() -> Iterator[None]:
    """Fail any test that leaves a child process (e.g. a DataLoader worker) behind."""
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    yield
    deadline = time.monotonic() + 10
    while True:
        left = [p for p in me.children(recursive=True) if p.pid not in before]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    described = [_describe(p) for p in left]
    for process in left:
        process.kill()
    assert not left, f"test left child processes behind: {described}"


# The iterators whose workers DataLoader's SIGCHLD handler checks, as tests register
# them (id -> pids): torch keeps this registry in C, out of sight.
_REGISTERED: dict[int, tuple[int, ...]] = {}


def _track_registered_workers() -> None:
    register, unregister = signal_handling._set_worker_pids, signal_handling._remove_worker_pids

    def set_worker_pids(key: int, pids: tuple[int, ...]) -> None:
        register(key, pids)
        _REGISTERED[key] = tuple(pids)

    def remove_worker_pids(key: int) -> None:
        unregister(key)
        _REGISTERED.pop(key, None)

    signal_handling._set_worker_pids = set_worker_pids
    signal_handling._remove_worker_pids = remove_worker_pids


_track_registered_workers()


@pytest.fixture(autouse=True)
def no_workers_left_registered() -> Iterator[None]:
    """Fail any test that leaves an iterator's workers registered with DataLoader's
    SIGCHLD handler, its shutdown skipped (NOTE [ Nothing left registered ]): once one of
    them has died, the next child to exit makes that handler raise "DataLoader worker
    (pid ...) is killed by signal" in whatever runs then, a later test's trial."""
    before = set(_REGISTERED)
    yield
    if set(_REGISTERED) - before:
        gc.collect()  # an iterator no longer referenced shuts down as it is freed
    left = {key: pids for key, pids in _REGISTERED.items() if key not in before}
    for key in left:
        signal_handling._remove_worker_pids(key)  # the tests after this one are spared
    assert not left, f"test left DataLoader workers registered: {sorted(left.values())}"


def _describe(process: psutil.Process) -> str:
    try:
        return f"{process.pid} {' '.join(process.cmdline())[:200]}"
    except psutil.Error:
        return str(process.pid)


@pytest.fixture(autouse=True)
def no_leftover_thread_workers() -> Iterator[None]:
    """Fail any test that leaves a ThreadLoader's worker thread, a memory watch or a
    study's heartbeat running (NOTE [ Nothing outlives the loop ])."""
    yield
    deadline = time.monotonic() + 10
    while True:
        left = [t.name for t in threading.enumerate() if t.name.startswith(_LEFT_RUNNING)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not left, f"test left threads running: {left}"


_LEFT_RUNNING = ("autoloader-thread-worker-", "autoloader-memory", "autoloader-heartbeat")


@pytest.fixture(autouse=True)
def torch_threads_as_found() -> Iterator[None]:
    """Fail any test that leaves this process's torch threads changed: tune() puts back
    what its trials set (NOTE [ Step threads ]), and a test that applies them on purpose
    puts them back too."""
    before = torch.get_num_threads()
    yield
    after = torch.get_num_threads()
    torch.set_num_threads(before)
    assert after == before, f"test left torch's threads at {after}, not {before}"


@pytest.fixture
def ctrl_c_raises() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt here, as in a terminal: a job started in the
    background by a shell (`cmd &`), and pytest-xdist's workers, ignore it, and Python
    then installs no handler of its own (`signal.raise_signal` did nothing)."""
    found = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, found)
