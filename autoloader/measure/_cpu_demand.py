"""CPU demand: the CPU time this process and one of its threads used, plus the time
their threads were ready to run but waited for a CPU.

NOTE [ CPU demand ]
Whether the step works on the CPU (``NOTE [ Step threads ]`` in ``search/_policy.py``),
and how many CPUs it keeps busy (``diagnose()``), are read from CPU time over the step's
wall time. On a busy machine a thread that computes all the time is on a CPU only part
of it: with one busy-loop process beside it on two cores, a step training on two torch
threads measured 0.79 CPUs where it asks for 2, and the rules took it for a step that
waits (on an accelerator, or in a sleep). What a thread asks of the CPUs is the time it
ran plus the time it was runnable and waited for a CPU: Linux counts the latter for
each thread as its run delay, the second field of ``/proc/self/task/<tid>/schedstat``
(nanoseconds; the first is the time on a CPU). A thread that sleeps or waits on a lock,
a pipe or a device is not runnable and gathers none. So the demand is the clock's CPU
time (``thread_time()``, ``process_time()``) plus the run delay of the thread, or of all
the process's threads. Where those files are missing (not Linux), it is the CPU time
alone.

Each thread's file is kept open and read again with one ``pread`` (about a microsecond);
the process's threads are listed again at most every ``_RELIST`` seconds. A thread is
counted from when it is first seen, and a thread that ends loses what it gathered since
the last read: the demand is never overstated.

Worker processes are other processes: their CPU time is counted once they are reaped
(``os.times()``), but not their run delay, which ends with them. ``ChildrenRunDelay``
reads it from ``/proc/<pid>/task/<tid>/schedstat`` of each child started while it
runs, on a thread of its own, every ``interval``: a child's last read before it exits
counts, and what it waited in its last ``interval`` is lost (never overstated). With
one worker burning CPU and two test processes on two cores, ``diagnose()`` measured
the worker on a CPU a third of the loop and called it waiting on I/O.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from time import perf_counter, process_time, thread_time

import psutil

_TASKS = "/proc/self/task"
_RELIST = 0.1


class CpuDemand:
    """Reads the CPU demand of this process, and of the thread that made this object
    (see ``NOTE [ CPU demand ]``). :meth:`close` it when done: it holds open files.

    ``read()`` returns running totals in seconds: differences between two reads are the
    demand between them.
    """

    def __init__(self) -> None:
        self._own = threading.get_native_id()
        self._files: dict[int, int] = {}  # thread id: its open schedstat
        self._seen: dict[int, int] = {}  # thread id: its run delay (ns) at the last read
        self._delay = 0  # the process's threads' run delay gathered since they were seen
        self._listed = -math.inf
        own = self._open(self._own)
        delay = None if own is None else _run_delay(own)
        self.available = own is not None and delay is not None
        if own is not None and delay is not None:
            self._files[self._own], self._seen[self._own] = own, delay
        elif own is not None:
            os.close(own)

    def read(self) -> tuple[float, float, float]:
        """``perf_counter()``, and the process's and this thread's CPU demand, in seconds.

        The CPU clocks are read first: a thread that is due to give up its CPU does so
        at such a system call, and the wait that follows then counts in the interval
        that ends here on both the wall clock and the run delay, read after it. (Read
        last, the clocks left it out of the run delay: a step on the CPU with one busy
        process beside it on its core measured 0.7 of its wall time; read between the
        wall clock and the files, 1.4.)
        """
        own, process = thread_time(), process_time()
        now = perf_counter()
        if not self.available:
            return now, process, own
        if now - self._listed >= _RELIST:
            self._listed = now
            self._relist()
        own_delay = 0
        for tid, fd in list(self._files.items()):
            delay = _run_delay(fd)
            if delay is None:  # the thread ended
                self._drop(tid)
                continue
            self._delay += delay - self._seen[tid]
            self._seen[tid] = delay
            if tid == self._own:
                own_delay = delay
        return now, process + self._delay / 1e9, own + own_delay / 1e9

    def close(self) -> None:
        for tid in list(self._files):
            self._drop(tid)
        self.available = False

    def _relist(self) -> None:
        try:
            tids = {int(name) for name in os.listdir(_TASKS)}
        except OSError:
            return
        for tid in tids - self._files.keys():
            fd = self._open(tid)
            delay = None if fd is None else _run_delay(fd)
            if fd is None or delay is None:
                if fd is not None:
                    os.close(fd)
                continue
            self._files[tid], self._seen[tid] = fd, delay  # counted from now on

    def _drop(self, tid: int) -> None:
        fd = self._files.pop(tid)
        self._seen.pop(tid, None)
        with contextlib.suppress(OSError):
            os.close(fd)

    @staticmethod
    def _open(tid: int) -> int | None:
        try:
            return os.open(f"{_TASKS}/{tid}/schedstat", os.O_RDONLY)
        except OSError:
            return None


def _run_delay(fd: int) -> int | None:
    """The run delay (ns) in an open schedstat file; ``None`` once its thread ended."""
    try:
        fields = os.pread(fd, 128, 0).split()
        return int(fields[1])
    except (OSError, IndexError, ValueError):
        return None


class ChildrenRunDelay:
    """The run delay of this process's children started while it runs: ``with`` it
    around what starts them, then read :attr:`seconds` (``NOTE [ CPU demand ]``). It
    only reads their ``/proc`` files; where those are missing (not Linux), 0.

    Args:
        interval: seconds between reads.
    """

    def __init__(self, interval: float = 0.05) -> None:
        self.interval = interval
        self._process = psutil.Process()
        self._before: set[int] = set()
        self._delays: dict[int, int] = {}  # child pid: its threads' run delay (ns)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def seconds(self) -> float:
        """The children's run delay gathered up to their last read."""
        return sum(self._delays.values()) / 1e9

    def __enter__(self) -> ChildrenRunDelay:
        self._before = {child.pid for child in self._children()}
        self._thread = threading.Thread(target=self._run, name="autoloader-run-delay", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while True:
            self._read()
            if self._stop.wait(self.interval):
                return

    def _read(self) -> None:
        for child in self._children():
            if child.pid in self._before:
                continue
            delay = _process_run_delay(child.pid)
            if delay is not None:
                self._delays[child.pid] = max(delay, self._delays.get(child.pid, 0))

    def _children(self) -> list[psutil.Process]:
        try:
            children: list[psutil.Process] = self._process.children()
        except psutil.Error:
            return []
        return children


def _process_run_delay(pid: int) -> int | None:
    """The run delay (ns) of the threads of process ``pid``; ``None`` if unreadable."""
    tasks = f"/proc/{pid}/task"
    try:
        tids = os.listdir(tasks)
    except OSError:
        return None
    total = 0
    for tid in tids:
        try:
            fd = os.open(f"{tasks}/{tid}/schedstat", os.O_RDONLY)
        except OSError:
            continue
        try:
            total += _run_delay(fd) or 0
        finally:
            os.close(fd)
    return total
