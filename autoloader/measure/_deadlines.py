"""Deadlines: how long a step of a trial or a check may take, and the alarm that breaks
it when it overruns."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType


class TrialTimeout(Exception):
    """One step of the loop (loading a batch, or step_fn) overran its deadline."""

    def __init__(self, stage: str, seconds: float) -> None:
        shown = f"{seconds:.1f}" if seconds < 1 else f"{seconds:.0f}"
        super().__init__(f"no progress for {shown} s while {stage}")
        self.stage = stage
        self.seconds = seconds

    def __reduce__(self) -> tuple[type[TrialTimeout], tuple[str, float]]:
        return type(self), (self.stage, self.seconds)


# Seconds each worker may take to start, on top of the first batch's deadline.
_STARTUP_PER_WORKER = 3.0


@dataclass(frozen=True, slots=True)
class Deadlines:
    """Seconds the loop may spend on one batch before the trial is failed as hung.

    Attributes:
        first: for the first batch of an epoch, worker start-up included.
        each: for any later batch: loading it plus running ``step_fn`` on it.
    """

    first: float
    each: float

    @classmethod
    def per_batch(cls, each: float, *, workers: int) -> Deadlines:
        """``each`` for every batch, and time for ``workers`` to start on the first."""
        return cls(first=each + _STARTUP_PER_WORKER * workers, each=each)


class Alarm:
    """Raises :class:`TrialTimeout` in the main thread when a stage overruns.

    A one-shot ``ITIMER_REAL`` is armed before each stage and disarmed after it: the
    SIGALRM interrupts a main thread blocked waiting for a hung worker or sleeping in a
    hung step. Signals reach only the main thread, so elsewhere there is no deadline.
    A process has one such timer: one already set (by the user's code, or a test
    runner's timeout) is put back afterwards with the time it had left.
    """

    def __init__(self) -> None:
        self.enabled = threading.current_thread() is threading.main_thread()
        self._stage = ""
        self._seconds = 0.0

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

    def arm(self, stage: str, seconds: float | None) -> None:
        if self.enabled and seconds is not None:
            self._stage, self._seconds = stage, seconds
            signal.setitimer(signal.ITIMER_REAL, seconds)

    def disarm(self) -> None:
        if self.enabled:
            signal.setitimer(signal.ITIMER_REAL, 0)

    def _fire(self, signum: int, frame: FrameType | None) -> None:
        raise TrialTimeout(self._stage, self._seconds)


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
