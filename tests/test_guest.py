"""autoloader is a guest in the training process: it acts only on the workers it started
(NOTE [ Only the trial's own processes ]) and leaves nothing running once the loop is
done with it (NOTE [ Nothing outlives the loop ], NOTE [ Handlers put back ])."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from torch.utils.data import DataLoader

import autoloader
from autoloader import AutoLoader
from autoloader.loader._torch_compat import shutdown_workers
from autoloader.measure._memory import MemoryWatch
from autoloader.measure._process_memory import tree_memory
from autoloader.measure._supervision import WorkerDeaths
from tests.workloads import SleepDataset

_ROOT = Path(__file__).resolve().parents[1]


def _sleeper() -> subprocess.Popen[bytes]:
    """A child of the user's: an uploader, a logger, an evaluation job."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


@pytest.fixture
def users_child() -> Iterator[list[subprocess.Popen[bytes]]]:
    """The user's children a test starts, killed at its end whatever happened."""
    children: list[subprocess.Popen[bytes]] = []
    yield children
    for child in children:
        child.kill()
        child.wait()


def _autoloader_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("autoloader-")]


def _handlers() -> tuple[Any, Any]:
    return signal.getsignal(signal.SIGCHLD), signal.getsignal(signal.SIGALRM)


def _workers_left(before: set[int], *, wait: bool = True) -> list[int]:
    """Children of this process that were not there ``before``, after a moment to exit."""
    deadline = time.monotonic() + (5 if wait else 0)
    while True:
        left = [p.pid for p in psutil.Process().children() if p.pid not in before]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


# Only the trial's own processes ---------------------------------------------------------


@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_a_child_the_loop_starts_while_autoloader_tunes_is_left_alone(
    users_child: list[subprocess.Popen[bytes]],
) -> None:
    """A process the training loop starts during tuning keeps running through the
    switches of settings that follow: never killed, never reaped behind its Popen."""
    loader = AutoLoader(
        SleepDataset(length=2000, latency=0.001),
        batch_size=8,
        # Two settings with workers or more: 5 s measured one beside a busy loop (CI's pace).
        time_budget=8,
        search_space={"num_workers": (1, 3), "worker_kind": ("processes",)},
        verbose=False,
    )
    try:
        for _ in range(20):
            for _ in loader:
                if not users_child:
                    users_child.append(_sleeper())
                assert users_child[0].poll() is None, f"after {len(loader.history)} trials"
                time.sleep(0.002)
            if loader.tuned:
                break
    finally:
        loader.close()
    ended = [(t.params["num_workers"], t.state) for t in loader.history]
    assert sum(workers > 0 for workers, _ in ended) >= 2, ended  # switches from workers
    assert users_child[0].poll() is None
    # Still this process's child, running: nobody reaped it behind its Popen's back.
    assert os.waitpid(users_child[0].pid, os.WNOHANG) == (0, 0)


class _UsersChildEndsAsWorkersStart(torch.utils.data.Sampler[int]):
    """A sampler whose iterator, drawn as the loader's workers start, waits for a child of
    the user's that exits: its SIGCHLD lands while the trial's loader is starting."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[int]:
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        return iter(range(self.length))


def test_a_users_child_ending_as_a_trials_workers_start_fails_nothing() -> None:
    """The SIGCHLD of a child that is not the trial's, held back while its loader's
    workers start, is checked against the trial's workers: all alive, the trial loads
    on (it used to shut its healthy workers down, and its first fetch then waited ten
    seconds for a hang deadline)."""
    dataset = SleepDataset(length=64, latency=0.0)
    loader = DataLoader(
        dataset, batch_size=8, num_workers=2, sampler=_UsersChildEndsAsWorkersStart(64), timeout=20
    )
    deaths = WorkerDeaths(MemoryWatch(1 << 62), defer=True)
    with deaths.handled():
        iterator = deaths.start(loader)
        try:
            with deaths.fetching():
                batches = [batch for batch in iterator]
        finally:
            shutdown_workers(iterator, loader)
    assert len(batches) == 8


def _start_a_child_once(children: list[subprocess.Popen[bytes]]) -> Any:
    def step(batch: Any) -> None:
        if not children:
            children.append(_sleeper())
        time.sleep(0.002)

    return step


def test_a_child_the_step_starts_in_a_trial_of_tune_is_left_alone(
    users_child: list[subprocess.Popen[bytes]],
) -> None:
    result = autoloader.tune(
        SleepDataset(length=256, latency=0.001),
        _start_a_child_once(users_child),
        batch_size=8,
        time_budget=3,
        search_space={"num_workers": (1, 2), "worker_kind": ("processes",)},
        show_progress=False,
    )
    assert len(result.trials) >= 2
    assert users_child and users_child[0].poll() is None


def test_a_child_the_step_starts_while_diagnose_measures_is_left_alone(
    users_child: list[subprocess.Popen[bytes]],
) -> None:
    loader = DataLoader(SleepDataset(length=256, latency=0.001), batch_size=8, num_workers=2)
    autoloader.diagnose(loader, _start_a_child_once(users_child), seconds=1)
    assert users_child and users_child[0].poll() is None


def test_the_memory_watch_over_budget_kills_none_of_the_users_children(
    users_child: list[subprocess.Popen[bytes]],
) -> None:
    """The user's children count in the tree's memory, as the budget is the tree's, but
    are not the trial's to kill (its own workers are: test_memory.py)."""
    budget = tree_memory() + (60 << 20)
    with MemoryWatch(budget, interval=0.05) as watch:
        users_child.append(_sleeper())
        users_child.append(
            subprocess.Popen(
                [sys.executable, "-c", "import time; b = bytearray(200 << 20); time.sleep(60)"]
            )
        )
        deadline = time.monotonic() + 20
        while not watch.exceeded and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # more samples, still over the budget
    assert watch.exceeded and watch.peak > budget
    assert [child.poll() for child in users_child] == [None, None]


# Nothing outlives the loop ---------------------------------------------------------------


def _tuning_loader(**kwargs: Any) -> AutoLoader[Any]:
    return AutoLoader(
        SleepDataset(length=4000, latency=0.001),
        batch_size=8,
        time_budget=10,
        # A budget: the watch samples on its thread during each trial.
        memory_budget=tree_memory() + (2 << 30),
        search_space={"num_workers": (2, 2), "worker_kind": ("processes",)},
        verbose=False,
        **kwargs,
    )


def _into_a_trial_with_workers(loader: AutoLoader[Any]) -> Iterator[Any]:
    """An epoch of ``loader``, iterated until a setting with workers loads it."""
    before = {p.pid for p in psutil.Process().children()}
    epoch = iter(loader)
    for _ in range(2000):
        next(epoch)
        setting = loader.setting
        if setting and setting["num_workers"] and _workers_left(before, wait=False):
            return epoch
    raise AssertionError("no trial with workers started")


def test_a_loop_that_breaks_out_of_an_epoch_leaves_nothing_running() -> None:
    before_handlers = _handlers()
    before = {p.pid for p in psutil.Process().children()}
    loader = _tuning_loader()
    try:
        for number, _ in enumerate(loader):
            setting = loader.setting
            if (
                number > 20
                and setting
                and setting["num_workers"]
                and "autoloader-memory" in (_autoloader_threads())
            ):
                break
        else:
            raise AssertionError("no trial with workers started")
        recorded = len(loader.history)
        # The loader lives on (the next epoch may come after an evaluation): the epoch
        # the loop dropped is what stopped.
        assert _autoloader_threads() == []
        assert _workers_left(before) == []
        assert _handlers() == before_handlers
        assert all(a is b for a, b in zip(_handlers(), before_handlers, strict=True))
        # The next epoch tells the study how the abandoned trial went, and goes on.
        epoch = iter(loader)
        next(epoch)
        del epoch
        assert len(loader.history) == recorded + 1
    finally:
        loader.close()
    assert _autoloader_threads() == [] and _workers_left(before) == []


@pytest.mark.usefixtures("ctrl_c_raises")
def test_ctrl_c_in_the_loop_then_del_loader_leaves_nothing_running() -> None:
    before_handlers = _handlers()
    before = {p.pid for p in psutil.Process().children()}
    loader = _tuning_loader()
    collected = weakref.ref(loader)
    with pytest.raises(KeyboardInterrupt):
        for number, _ in enumerate(loader):
            if number > 20 and loader.setting and loader.setting["num_workers"]:
                signal.raise_signal(signal.SIGINT)
    del loader
    assert collected() is None, "the loader outlived its last reference"
    assert _autoloader_threads() == []
    assert _workers_left(before) == []
    assert all(a is b for a, b in zip(_handlers(), before_handlers, strict=True))


def test_a_loader_collected_with_an_epoch_under_way_stops_it() -> None:
    """An epoch and its loader held in a reference cycle are collected together: the
    finalizers stop the trial."""
    before_handlers = _handlers()
    before = {p.pid for p in psutil.Process().children()}
    holder: dict[str, Any] = {}
    holder["self"] = holder
    holder["loader"] = loader = _tuning_loader()
    holder["epoch"] = _into_a_trial_with_workers(loader)
    del loader
    assert _autoloader_threads() != []
    del holder
    gc.collect()
    assert _autoloader_threads() == []
    assert _workers_left(before) == []
    assert all(a is b for a, b in zip(_handlers(), before_handlers, strict=True))


def test_an_epoch_collected_in_another_thread_stops_and_the_next_trial_puts_back() -> None:
    """The garbage collector may finalize an epoch in any thread: its trial stops there
    (thread, workers), and the handlers, which only the main thread can set, are put
    back by the next trial (NOTE [ Handlers put back ])."""
    before_handlers = _handlers()
    before = {p.pid for p in psutil.Process().children()}
    loader = _tuning_loader()
    try:
        holder: dict[str, Any] = {}
        holder["self"] = holder
        holder["epoch"] = _into_a_trial_with_workers(loader)
        gc.disable()  # collected in the thread below, not by chance in this one
        try:
            del holder
            collector = threading.Thread(target=gc.collect, name="collector")
            collector.start()
            collector.join()
        finally:
            gc.enable()
        assert _autoloader_threads() == []
        assert _workers_left(before) == []
        # Not the main thread: the trial's handlers stay, passing every signal on...
        assert not all(a is b for a, b in zip(_handlers(), before_handlers, strict=True))
        next(iter(loader))  # ...until the next trial, in the main thread
    finally:
        loader.close()
    assert all(a is b for a, b in zip(_handlers(), before_handlers, strict=True))


def test_two_autoloaders_tuning_at_once_put_back_the_handlers_found() -> None:
    """A training and a validation AutoLoader, each in a trial, ended out of order."""
    before_handlers = _handlers()
    first, second = _tuning_loader(), _tuning_loader()
    try:
        outer = _into_a_trial_with_workers(first)
        inner = _into_a_trial_with_workers(second)
        del outer  # ends before the trial started after it
        del inner
    finally:
        first.close()
        second.close()
    assert all(a is b for a, b in zip(_handlers(), before_handlers, strict=True))
    assert _autoloader_threads() == []


@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_the_interpreter_exit_with_an_epoch_under_way_leaves_nothing(tmp_path: Path) -> None:
    """A script that exits with an AutoLoader's epoch under way (held in a global): by
    the time its own first exit hook runs, autoloader's thread and handlers are gone; its
    workers are stopped, and no error is printed at exit."""
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import atexit, signal, sys, threading

            found = signal.getsignal(signal.SIGCHLD), signal.getsignal(signal.SIGALRM)

            @atexit.register
            def last() -> None:  # registered first: runs last
                names = [t.name for t in threading.enumerate() if t.is_alive()]
                now = signal.getsignal(signal.SIGCHLD), signal.getsignal(signal.SIGALRM)
                print("threads", *[n for n in names if n.startswith("autoloader-")])
                print("handlers", all(a is b for a, b in zip(now, found)), flush=True)

            sys.path.insert(0, {str(_ROOT)!r})
            import psutil
            from autoloader import AutoLoader
            from autoloader.measure._process_memory import tree_memory
            from tests.workloads import SleepDataset

            loader = AutoLoader(
                SleepDataset(length=4000, latency=0.001),
                batch_size=8,
                time_budget=10,
                memory_budget=tree_memory() + (2 << 30),
                search_space={{"num_workers": (2, 2), "worker_kind": ("processes",)}},
                verbose=False,
            )
            epoch = iter(loader)
            for _ in range(2000):
                next(epoch)
                setting = loader.setting
                if setting and setting["num_workers"] and psutil.Process().children():
                    break
            print("workers", *[p.pid for p in psutil.Process().children()], flush=True)
            """
        )
    )
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    lines = {line.partition(" ")[0]: line.partition(" ")[2] for line in done.stdout.splitlines()}
    assert lines.get("threads", "") == "" and lines["handlers"] == "True", done.stdout
    workers = [int(pid) for pid in lines["workers"].split()]
    assert workers
    assert "Exception" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    deadline = time.monotonic() + 5
    while any(psutil.pid_exists(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(psutil.pid_exists(pid) for pid in workers)
    assert time.monotonic() - started < 60


@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_workers_killed_in_trials_leave_no_temporary_directory() -> None:
    """A worker that hands tensors over listens on a socket in a /tmp/pymp-* directory of
    its own; killed, it left it behind. Forked from a process that has one, it shares
    that, which multiprocessing removes at the process's exit (NOTE [ The workers'
    temporary directory ]): a run whose workers from index 1 up are SIGKILLed after 8
    items leaves nothing in its TMPDIR.

    The TMPDIR is short: a socket's path holds at most 107 bytes, and under pytest-xdist
    tmp_path's was long enough that no worker could listen (none delivered a batch)."""
    with tempfile.TemporaryDirectory(prefix="autoloader-", dir="/tmp") as temporary:
        _killed_workers_leave_nothing_in(Path(temporary))


def _killed_workers_leave_nothing_in(temporary: Path) -> None:
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(_ROOT)!r})
        import autoloader
        from tests.workloads import FaultInWorkersDataset, noop_step

        result = autoloader.tune(
            FaultInWorkersDataset("SIGKILL", length=4096, from_worker=1, after=8),
            noop_step,
            batch_size=4,
            time_budget=6,
            search_space={{"num_workers": (2, 3), "worker_kind": ("processes",)}},
            show_progress=False,
        )
        print("killed", sum(t.kind == "killed" for t in result.trials), flush=True)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TMPDIR": str(temporary)},
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split("killed")[-1]) > 0, done.stdout  # workers were killed
    assert sorted(p.name for p in temporary.iterdir() if p.name.startswith("pymp-")) == []
