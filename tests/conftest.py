from __future__ import annotations

import multiprocessing.resource_tracker
import signal
import threading
import time
from collections.abc import Iterator

import psutil
import pytest
import torch

from tests.lazy import LazyModule, imported

# Tests side by side under pytest-xdist, on seats (``tests/seats.py``, kept free of torch:
# ``tests/test_alone.py`` starts a pytest-xdist run of its own with these hooks).
from tests.seats import (  # noqa: F401
    pytest_collection_modifyitems,
    pytest_runtest_protocol,
    pytest_sessionfinish,
    pytest_sessionstart,
)

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
