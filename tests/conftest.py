from __future__ import annotations

import fcntl
import multiprocessing.resource_tracker
import os
import signal
import threading
import time
from collections.abc import Iterator

import psutil
import pytest
import torch

# Spawning a process (isolation="subprocess", the spawn start method) starts the
# standard library's resource tracker once, for the rest of the test session: it is not
# something a test left behind.
multiprocessing.resource_tracker.ensure_running()


# Tests side by side (the full suite runs under pytest-xdist, `-n 2`): a test marked
# `alone` measures the machine, or holds a deadline that another test's processes on the
# same cores could break, and runs with no other test beside it. Every test holds the
# room, shared or, marked `alone`, exclusive; each passes the gate to ask for it, and an
# `alone` test holds the gate while it waits, so that no shared holder comes in after it.
# The files are in the run's temporary directory, which every worker shares.


@pytest.fixture(scope="session")
def _room(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, int] | None]:
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield None
        return
    shared = tmp_path_factory.getbasetemp().parent  # pytest-N, above popen-gwN
    gate = os.open(shared / "alone.gate", os.O_CREAT | os.O_RDWR, 0o600)
    room = os.open(shared / "alone.room", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        yield gate, room
    finally:
        os.close(gate)
        os.close(room)


@pytest.fixture(autouse=True)
def alone_if_marked(
    request: pytest.FixtureRequest, _room: tuple[int, int] | None
) -> Iterator[None]:
    """Under pytest-xdist, a test marked ``alone`` waits until no other test runs, and
    no other test starts until it ends; elsewhere nothing."""
    if _room is None:
        yield
        return
    gate, room = _room
    alone = request.node.get_closest_marker("alone") is not None
    fcntl.flock(gate, fcntl.LOCK_EX)
    try:
        fcntl.flock(room, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
    finally:
        fcntl.flock(gate, fcntl.LOCK_UN)
    try:
        yield
    finally:
        fcntl.flock(room, fcntl.LOCK_UN)


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
