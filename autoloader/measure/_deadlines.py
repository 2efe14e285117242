"""Deadlines: how long a step of a trial or a check may take, and the alarm that breaks
it when it overruns."""

from __future__ import annotations

import collections
import contextlib
import functools
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

import psutil

from autoloader.loader._torch_compat import awaited_batch, worker_processes


class TrialTimeout(Exception):
    """One step of the loop (loading a batch, or step_fn) overran its deadline;
    ``detail``, where given, says who was late and how that was told."""

    def __init__(self, stage: str, seconds: float, detail: str | None = None) -> None:
        shown = f"{seconds:.1f}" if seconds < 1 else f"{seconds:.0f}"
        super().__init__(detail or f"no progress for {shown} s while {stage}")
        self.stage = stage
        self.seconds = seconds
        self.detail = detail

    def __reduce__(self) -> tuple[type[TrialTimeout], tuple[str, float, str | None]]:
        return type(self), (self.stage, self.seconds, self.detail)


# Seconds each worker may take to start, on top of the first batch's deadline, where
# the start-up was not measured (see Deadlines.per_batch).
STARTUP_PER_WORKER = 3.0

# NOTE [ The first step ]
# A trial that makes the process's first call of step_fn (the search's baseline, the
# check of a reused setting) meets the training step's one-time set-up there: a model
# built on first use, DDP wrapping it (its first broadcast waits for every rank),
# torch.compile, cuDNN's autotuning. That step may take FIRST_STEP_TIMEOUT seconds at
# least (the baseline: the whole time budget, if longer) before it counts as hung;
# every later step has its batch's deadline. Held to the batch's (3 s at a 4 s budget),
# the first step of examples/torchrun_ddp.py, about 1 s here, took over 6 s under
# torchrun beside four tests and a busy loop in CI, and the run failed as "a fault in
# step_fn". A step that blocks on its first call is found that much later.
FIRST_STEP_TIMEOUT = 10.0
# What a trial was doing when its first step overran that deadline: the timeout says
# so, and the baseline's error tells a set-up that takes longer from a step that blocks.
FIRST_STEP_STAGE = "running step_fn's first call"


@dataclass(frozen=True, slots=True)
class Deadlines:
    """Seconds the loop may spend on one batch before the trial is failed as hung.

    Attributes:
        first: for the first batch of an epoch, worker start-up included.
        each: for any later batch: loading it plus running ``step_fn`` on it.
        sibling: for a batch whose worker is late while other workers of the trial have
            delivered batches given out after it (``NOTE [ Sibling pace ]``); ``None``
            leaves it to ``first`` and ``each``.
        start_each: seconds one worker may take to start: a worker's first batch may be
            that much later than those of workers started before it.
        first_step: for ``step_fn`` on the trial's first batch, where its first call
            may do the user's one-time set-up (``NOTE [ The first step ]``); ``None``
            leaves it to ``each``.
    """

    first: float
    each: float
    sibling: float | None = None
    start_each: float = STARTUP_PER_WORKER
    first_step: float | None = None

    @classmethod
    def per_batch(
        cls,
        each: float,
        *,
        workers: int,
        sibling: float | None = None,
        start_each: float = STARTUP_PER_WORKER,
        first_step: float | None = None,
    ) -> Deadlines:
        """``each`` for every batch, and time for ``workers`` to start on the first."""
        return cls(
            first=each + start_each * workers,
            each=each,
            sibling=sibling,
            start_each=start_each,
            first_step=first_step,
        )


# NOTE [ Sibling pace ]
# A worker that hangs (a fault at worker index k and above, a deadlock in its copy of a
# library) stalls an in-order loader at its batch while the other workers deliver the
# batches given out after it, and then wait. DataLoader knows which worker owns which
# batch, so the stall can be told from the siblings' pace, before a timing window has
# set the trial's own pace (NOTE [ Pace deadline ]) and without waiting for a deadline
# sized for the slowest legitimate batch and for worker start-up: once another worker
# has delivered a batch given out after the awaited one, the awaited one may take
# ``Deadlines.sibling`` seconds more (a multiple of the time a worker takes per batch,
# from the baseline), plus, for a worker's first batch of the epoch, the time to start
# the workers started after those that delivered (start-up is serial). Polled every
# _POLL seconds by the trial's alarm, in the main thread: nothing runs on the side.
_POLL = 0.25

# NOTE [ A late worker that works ]
# Late by its siblings' pace is not hung where the worker is working: on a loaded
# machine a worker's fork, its start and its first item take longer than the start-up
# measured before the search, and a worker filling memory toward the budget is slower
# still (beside three other tests' processes, a two-node job's third worker, filling
# 1 GiB, was called hung 1.5 s after its siblings delivered, before the memory watch
# saw the budget passed). A hung worker uses no CPU: it waits on a lock, a read, a
# sleep. So a batch late by its siblings' pace is called hung only if its worker's
# process used under _WORKING_CPU seconds of CPU over the last _WORKING_WINDOW seconds
# (at least one poll apart); a worker that used more is waited for, up to the stage's
# own deadline, which still finds a worker that spins forever. Where the CPU cannot be
# read (the process is gone, or no process: thread workers), the pace alone decides.
_WORKING_WINDOW = 1.0
_WORKING_CPU = 0.05

# NOTE [ A swallowed timeout ]
# The alarm's TrialTimeout is raised in whatever code the main thread runs, and code
# that catches every Exception swallows it: torch logs and goes on when a lazy import
# (torch.profiler's, at a loader's first batch) is interrupted, as can a user's retry
# loop. A one-shot alarm would then never fire again, and a read that blocks next would
# block forever. So the alarm, once fired, fires again every _REFIRE seconds until the
# stage is disarmed: longer than a ThreadLoader waits for its threads on the way out
# (2 s), so that the timeout's own unwinding is never interrupted.
_REFIRE = 3.0


class SiblingPace:
    """Raises :class:`TrialTimeout` when the batch ``iterator`` waits for is late by
    its siblings' pace (see ``NOTE [ Sibling pace ]``); called by :class:`Alarm`.

    Args:
        iterator: the trial's current DataLoader iterator.
        seconds: ``Deadlines.sibling``.
        start_each: ``Deadlines.start_each``.
        workers: the trial's worker count.
        clock: seconds (a fake one in tests).
        cpu_seconds: the CPU seconds a worker (by its index) has used, or ``None`` where
            they cannot be read (a fake in tests; by default its process's).
    """

    def __init__(
        self,
        iterator: object,
        seconds: float,
        *,
        start_each: float,
        workers: int,
        clock: Callable[[], float] = time.monotonic,
        cpu_seconds: Callable[[int], float | None] | None = None,
    ) -> None:
        self.iterator = iterator
        self.seconds = seconds
        self.start_each = start_each
        self.workers = workers
        self._clock = clock
        self._cpu_seconds = cpu_seconds or functools.partial(_worker_cpu_seconds, iterator)
        self._index: int | None = None
        self._since = 0.0
        self._cpu: collections.deque[tuple[float, float]] = collections.deque()

    def __call__(self) -> None:
        found = awaited_batch(self.iterator)
        if found is None or not found[2]:
            self._index = None
            return
        index, worker, later = found
        now = self._clock()
        if self._index != index:
            self._index, self._since = index, now
            self._cpu.clear()
            self._note_cpu(worker, now)
            return
        self._note_cpu(worker, now)
        allowed = self.seconds
        if index < self.workers and worker > max(later):  # its first batch; started later
            allowed += self.start_each * (worker - max(later))
        waited = now - self._since
        if waited < allowed or self._working():
            return
        names = ", ".join(map(str, sorted(later)))
        raise TrialTimeout(
            "loading a batch",
            waited,
            f"worker {worker} is hung while loading a batch: its batch {index} is "
            f"{waited:.1f} s overdue while worker{'s' if len(later) > 1 else ''} {names} "
            f"delivered {sum(later.values())} batches given out after it",
        )

    def _note_cpu(self, worker: int, now: float) -> None:
        """Keep the awaited worker's CPU seconds at ``now``, and the newest reading at
        least ``_WORKING_WINDOW`` older (or the oldest): see ``NOTE [ A late worker
        that works ]``."""
        used = self._cpu_seconds(worker)
        if used is None:
            self._cpu.clear()
            return
        self._cpu.append((now, used))
        while len(self._cpu) > 2 and now - self._cpu[1][0] >= _WORKING_WINDOW:
            self._cpu.popleft()

    def _working(self) -> bool:
        """Whether the awaited worker used ``_WORKING_CPU`` seconds of CPU or more over
        the readings kept."""
        if len(self._cpu) < 2:
            return False
        return self._cpu[-1][1] - self._cpu[0][1] >= _WORKING_CPU


def _worker_cpu_seconds(iterator: object, worker: int) -> float | None:
    """The CPU seconds worker process ``worker`` of ``iterator`` has used (its threads'),
    or ``None`` where there is no such process or it is gone."""
    workers = worker_processes(iterator)
    pid = workers[worker].pid if 0 <= worker < len(workers) else None
    if pid is None:
        return None
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:  # gone, a zombie, or not ours to read
        return None
    return float(times.user + times.system)


class Alarm:
    """Raises :class:`TrialTimeout` in the main thread when a stage overruns.

    A one-shot ``ITIMER_REAL`` is armed before each stage and disarmed after it: the
    SIGALRM interrupts a main thread blocked waiting for a hung worker or sleeping in a
    hung step; once fired, it fires again until disarmed (``NOTE [ A swallowed
    timeout ]``). Signals reach only the main thread, so elsewhere there is no deadline
    (``NOTE [ Main thread only ]``: tune() and diagnose() refuse other threads).
    A process has one such timer: one already set (by the user's code, or a test
    runner's timeout) is put back afterwards with the time it had left.
    """

    def __init__(self) -> None:
        self.enabled = threading.current_thread() is threading.main_thread()
        self._stage = ""
        self._seconds = 0.0
        self._due = math.inf
        self._poll: Callable[[], None] | None = None

    @contextlib.contextmanager
    def installed(self) -> Iterator[Alarm]:
        if not self.enabled:
            yield self
            return
        delay, interval = signal.getitimer(signal.ITIMER_REAL)
        started = time.monotonic()
        previous = signal.signal(signal.SIGALRM, self._fire)
        try:
            yield self
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            if delay > 0:
                left = max(delay - (time.monotonic() - started), 1e-3)
                signal.setitimer(signal.ITIMER_REAL, left, interval)

    def arm(
        self, stage: str, seconds: float | None, *, poll: Callable[[], None] | None = None
    ) -> None:
        """Raise :class:`TrialTimeout` once ``stage`` has run ``seconds`` (``None``: no
        limit), and call ``poll`` every ``_POLL`` seconds until then: it may raise."""
        if not self.enabled or (seconds is None and poll is None):
            return
        self._stage, self._seconds, self._poll = stage, seconds or 0.0, poll
        self._due = math.inf if seconds is None else time.monotonic() + seconds
        self._next_tick(seconds if seconds is not None else math.inf)

    def disarm(self) -> None:
        if self.enabled:
            signal.setitimer(signal.ITIMER_REAL, 0)
            self._poll = None

    def _next_tick(self, left: float) -> None:
        delay = min(left, _POLL) if self._poll is not None else left
        signal.setitimer(signal.ITIMER_REAL, max(delay, 1e-4))

    def _fire(self, signum: int, frame: FrameType | None) -> None:
        left = self._due - time.monotonic()
        if left <= 1e-3:
            # NOTE [ A swallowed timeout ]: fire again should this one be caught.
            signal.setitimer(signal.ITIMER_REAL, _REFIRE)
            raise TrialTimeout(self._stage, self._seconds)
        if self._poll is not None:
            self._poll()
        self._next_tick(left)


@contextlib.contextmanager
def time_limit(seconds: float, stage: str) -> Iterator[None]:
    """Raise :class:`TrialTimeout` in the block once it has run ``seconds``.

    The same alarm as a trial's (see :class:`Alarm`): it breaks user code that loops or
    waits in Python, in the main thread; elsewhere the block runs without a limit.
    """
    with Alarm().installed() as alarm:
        alarm.arm(stage, seconds)
        try:
            yield
        finally:
            alarm.disarm()


def alarm_unused() -> bool:
    """Whether this is the main thread and nothing else has set a SIGALRM handler or
    the process's real-time timer."""
    if threading.current_thread() is not threading.main_thread():
        return False
    handler = signal.getsignal(signal.SIGALRM)
    return handler in (signal.SIG_DFL, None) and signal.getitimer(signal.ITIMER_REAL)[0] == 0


# SIGALRM handlers of trials closed outside the main thread, which could not put back
# the SIG_DFL they found (a trial holds the alarm only where it found SIG_DFL): the next
# trial does, in the main thread (NOTE [ Nothing outlives the loop ], in
# autoloader/_loop_epoch.py).
stale_alarms: list[Any] = []


def put_back_stale_alarms() -> None:
    """Put back the SIG_DFL that trials closed outside the main thread could not."""
    if threading.current_thread() is not threading.main_thread():
        return
    while stale_alarms:
        if signal.getsignal(signal.SIGALRM) == stale_alarms.pop():
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
